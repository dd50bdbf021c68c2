"""Mission generator: deterministic, every family present, gold traces that a real Toolbox reproduces,
and train/test phrasings that do not overlap.

Run: python -m pytest tests/tasks/test_missions.py -q
"""

import pytest

from minagent import chat, tools
from minagent.tasks.calculator import demo, missions
from minagent.chat import CHATML, MINAGENT, MODEL, PROGRAM
from minagent.tasks.calculator.missions import FAMILIES, TEMPLATES, template_regex

FORMATS = [MINAGENT, CHATML]


@pytest.fixture(scope="module")
def pool():
    """Missions of both splits in both formats: 4 of each family per split."""
    return [m for fmt in FORMATS for split in ("train", "test")
            for m in missions.generate(4 * len(FAMILIES), seed=11, split=split, fmt=fmt)]


def _fmt(m):
    return MINAGENT if m.trace[0].text.startswith(MINAGENT.user) else CHATML


def test_deterministic_and_seed_dependent():
    assert missions.generate(30, seed=4) == missions.generate(30, seed=4)
    assert missions.generate(30, seed=4) != missions.generate(30, seed=5)
    # mission i depends on (seed, i) only, not on how many are asked for
    assert missions.generate(10, seed=4) == missions.generate(30, seed=4)[:10]
    assert missions.additions(5, seed=4) == missions.additions(5, seed=4)
    assert missions.unseen_mul(5, seed=4) == missions.unseen_mul(5, seed=4)
    assert len({m.seed for m in missions.generate(200, seed=4)}) == 200


def test_every_family_is_generated():
    assert {m.family for m in missions.generate(len(FAMILIES), seed=0)} == set(FAMILIES)
    assert {m.family for m in missions.generate(6, seed=0, families=("add", "city"))} == {"add", "city"}
    with pytest.raises(ValueError):
        missions.generate(3, seed=0, families=("mul",))       # mul is for evaluation only


def test_train_and_test_phrasings_are_disjoint():
    for family, splits in TEMPLATES.items():
        if "train" in splits:
            assert len(splits["train"]) >= 4 and len(splits["test"]) >= 4
            assert not set(splits["train"]) & set(splits["test"])
    train_regexes = [template_regex(t) for s in TEMPLATES.values() for t in s.get("train", ())]
    test_questions = [m.question for m in missions.generate(400, seed=3, split="test")]
    test_questions += [m.question for m in missions.additions(50, seed=3) + missions.unseen_mul(20, seed=3)]
    for q in test_questions:
        assert not any(r.fullmatch(q) for r in train_regexes), q
    assert not set(missions.WORDS["train"]) & set(missions.WORDS["test"])


def test_template_of_finds_each_question_in_its_split():
    for split in ("train", "test"):
        for m in missions.generate(4 * len(FAMILIES), seed=11, split=split):
            family, found_split, _ = missions.template_of(m.question)
            assert found_split == split
            assert family == m.family or m.family in ("retry", "fix")   # those use another family's phrasings
    assert missions.template_of("How old is Paul?") == ("age", "train", "How old is {name}?")
    assert missions.template_of("Completely new words.") is None


def test_gold_answer_is_the_last_result_and_the_final_segment(pool):
    for m in pool:
        fmt = _fmt(m)
        assert m.trace[-1] == chat.answer(fmt, m.answer) == m.direct[-1]
        assert m.trace[0] == m.direct[0] and m.trace[0].author == PROGRAM
        if m.family == "direct":
            assert m.calls == () and m.trace == m.direct
        else:
            assert chat.rounds(m.trace, fmt)[-1][1] == m.answer
            assert not m.answer.startswith("error")


def test_gold_calls_replay_through_a_fresh_toolbox(pool):
    for m in pool + missions.additions(10, seed=2) + missions.unseen_mul(10, seed=2):
        fmt = _fmt(m)
        box = tools.Toolbox(m.seed, fail_first=m.fail_first)
        assert chat.rounds(m.trace, fmt) == [(c, box(c)) for c in m.calls]


def test_retry_shows_busy_then_the_same_call_succeeding(pool):
    retries = [m for m in pool if m.family == "retry"]
    assert retries
    for m in retries:
        (c0, r0), (c1, r1), *_ = chat.rounds(m.trace, _fmt(m))
        assert m.fail_first and r0 == tools.BUSY and c0 == c1 and not r1.startswith("error")


def test_fix_shows_an_error_then_a_corrected_call_and_does_not_teach_the_mistake(pool):
    fixes = [m for m in pool if m.family == "fix"]
    assert fixes
    for m in fixes:
        fmt = _fmt(m)
        (c0, r0), (c1, r1), *_ = chat.rounds(m.trace, fmt)
        assert r0.startswith("error: ") and not r1.startswith("error") and c0 != c1 and not m.fail_first
        # the malformed call is written by the generator (PROGRAM): it is read, not learned
        assert m.trace[1] == chat.Segment(PROGRAM, (chat.Marker(fmt.call), c0, chat.Marker(fmt.result)))
        assert all(s.author == MODEL for s in m.trace[3::2])


def test_model_segments_are_calls_and_the_answer(pool):
    for m in pool:
        fmt = _fmt(m)
        model = [s.text for s in m.trace if s.author == MODEL]
        learned_calls = m.calls[1:] if m.family == "fix" else m.calls
        assert model == [fmt.call + c + fmt.result for c in learned_calls] + [m.answer + fmt.end]


def test_chains_have_up_to_four_calls(pool):
    n_calls = {m.family: len(m.calls) for m in pool}
    assert n_calls["together"] == 3 and n_calls["later"] == 2 and n_calls["sort_ages"] == 4
    assert all(n_calls[f] == 1 for f in missions.SINGLE)


def test_no_training_mission_uses_mul():
    for split in ("train", "test"):
        for m in missions.generate(300, seed=7, split=split):
            assert not any(c.split()[0] == "mul" for c in m.calls)
            assert "mul" not in chat.text(m.trace)


def test_unseen_mul_describes_the_tool():
    for m in missions.unseen_mul(20, seed=0):
        a, b = map(int, m.calls[0].split()[1:])
        assert m.calls == (f"mul {a} {b}",) and m.answer == str(a * b)
        assert missions.MUL_SYSTEM in m.trace[0].text and "mul A B" in m.trace[0].text


def test_additions_are_two_four_digit_numbers():
    ms = missions.additions(200, seed=0)
    assert len(ms) == 200 and len({m.question for m in ms}) > 190
    for m in ms:
        name, a, b = m.calls[0].split()
        assert name == "add" and len(a) == len(b) == 4 and a[0] != "0" and b[0] != "0"
        assert m.answer == str(int(a) + int(b))
        assert a in m.question and b in m.question
        assert missions.template_of(m.question)[:2] == ("add", "test")


def test_add_numbers_have_one_to_four_digits():
    lengths = set()
    for m in missions.generate(300, seed=1, families=("add",)):
        _, a, b = m.calls[0].split()
        lengths |= {len(a), len(b)}
    assert lengths == {1, 2, 3, 4}


def test_the_demos_training_missions_add_four_digit_numbers_other_than_the_tests():
    """A quarter of the demo's training missions add two 4-digit numbers (demo.training_missions);
    none of them is one of the demo's 200 test additions, which main draws from another seed."""
    ms = demo.training_missions(400, seed=1)
    four = [m for m in ms if m.family == "add" and all(len(x) == 4 for x in m.calls[0].split()[1:])]
    others = {m.family for m in ms} - {"add"}
    assert len(ms) == 400 and len(four) >= 100 and others == set(demo.FAMILIES) - {"add"}
    assert ms == demo.training_missions(400, seed=1)                       # deterministic
    tests = {m.calls for m in missions.additions(200, seed=2, split="train")}
    assert not tests & {m.calls for m in four}
