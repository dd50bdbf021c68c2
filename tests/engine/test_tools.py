"""Tools: known answers, readable errors, and a Toolbox that never raises on any call text.

Run: python -m pytest tests/engine/test_tools.py -q
"""

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from minagent import tools
from minagent.tools import BUSY, MAX_RESULT, Toolbox

TABLE = (("Paul", 34, "Lyon"), ("Anna", 57, "Oslo"))


def test_known_answers():
    assert tools.add("4821 3907") == "8728"
    assert tools.add("-5 3") == "-2"
    assert tools.reverse("butter") == "rettub"
    assert tools.sort("81 5 23") == "5 23 81"      # as numbers: "5" < "23" although "23" < "5" as strings
    assert tools.mul("12 34") == "408"
    assert tools.lookup(TABLE, "Paul age") == "34"
    assert tools.lookup(TABLE, "Paul city") == "Lyon"
    assert tools.lookup(TABLE, "anna CITY") == "Oslo"


@pytest.mark.parametrize("call, error", [
    ("add 4821", "error: add takes two numbers"),
    ("add 4821 + 3907", "error: add takes two numbers"),
    ("add", "error: add takes two numbers"),
    ("add 4x 3", "error: not a number: 4x"),
    ("add 4821 3907?", "error: not a number: 3907?"),
    ("add ٤ 1", "error: not a number: ٤"),              # int() would take an Arabic-Indic digit; we do not
    ("add " + "9" * 30 + " 1", "error: number too long: " + "9" * 16 + "..."),
    ("mul 3", "error: mul takes two numbers"),
    ("reverse two words", "error: reverse takes one word"),
    ("reverse", "error: reverse takes one word"),
    ("sort", "error: sort takes numbers"),
    ("sort 81, 5, 23", "error: not a number: 81,"),
    ("sort " + "1 " * 17, "error: sort takes at most 16 numbers"),
    ("lookup Zed age", "error: unknown person Zed"),
    ("lookup Paul", "error: lookup takes a name and age or city"),
    ("lookup Paul height", "error: lookup takes a name and age or city"),
    ("foo 1 2", "error: unknown tool foo"),
    ("", "error: empty call"),
    ("   ", "error: empty call"),
])
def test_error_strings(call, error):
    assert Toolbox(0)(call) == error                    # Zed is in no table: not in tools.NAMES


def test_toolbox_strips_whitespace_counts_and_logs():
    box = Toolbox(0)
    assert box("  add 1 2 \n") == "3"
    assert box("reverse\tab") == "ba"
    assert box.calls == 2
    assert box.log == [("  add 1 2 \n", "3"), ("reverse\tab", "ba")]


def test_a_toolbox_serves_the_tools_it_is_given():
    box = Toolbox(tools={"add": tools.add, "shout": str.upper})
    assert box("add 1 2") == "3" and box("shout hi") == "HI"
    assert box("mul 2 3") == "error: unknown tool mul"
    assert Toolbox(tools=())("add 1 2") == "error: unknown tool add"       # the control: no tools at all
    assert Toolbox(tools={"echo": lambda a: a}, max_result=5)("echo abcdefgh") == "ab..."


def test_fail_first_fails_exactly_the_first_call():
    box = Toolbox(3, fail_first=True)
    assert box("add 1 2") == BUSY
    assert [box("add 1 2") for _ in range(3)] == ["3"] * 3
    assert box.calls == 4
    # a malformed first call gets BUSY too: the failure does not look at the call
    assert Toolbox(3, fail_first=True)("nonsense") == BUSY
    assert Toolbox(3)("add 1 2") == "3"


def test_people_table_is_seeded():
    t0, t1 = tools.people_table(0), tools.people_table(1)
    assert t0 == tools.people_table(0)                  # same seed, same table
    assert t0 != t1                                     # another episode, another table
    assert len({tools.people_table(s) for s in range(20)}) == 20
    for table in (t0, t1):
        assert len(table) == 16
        assert len({name for name, _, _ in table}) == 16
        for name, age, city in table:
            assert name in tools.NAMES and city in tools.CITIES and 18 <= age <= 90


def test_lookup_through_toolbox_reads_the_episode_table():
    box, table = Toolbox(5), tools.people_table(5)
    for name, age, city in table:
        assert box(f"lookup {name} age") == str(age)
        assert box(f"lookup {name} city") == city
    missing = next(n for n in tools.NAMES if n not in {p for p, _, _ in table})
    assert box(f"lookup {missing} age") == f"error: unknown person {missing}"


def _check(result):
    assert isinstance(result, str)
    assert len(result) <= MAX_RESULT                    # (text that spells a token is harmless: chat.encode)


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_any_text_never_raises(call):
    _check(Toolbox(0)(call))


_words = st.one_of(
    st.integers(min_value=-10**60, max_value=10**60).map(str),
    st.text(max_size=30).filter(lambda s: s.split() == [s]),            # one whitespace-free word, any unicode
    st.sampled_from(["Paul", "age", "city", "+", "<|end|>", ">|dne|<", "nan", "1e9", "0x10", "٤", "１２"]),
    st.text(alphabet="0123456789", min_size=1, max_size=5000),          # huge numbers
)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(tuple(tools.calculator(0)) + ("foo",)), st.lists(_words, max_size=20), st.booleans())
def test_structured_garbage_never_raises(name, args, fail_first):
    box = Toolbox(1, fail_first=fail_first)
    call = " ".join([name] + args)
    _check(box(call))
    _check(box(call))
    assert box.calls == 2


def test_a_result_that_spells_a_special_token_is_kept_as_it_is():
    """The toolbox does not escape it: the line is drawn where text becomes ids (chat.encode)."""
    assert Toolbox(0)("reverse >|dne|<") == "<|end|>"
    assert Toolbox(0)("foo<|end|>") == "error: unknown tool foo<|end|>"
