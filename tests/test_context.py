"""Fitting a history into a budget, and counting tokens: invariants over random histories.

Run: /work/venv/bin/python -m pytest tests/test_context.py -q      (about 10 s on CPU)

Histories are random: a first message, then user turns, rounds (a call and its
result) and answers in any order, with results from a few characters to 60,000.
Tokens are counted as len(text) // 4 + 1. The estimator tests read the four
samples in tests/data/scripts/ and compare with SmolLM2's tokenizer (skipped
without its GGUF file) and minagent's WordNet BPE (skipped unless
experiments/01_tokenization.py has cached it).
"""

import copy
import dataclasses
import math
import pathlib

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from minagent import chat
from minagent import context as cx
from minagent import tokenizer as tk
from minagent.context import CLEARED, NOTE, REFUSED, Message

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "data" / "scripts"
WORDNET_TOK = ROOT / "experiments" / "results" / "wordnet-bpe-8192.tok"
SETTINGS = settings(deadline=None, max_examples=200)


def count(m):
    return len(m.text) // 4 + 1


# ---------------------------------------------------------------- random histories

# result sizes in characters: tiny (never cleared), small, medium, huge
SIZES = st.one_of(st.integers(0, 60), st.integers(60, 400), st.integers(400, 3000), st.integers(3000, 60_000))


@st.composite
def histories(draw, turns=True):
    """A well-formed history. Texts are unique ("3:xxxx"), so equal messages are the same message."""
    h = [Message("first", "0:" + "f" * draw(st.integers(0, 1000)))]
    # with turns, half the histories are sub-agent-like (one long turn) anyway: step 3's case
    events = ["round", "round", "round", "answer"] + (["user"] if turns and draw(st.booleans()) else [])
    for event in draw(st.lists(st.sampled_from(events), max_size=60)):
        if event == "round":
            h.append(Message("model", f"{len(h)}:<|call|>cat {'c' * draw(st.integers(0, 80))}<|result|>"))
            h.append(Message("result", f"{len(h)}:" + "r" * draw(SIZES)))
        elif event == "answer":
            h.append(Message("model", f"{len(h)}:" + "a" * draw(st.integers(0, 400)) + "<|end|>"))
        else:
            h.append(Message("user", f"{len(h)}:" + "u" * draw(st.integers(0, 4000))))
    return tuple(h)


@st.composite
def cases(draw, turns=True):
    """(history, budget): the budget is any number, a small one, a fraction of the history's
    tokens, or a little over about what step 3 or step 2 would send."""
    h = draw(histories(turns))
    total = sum(map(count, h))
    users = [i for i, m in enumerate(h) if m.kind == "user"] or [len(h) - 2]
    least = count(h[0]) + count(NOTE) + sum(map(count, h[-2:]))            # about the least step 3 sends
    turn = count(h[0]) + count(NOTE) + sum(map(count, h[users[-1]:])) // 2  # about what step 2 sends
    budget = draw(st.one_of(st.integers(1, 40_000), st.integers(1, 3_000),
                            st.floats(0.02, 1.1).map(lambda x: max(1, int(x * total))),
                            st.integers(0, 2_000).map(lambda k: least + k),
                            st.integers(0, 2_000).map(lambda k: turn + k)))
    return h, budget


def expected_view(h, f):
    """What the view must be, from the Fit's indices alone: the first message, the note when
    something was dropped, then every message not dropped, in order, cleared ones as the note."""
    rest = tuple(CLEARED if i in f.cleared else h[i] for i in range(1, len(h)) if i not in f.dropped)
    return (h[0],) + ((NOTE,) if f.dropped else ()) + rest


def whole_by_size(h, budget):
    """The results step 1 keeps whole, computed here again: the newest whose counts together
    fit in a quarter of the budget, and at least the newest one."""
    results = [i for i, m in enumerate(h) if m.kind == "result"]
    keep, used = [], 0
    for i in reversed(results):
        used += count(h[i])
        if keep and used > budget / 4:
            break
        keep.append(i)
    return set(keep)


# ---------------------------------------------------------------- fit: invariants

@SETTINGS
@given(cases())
def test_fit_invariants(case):
    h, budget = case
    before = copy.deepcopy(h)
    f = cx.fit(h, budget, count)
    assert h == before                                    # the stored history is unchanged
    if f.refused:
        assert f.view == () and f.tokens > budget
        return
    assert f.step in (0, 1, 2, 3)
    assert f.tokens == sum(count(m) for m in f.view) <= budget
    assert f.view[0] is h[0]                              # the first message is always kept
    assert f.view == expected_view(h, f)                  # nothing else is changed, nothing reordered
    assert len(h) - 1 not in f.dropped                    # the newest message is always sent
    assert not set(f.cleared) & set(f.dropped)
    assert (f.step == 0) == (f.view == h)
    assert (f.step in (2, 3)) == bool(f.dropped)


@SETTINGS
@given(cases())
def test_a_call_is_never_separated_from_its_result(case):
    h, budget = case
    f = cx.fit(h, budget, count)
    for i, m in enumerate(h):
        if m.kind == "result":
            assert (i in f.dropped) == (i - 1 in f.dropped)
    for prev, m in zip(f.view, f.view[1:]):
        if m.kind == "result":
            assert prev.kind == "model" and "<|call|>" in prev.text


@SETTINGS
@given(cases())
def test_clearing_rules(case):
    h, budget = case
    f = cx.fit(h, budget, count)
    can = cx.clearable(h, budget, count)
    if f.step == 1:
        # the oldest 4j clearable results, or all of them when fewer than four would be left
        n = len(f.cleared)
        assert list(f.cleared) == can[:n]
        assert n % 4 == 0 or n == len(can)
        assert n in cx.group_sizes(len(can))
        smaller = [k for k in cx.group_sizes(len(can)) if k < n]   # the group before did not fit
        if smaller:
            saved = sum(count(h[i]) - count(CLEARED) for i in can[:smaller[-1]])
            assert sum(map(count, h)) - saved > budget
    if f.step in (2, 3):                                  # on top of all of step 1's clearing
        assert set(can) <= set(f.cleared) | set(f.dropped)
    for i in f.cleared:                                   # small results are left alone
        assert count(h[i]) > cx.SMALL_FACTOR * count(CLEARED)
    assert not whole_by_size(h, budget) & set(f.cleared)   # the newest, within a quarter, stay whole
    results = [m for m in f.view if m.kind == "result"]
    if results:                                            # at least one result stays whole
        assert any(m is not CLEARED for m in results)


@SETTINGS
@given(cases(), st.integers(0, 60_000))
def test_the_cleared_prefix_only_grows(case, size):
    h, budget = case
    """For the prefix cache: one more round never puts back a result that was cleared, and
    the cleared set changes only by whole groups (or by taking all clearable ones)."""
    longer = h + (Message("model", f"{len(h)}:<|call|>cat x<|result|>"), Message("result", f"{len(h) + 1}:" + "r" * size))
    f1, f2 = cx.fit(h, budget, count), cx.fit(longer, budget, count)
    assume(f1.step in (0, 1) and f2.step in (0, 1))
    assert set(f1.cleared) <= set(f2.cleared)


@SETTINGS
@given(histories(turns=False), st.data())
def test_old_trim_refuses_one_long_turn_that_fit_serves(h, data):
    """A sub-agent's history: one turn, its brief, then rounds. Over budget, old_trim has nowhere
    to cut; fit sends the newest rounds whenever the newest one fits next to the brief and note."""
    assume(h[-1].kind == "result")
    total = sum(map(count, h))
    need = count(h[0]) + count(NOTE) + count(h[-2]) + count(h[-1])
    assume(need < total)
    budget = data.draw(st.integers(need, total - 1))
    assert cx.old_trim(h, budget, count).refused
    f = cx.fit(h, budget, count)
    assert not f.refused and f.tokens <= budget and f.view[-2:] == h[-2:]


@SETTINGS
@given(cases())
def test_old_trim_cuts_only_where_a_user_message_starts(case):
    h, budget = case
    f = cx.old_trim(h, budget, count)
    assert f.cleared == ()
    if f.refused:
        return
    assert f.tokens == sum(map(count, f.view)) <= budget
    if f.dropped:
        assert f.view[:2] == (h[0], NOTE) and f.view[2].kind == "user"
        assert f.view[2:] == h[max(f.dropped) + 1:]


# ---------------------------------------------------------------- fit: known answers

def note5(m):
    """The docstring's counts: a note is 5 tokens, anything else one per character."""
    return 5 if m.text in (cx.CLEARED_NOTE, cx.TRIMMED_NOTE) else len(m.text)


def six_rounds():
    h = [Message("first", "f" * 10)]
    for k in range(6):
        h += [Message("model", f"c{k}"), Message("result", "abcdef"[k] * 20)]
    return tuple(h)


def test_worked_example():
    h = six_rounds()                                       # 10 + 6 * (2 + 20) = 142 tokens
    assert cx.fit(h, 200, note5) == cx.Fit(h, 0, (), (), 142)
    f = cx.fit(h, 100, note5)                              # r1..r4 cleared, four at once, not three
    assert (f.step, f.cleared, f.dropped, f.tokens) == (1, (2, 4, 6, 8), (), 82)
    f = cx.fit(h, 100, note5, group=1)                     # one at a time: three are enough
    assert (f.step, f.cleared, f.dropped, f.tokens) == (1, (2, 4, 6), (), 97)
    assert cx.group_sizes(10, group=3) == [3, 6, 9, 10] and cx.group_sizes(0) == []
    with pytest.raises(ValueError, match="group"):
        cx.group_sizes(10, group=0)
    f = cx.fit(h, 60, note5)                               # all five cleared is 67: drop rounds too
    assert (f.step, f.cleared, f.dropped, f.tokens) == (3, (6, 8, 10), (1, 2, 3, 4), 58)
    assert f.view[:2] == (h[0], NOTE) and f.view[-2:] == h[-2:]
    f = cx.fit(h, 30, note5)                               # first + note + newest round = 37
    assert (f.step, f.tokens, f.view) == (REFUSED, 37, ())
    assert cx.old_trim(h, 100, note5).refused              # one turn: nowhere to cut


def test_whole_user_turns():
    h = (Message("first", "f" * 10), Message("model", "hi"), Message("user", "u" * 30),
         Message("model", "c1"), Message("result", "r" * 8), Message("user", "v" * 10),
         Message("model", "c2"), Message("result", "s" * 8))
    f = cx.fit(h, 50, note5)             # 72 tokens; results of 8 are too small to clear
    assert (f.step, f.dropped, f.tokens) == (2, (1, 2, 3, 4), 10 + 5 + 10 + 2 + 8)
    f = cx.fit(h, 20, note5)             # even the newest turn (10 + 5 + 20) is too big
    assert f.refused
    g = cx.fit(h[:5] + (Message("user", "v" * 10),), 30, note5)   # ends on a user message
    assert (g.step, g.view) == (2, (h[0], NOTE, Message("user", "v" * 10)))


def test_rounds_of_the_newest_turn_keep_its_user_message():
    h = (Message("first", "f" * 10), Message("user", "u" * 10),
         *[m for k in range(4) for m in (Message("model", f"c{k}"), Message("result", "r" * 9))])
    f = cx.fit(h, 40, note5)             # first 10 + note 5 + request 10 + newest round 11 = 36
    assert f.step == 3 and f.view == (h[0], NOTE, h[1]) + h[-2:]


def test_malformed_histories_are_rejected():
    with pytest.raises(ValueError, match="first"):
        cx.fit((Message("user", "hi"),), 10, count)
    with pytest.raises(ValueError, match="result must follow"):
        cx.fit((Message("first", "hi"), Message("result", "x")), 10, count)
    with pytest.raises(ValueError, match="kind"):
        cx.fit((Message("first", "hi"), Message("first", "again")), 10, count)


def test_messages_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Message("first", "hi").text = "changed"


def test_the_agent_is_told_about_clearing():
    assert "cleared" in cx.INSTRUCTIONS and "do not stop" in cx.INSTRUCTIONS and "again" in cx.INSTRUCTIONS
    assert cx.REFUSAL_MESSAGE.startswith("This conversation got too long for the model to read at once.")


def test_render_view_and_exact_counts():
    f = cx.fit(six_rounds(), 60, note5)
    trace = cx.render_view(f.view, chat.MINAGENT)
    assert chat.text(trace[:4]) == ("<|user|>ffffffffff<|assistant|><|user|>" + cx.TRIMMED_NOTE + "<|assistant|>"
                                    "c2" + cx.CLEARED_NOTE + "<|assistant|>")
    assert [s.author for s in trace] == [chat.PROGRAM, chat.PROGRAM] + [chat.MODEL, chat.PROGRAM] * 4
    tok = tk.train("the mill by the river turns; " * 50 + cx.CLEARED_NOTE + cx.TRIMMED_NOTE, 300)
    counter = cx.exact_counter(tok, chat.MINAGENT)        # counts each message as rendered
    tokens, _ = chat.render(trace, tok)
    assert sum(map(counter, f.view)) == len(tokens)


# ---------------------------------------------------------------- counting tokens

def test_counter_counts_each_message_once():
    calls = []
    counter = cx.Counter(lambda m: calls.append(m) or len(m.text))
    m = Message("result", "x" * 100)
    assert counter(m) == counter(m) == counter(Message("result", "x" * 100)) == 100
    assert calls == [m]
    h = six_rounds()
    cx.fit(h, 60, counter)
    cx.fit(h, 60, counter)
    assert len(calls) == len(set(h) | {CLEARED, NOTE, m})   # once per distinct message, over both fits


def test_estimate_tokens_is_remembered():
    text = "Мельница у реки " * 1000 + "unique-7e1c"
    cx.estimate_tokens.cache_clear()
    assert cx.estimate_tokens(text) == cx.estimate_tokens(text)
    assert cx.estimate_tokens.cache_info().misses == 1 and cx.estimate_tokens.cache_info().hits == 1


def test_estimate_known_answers():
    assert cx.script_counts("Вера, 水車!") == (3, 2, 4)
    assert cx.estimate_tokens("Вера, 水車!") == math.ceil(3 / 4) + 2 + math.ceil(4 / 2) == 5
    assert cx.chars4("Вера, 水車!") == 3
    assert cx.estimate_counter()(Message("user", "Вера, 水車!")) == 5
    assert cx.estimate_tokens("") == cx.chars4("") == 0
    assert cx.estimate_tokens("abcdefgh") == 2                    # English: the same as chars / 4
    assert cx.estimate_tokens("한국어、カタカナ。ｆｕｌｌ") == 13      # Hangul, kana, CJK and fullwidth: 1 each
    assert cx.estimate_tokens("émoji 🙂 αβγ") == math.ceil(6 / 4) + math.ceil(5 / 2)   # ASCII "moji  ", other "é🙂αβγ"


@SETTINGS
@given(st.text())
def test_estimate_never_below_chars4(text):
    assert cx.estimate_tokens(text) >= cx.chars4(text)
    assert sum(cx.script_counts(text)) == len(text)


SAMPLES = ("english", "russian", "chinese", "japanese")
SMOLLM2_RATES = cx.SMOLLM2_RATES


def sample(name):
    return (SCRIPTS / f"{name}.txt").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def smollm2_tok(smollm2_gguf):
    return tk.from_gguf(smollm2_gguf)


@pytest.fixture(scope="module")
def wordnet_tok():
    if not WORDNET_TOK.exists():
        pytest.skip(f"{WORDNET_TOK} not found; `python experiments/01_tokenization.py` trains and caches it")
    return tk.load(WORDNET_TOK)


def test_samples_are_what_they_say():
    for name in SAMPLES:
        n_ascii, n_cjk, n_other = cx.script_counts(sample(name))
        assert 1000 <= len(sample(name).encode("utf-8")) <= 3000
        main = {"english": n_ascii, "russian": n_other, "chinese": n_cjk, "japanese": n_cjk}[name]
        assert main > 0.6 * len(sample(name))


@pytest.mark.parametrize("tok_fixture", ["smollm2_tok", "wordnet_tok"])
def test_chars4_underestimates_other_scripts_and_the_estimate_is_closer(tok_fixture, request):
    tok = request.getfixturevalue(tok_fixture)
    for name in ("russian", "chinese", "japanese"):
        text = sample(name)
        exact = len(tok.encode(text))
        assert cx.chars4(text) < exact / 2                 # chars / 4 is off by more than half
        assert abs(cx.estimate_tokens(text) - exact) < abs(cx.chars4(text) - exact)


def test_estimate_errs_high_against_smollm2(smollm2_tok):
    """With the SPEC's rates only English is counted high for SmolLM2; with rates measured for
    SmolLM2 (rounded toward more tokens) all four scripts are. The SPEC's rates were made for
    a large multilingual tokenizer, one that has many more pieces for Russian and Chinese."""
    english = sample("english")
    assert cx.estimate_tokens(english) >= len(smollm2_tok.encode(english))
    for name in SAMPLES:
        text = sample(name)
        exact = len(smollm2_tok.encode(text))
        assert exact <= cx.estimate_tokens(text, SMOLLM2_RATES) <= 1.5 * exact


@pytest.fixture(scope="module")
def multilingual_bpe():
    """minagent's BPE with pieces for all four scripts: 32,768 learned on the word frequencies of
    English, Russian, Chinese and Japanese (the wordfreq package; no running text). ~30 s."""
    pytest.importorskip("wordfreq", reason="the multilingual BPE is trained on wordfreq's lists: pip install -e '.[test]'")
    return tk.train_counts(tk.wordfreq_chunks(), 32768)


def test_spec_estimate_errs_high_against_a_bpe_that_knows_the_scripts(multilingual_bpe):
    """The SPEC's rates (4 / 1 / 2) describe a tokenizer with many pieces for each script, and for
    one, minagent's multilingual BPE, they err high on all four samples. The samples are not in its
    corpus (word lists only), so this is held-out text. Chars / 4 undercounts the three others."""
    for name in SAMPLES:
        text = sample(name)
        exact = len(multilingual_bpe.encode(text))
        assert exact <= cx.estimate_tokens(text) <= 1.7 * exact
        if name != "english":
            assert cx.chars4(text) < exact


def test_train_counts_is_train_on_the_counted_chunks():
    text = sample("english") + sample("russian")
    chunks = tk._count_words(text, tk.GPT2_PATTERN, tk.MINAGENT_SPECIALS)
    a, b = tk.train(text, 600), tk.train_counts(chunks, 600)
    assert a.merges == b.merges and a.specials == b.specials
    assert b.encode(sample("russian")) == a.encode(sample("russian"))


@pytest.fixture(scope="module")
def english_bpe():
    """minagent's BPE trained in-process on English only (as the WordNet one is): no Cyrillic or CJK merges."""
    return tk.train(sample("english") * 4, 400)


def test_bytes_bound_errs_high_against_both_tokenizers(english_bpe, smollm2_tok):
    """A BPE that learned no Cyrillic or CJK merges spends a token per byte there, and only the
    utf-8 byte count errs high for it on all four samples (the README's table has the WordNet BPE)."""
    for name in SAMPLES:
        text = sample(name)
        for tok in (english_bpe, smollm2_tok):
            assert len(tok.encode(text)) <= cx.utf8_bytes(text)
        if name != "english":
            assert len(english_bpe.encode(text)) > cx.estimate_tokens(text, SMOLLM2_RATES)


@given(text=st.text(max_size=200))
@settings(max_examples=50, deadline=None)
def test_byte_level_bpe_never_exceeds_the_bytes_bound(english_bpe, text):
    assert len(english_bpe.encode(text)) <= cx.utf8_bytes(text)
