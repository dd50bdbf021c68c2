"""The tool pool of experiment 08 (minagent/tasks/toolpool.py): what the training traces may and may not hold.

    python -m pytest tests/tasks/test_toolpool.py -q
"""

import collections
import random

import pytest

from minagent import chat, tools
from minagent.tasks import toolpool as tp

FMT = chat.MINAGENT
TRAINING = tp.training_set(1500, 0, FMT)


def held_out_functions():
    return {pt.tool.fn for pt in tp.HELD_OUT}


def test_every_question_has_a_gold_call_that_answers_it():
    for pt in tp.TRAIN + tp.HELD_OUT:
        for split in ("train", "test") if pt.train else ("test",):
            for i in range(10):
                q, args = tp.question(pt, random.Random(f"{pt.tool.name}/{split}/{i}"), split)
                assert q and not pt.tool.fn(args).startswith("error"), (pt.tool.name, q, args)


def test_no_held_out_tool_is_in_any_training_trace_under_any_name():
    """By function, by description and by name: mul and the held-out group never appear."""
    held = held_out_functions()
    descriptions = {pt.tool.description for pt in tp.HELD_OUT}
    for e in TRAINING:
        assert not any(t.fn in held or t.description in descriptions for t in e.tools)
        text = chat.text(e.mission.trace)
        assert not any(f"\n{pt.tool.name} " in text or f"<|call|>{pt.tool.name} " in text for pt in tp.HELD_OUT)


def test_the_system_text_is_rendered_from_the_tools_the_toolbox_serves():
    for e in TRAINING[:200]:
        assert e.mission.trace[0].text.count("\n") >= len(e.tools)
        assert tools.describe(e.tools) in e.mission.trace[0].text
        box = e.toolbox()
        for call in e.mission.calls:
            assert call.split()[0] in box.tools


def test_a_gold_call_names_a_listed_tool_and_a_no_tool_answer_lists_nothing_that_fits():
    kinds = collections.Counter()
    for e in TRAINING:
        m = e.mission
        if m.answer == tp.NO_TOOL:
            kinds["absent"] += 1
            assert not m.calls and e.target not in e.listed
            real = {t.fn for t in e.tools}
            target = tp.BY_NAME[m.family.removeprefix("tool:")]
            fits = {target.tool.fn} | {tp.BY_NAME[n].tool.fn for n in tp.ALSO_FITS.get(target.tool.name, ())}
            assert not real & fits
        else:
            kinds["mistake" if len(m.calls) == 2 else "plain"] += 1
            assert m.calls[-1].split()[0] == e.target in e.listed
            assert m.answer == e.toolbox()(m.calls[-1])
    n = len(TRAINING)
    assert 0.06 < kinds["absent"] / n < 0.14 and 0.05 < kinds["mistake"] / n < 0.12


def test_a_total_answered_without_a_tool_never_lists_add():
    """add reaches a list's total two numbers at a time: "no tool" beside it would be a wrong answer,
    and taught that a total is not an addition (a held-out addition phrased as a total went unanswered)."""
    add = tp.BY_NAME["add"].tool.fn
    totals = [e for e in TRAINING if e.mission.family == "tool:total" and e.mission.answer == tp.NO_TOOL]
    assert totals and not any(t.fn is add for e in totals for t in e.tools)


def test_each_no_tool_episode_has_a_twin_that_differs_only_in_the_list():
    """The twin asks the same question over the same list, in the same order and under the same
    names, with one tool swapped for the one that fits, and calls it: only the list differs."""
    pairs = 0
    for e, twin in zip(TRAINING, TRAINING[1:]):
        if e.mission.answer != tp.NO_TOOL:
            continue
        pairs += 1
        assert twin.mission.question == e.mission.question and twin.mission.calls
        assert twin.mission.calls[0].split()[0] == twin.target in twin.listed
        differ = [(a, b) for a, b in zip(e.tools, twin.tools) if a != b]
        assert len(e.tools) == len(twin.tools) and len(differ) == 1
        assert differ[0][1].name == twin.target and differ[0][1].fn is tp.BY_NAME[e.target].tool.fn
    assert pairs > 50


def test_a_mistake_is_read_but_not_learned():
    """The wrong first call is in the trace with its error, written as the program's (no loss);
    the right call and the answer are the model's."""
    e = next(e for e in TRAINING if len(e.mission.calls) == 2)
    wrong, right = e.mission.calls
    segments = e.mission.trace
    assert segments[1].author == chat.PROGRAM and wrong in segments[1].text
    assert segments[2].text.startswith("error")
    assert segments[3].author == chat.MODEL and right in segments[3].text
    assert segments[-1].author == chat.MODEL


def test_made_up_names_of_training_and_tests_are_disjoint():
    assert not set(tp.NAMES["train"]) & set(tp.NAMES["test"])
    assert not (set(tp.NAMES["train"]) | set(tp.NAMES["test"])) & set(tp.BY_NAME)
    shown = {t.name for e in TRAINING for t in e.tools}
    assert not shown & set(tp.NAMES["test"])
    renamed = sum(t.name in tp.NAMES["train"] for e in TRAINING for t in e.tools)
    assert 0.6 < renamed / sum(len(e.tools) for e in TRAINING) < 0.8


@pytest.mark.parametrize("described", [True, False])
def test_a_test_episode_lists_its_target_only_when_described(described):
    mul = tp.BY_NAME["mul"]
    eps = tp.test_set(mul, 30, 0, FMT, described=described)
    for e in eps:
        assert ("mul" in e.listed) == described
        assert all(t.name in tp.NAMES["test"] or t.name in tp.BY_NAME for t in e.tools)
        if described:
            assert e.mission.calls[-1].startswith("mul ") and e.mission.answer == e.toolbox()(e.mission.calls[-1])
        else:
            assert e.mission.answer == tp.NO_TOOL


def test_renamed_targets_take_a_name_no_training_episode_used():
    pt = tp.BY_NAME["reverse"]
    for e in tp.test_set(pt, 10, 0, FMT, rename_target=True):
        assert e.target in tp.NAMES["test"] and e.mission.calls[-1].startswith(e.target + " ")
