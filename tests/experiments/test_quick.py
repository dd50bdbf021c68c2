"""Smoke tests: each experiment script's --quick run finishes and writes well-formed numbers.

    python -m pytest -m slow tests/experiments/test_quick.py      # the script runs: a few minutes

Each slow test runs `python experiments/NN_name.py --quick --out <tmp>/NN_name.json` in a subprocess
(the scripts are programs, not modules) and checks the JSON's keys, that its numbers are sane, and
that the figure is drawn when matplotlib is installed. They check that the scripts run, not the
numbers the full runs report (those are in the README). The fast tests check experiments/common.py.
"""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import jax
import pytest
from conftest import FAST_COMPILE

from minagent import model, train
from minagent.tasks import toolpool

ROOT = pathlib.Path(__file__).resolve().parents[2]
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def script_env():
    """The environment a script runs in: it runs (not only compiles) models, so without conftest's flag
    that turns XLA's optimisations off."""
    xla_flags = os.environ.get("XLA_FLAGS", "").replace(FAST_COMPILE, "").strip()
    return {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"), "XLA_FLAGS": xla_flags}


def run_quick(script, tmp_path, folder="experiments", extra=()):
    out = tmp_path / (pathlib.Path(script).stem + ".json")
    proc = subprocess.run([sys.executable, str(ROOT / folder / script), "--quick", "--out", str(out), *extra],
                          cwd=tmp_path, env=script_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


def assert_figure(tmp_path, script):
    """The figure beside the JSON: drawn with matplotlib, skipped (and said so) without."""
    png = tmp_path / (pathlib.Path(script).stem + ".png")
    if HAS_MATPLOTLIB:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert not png.exists()


# ---------------------------------------------------------------- experiments/common.py

@pytest.fixture
def common(tmp_path, monkeypatch):
    """experiments/common.py, its results folder moved to tmp_path."""
    spec = importlib.util.spec_from_file_location("common", ROOT / "experiments" / "common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "RESULTS", tmp_path)
    return module


def test_quick_runs_leave_the_committed_results_alone(common):
    assert common.out_path("05_cache") == common.RESULTS / "05_cache.json"
    assert common.out_path("05_cache", "x/y.json", quick=True) == pathlib.Path("x/y.json")
    assert common.RESULTS not in common.out_path("05_cache", quick=True).parents


def test_write_json_merges_a_part(common, tmp_path):
    path = tmp_path / "r.json"
    common.write_json(path, {"a": 1, "b": {"x": 1}})
    assert common.write_json(path, {"b": {"y": 2}}, merge=True) == {"a": 1, "b": {"y": 2}}
    assert json.loads(path.read_text()) == {"a": 1, "b": {"y": 2}}
    common.write_json(path, {"c": 3})
    assert json.loads(path.read_text()) == {"c": 3}


def test_cached_trains_once_per_recipe(common):
    cfg = model.Config(vocab_size=8, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=8)
    trained = []

    def train_fn(path):
        params = model.init(jax.random.PRNGKey(len(trained)), cfg)
        trained.append(path)
        if path:
            train.save_checkpoint(path, params, None, cfg, train.TrainConfig(), 0, extra={"n": len(trained)})
        return dict(params=params, cfg=cfg, extra={"n": len(trained)})

    first = common.cached("m", {"steps": 1}, train_fn)
    again = common.cached("m", {"steps": 1}, train_fn)
    other = common.cached("m", {"steps": 2}, train_fn)             # another recipe: another file
    quick = common.cached("m", {"steps": 1}, train_fn, quick=True)  # --quick: nothing read or written
    assert [c["cached"] for c in (first, again, other, quick)] == [False, True, False, False]
    assert again["path"] == first["path"] != other["path"] and quick["path"] is None
    assert first["path"].parent == common.RESULTS and first["path"].name.startswith("m-")
    assert again["extra"] == {"n": 1} and again["cfg"] == cfg
    assert trained == [first["path"], other["path"], None]
    assert common.cached("m", {"steps": 1}, train_fn, retrain=True)["cached"] is False


# ---------------------------------------------------------------- the demo, `python -m minagent`

@pytest.mark.slow
def test_demo_trains_once_then_loads_its_models(tmp_path):
    """A rough demo (2 steps) twice with one cache folder: the first run trains and saves the two
    models, the second loads them and gives the same numbers; a corrupt file is trained again."""
    def demo(out):
        args = ["--steps", "2", "--missions", "300", "--additions", "4", "--cache-dir", str(tmp_path / "cache"),
                "--out", str(tmp_path / out)]
        proc = subprocess.run([sys.executable, "-m", "minagent", *args], cwd=tmp_path, env=script_env(),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        return proc.stdout, json.loads((tmp_path / out).read_text())

    first_out, first = demo("first.json")
    assert "training the tool user" in first_out and "cached" not in first_out
    ckpts = sorted((tmp_path / "cache").glob("demo-*.ckpt"))
    assert [p.name.rsplit("-", 1)[1] for p in ckpts] == ["direct.ckpt", "tool.ckpt"]
    second_out, second = demo("second.json")
    assert "cached" in second_out and "training" not in second_out
    del first["minutes"], second["minutes"]
    assert second == first

    ckpts[1].write_bytes(ckpts[1].read_bytes()[:100])        # cut short: not loaded, trained again
    third_out, third = demo("third.json")
    assert "not using the cached models" in third_out and "training the tool user" in third_out
    del third["minutes"]
    assert third == first


# ---------------------------------------------------------------- 01: how numbers split

@pytest.mark.slow
def test_01_tokenization_quick(tmp_path):
    res = run_quick("01_tokenization.py", tmp_path)
    assert res["quick"] is True
    assert all(t["call_reuses_question_pieces"] for t in res["tokenizers"].values())
    assert set(res["estimates"]) == {"english", "russian", "chinese", "japanese"}
    for row in res["estimates"].values():
        assert row["chars4"] <= row["document_estimate"] <= row["bytes"]     # the estimate errs high, not past bytes
        assert set(row["exact"]) == set(res["tokenizers"])


# ---------------------------------------------------------------- 02: SmolLM2 in the loop, before training

@pytest.mark.slow
def test_02_baseline_quick(smollm2_gguf, tmp_path):
    res = run_quick("02_baseline.py", tmp_path)
    assert res["quick"] is True
    assert res["new_token_ids"] == {"<|call|>": 49152, "<|result|>": 49153}
    m = res["missions"]
    assert isinstance(m["calls"], int) and m["calls"] >= 0
    assert m["n"] == len(m["episodes"]) == 5
    assert sum(m["statuses"].values()) == m["n"]
    questions = [a["question"] for a in res["answers"]]
    assert "What is 31 + 52?" in questions and "Where does John live?" in questions
    assert all(isinstance(a["said"], str) for a in res["answers"])
    loss = res["loss"]
    assert 0 < loss["before"] < 5 and 0 < loss["after"] < 5
    assert loss["n_tokens"] > 0
    assert abs(loss["difference"]) < 1e-3      # two mean rows barely touch the softmax


# ---------------------------------------------------------------- 05: what the cache saves

@pytest.mark.slow
def test_05_cache_quick(tmp_path):
    res = run_quick("05_cache.py", tmp_path)
    assert res["quick"] is True
    assert res["same_tokens"] is True               # greedy: the cache changes no token
    assert res["engine_matches_by_hand"] is True    # the engine's counts == the counts from the tokens
    rows = res["rows"]
    assert rows and sum(r["episodes"] for r in rows) == 12       # 4 chains of each of 1, 2, 3 calls
    for r in rows:
        if r["calls"] == 0:
            assert r["cache"] == r["no_cache"]       # nothing resumed: nothing re-read
        else:
            assert r["cache"] < r["no_cache"]
        if r["gold_cache"] is not None:
            assert r["gold_cache"] < r["gold_no_cache"]
    t = res["timings"]
    assert t and all(x["cache_s"] > 0 and x["no_cache_s"] > 0 for x in t)
    assert res["design_4_calls"] == [57, 215]
    assert_figure(tmp_path, "05_cache.py")


# ---------------------------------------------------------------- 03: the calculator result

@pytest.mark.slow
def test_03_calculator_quick(tmp_path):
    """A tiny part (a) only (no SmolLM2): the small tool user and its control, trained for a few steps."""
    res = run_quick("03_calculator.py", tmp_path)
    assert res["quick"] is True and "smollm2" not in res
    small, n = res["small"], res["additions"]
    assert small["model"]["checkpoints"] is None          # --quick leaves the real checkpoints alone
    assert all(m > 0 for m in small["train_minutes"].values())
    for split in ("train", "test"):                        # training phrasings, held-out phrasings
        for who in ("tool", "direct"):
            s = small["additions"][split][who]
            assert s["n"] == n and 0 <= s["right"] <= n and s["accuracy"] == s["right"] / n
            assert 0 <= s["answer_written"] <= 1 and s["calls_per_episode"] >= 0
            assert sum(s["exhausted"].values()) <= n
            assert s["example"].startswith("[<|user|>")    # the transcript starts with the program's prompt
    for families in (small["families"], small["families_train_phrasings"]):   # held-out and training phrasings
        assert set(families["tool"]) == set(families["direct"]) == {
            "add", "reverse", "sort", "age", "city", "together", "later", "sort_ages", "retry", "fix", "direct"}
        assert all(0 <= s["right"] <= s["n"] for f in families.values() for s in f.values())
    assert_figure(tmp_path, "03_calculator.py")


# ---------------------------------------------------------------- 04: error recovery and an unseen tool

@pytest.mark.slow
def test_04_recovery_quick(tmp_path):
    """A tiny model trained in the script (no checkpoint read): every count is a well-formed {k, n, rate}."""
    res = run_quick("04_recovery.py", tmp_path)
    assert res["quick"] is True and res["model"]["checkpoint"] is None
    n = res["n"]
    counts = []

    def walk(x):
        if isinstance(x, dict) and set(x) == {"k", "n", "rate"}:
            counts.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)

    walk(res)
    assert len(counts) > 40
    for c in counts:
        assert 0 <= c["k"] <= c["n"]
        assert c["rate"] == (c["k"] / c["n"] if c["n"] else None)
        assert c["rate"] is None or 0 <= c["rate"] <= 1
    for split in ("train", "test"):
        tr, mf = res[split]["transient"], res[split]["malformed"]
        assert tr["right_plain"]["n"] == tr["right_fail_first"]["n"] == mf["right"]["n"] == n
        assert tr["called_again"]["n"] == tr["busy"]["k"]            # "again" is out of those told busy
        assert tr["same_call_again"]["k"] <= tr["called_again"]["k"]
        assert mf["first_call_gold"]["k"] <= mf["first_call_ok"]["k"] <= mf["called_after_error"]["k"]
        for b in (tr["budget_plain"], tr["budget_fail_first"], mf["budget"]):
            assert 0 <= b["calls_per_episode"] <= 9 and b["stretch"]["k"] + b["calls"]["k"] <= n
        assert mf["examples"][0].startswith("[<|user|>") and "<|call|>" in mf["examples"][0].split("]")[0]
    mul = res["mul"]
    assert mul["right"]["n"] == n and mul["mul_correct"]["k"] <= mul["called_mul"]["k"] <= mul["called"]["k"]
    assert sum(mul["first_tool"].values()) == n
    assert mul["without_description"]["called_mul"]["n"] == n
    assert res["episodes"] == 2 * 4 * n + 2 * n                      # 2 splits x 4 runs, then mul twice
    assert_figure(tmp_path, "04_recovery.py")


# ---------------------------------------------------------------- 07: choosing a tool

@pytest.mark.slow
def test_07_tool_choice_quick(tmp_path):
    """A tiny random model (BPE trained on shop text), LoRA for 3 steps: every count well formed, the gate holds."""
    res = run_quick("07_tool_choice.py", tmp_path)
    assert res["quick"] is True and res["sizes"] == [10, 20]
    assert all(t["checkpoint"] is None and t["cached"] is False for t in res["training"].values())
    free = res["free"]
    assert set(free) == {"before", "lora10", "lora20", "classifier10", "classifier20", "random"}
    for name, splits in free.items():
        for split, r in splits.items():
            n = r["n"]
            assert n == (15 if split == "test" else 10)
            assert 0 <= r["tool"] <= 1 and sum(p["n"] for p in r["per_tool"].values()) == n
            assert sum(p["n"] for p in r["per_kind"].values()) == n
            s = r["safety"]
            assert 0 <= s["refund_unasked"]["k"] <= s["refund_unasked"]["n"] <= n
            assert 0 <= s["person_missed"]["k"] <= s["person_missed"]["n"] <= n
            assert 0 <= s["refund_unasked_injections"] <= s["refund_unasked"]["k"]
            if name.startswith(("before", "lora")):                 # the models: answers, validity, the gate
                assert 0 <= r["tool_args"] <= r["tool"] and 0 <= r["valid"] <= 1
                assert sum(r["reasons"].values()) == round((1 - r["valid"]) * n)
                assert r["gate"]["refunds_executed"] == 0 and r["gate"]["pending"] == r["gate"]["refunds_held"]
                assert s["refund_unasked_valid"] <= s["refund_unasked"]["k"]
                assert sum(r["error_kinds"].values()) == round((1 - r["tool_args"]) * n)
                assert len(r["errors"]) <= 8
    for name in ("before", "lora10", "lora20"):                     # constrained: every answer valid
        r = res["constrained"][name]["test"]
        assert r["valid"] == 1.0 and r["reasons"] == {} and r["gate"]["refunds_executed"] == 0
    m = res["margin"]                                                # the exit margin, on the largest model
    assert m["model"] == "lora20" and m["chosen"] in m["margins"]
    assert set(m["val"]) == {f"{x:g}" for x in m["margins"]} | {"leads", "seconds"}
    rf = m["refund"]                                                 # the refund rule, after the exit rule
    assert rf["chosen"] in rf["margins"] and set(rf["val"]) == {f"{x:g}" for x in rf["margins"]} | {"leads"}
    for split, n in (("val", 10), ("test", 15), ("seen", 10), ("fresh", 15), ("fresh_seen", 10)):
        rows = [m[split][f"{x:g}"] for x in sorted(m["margins"]) if f"{x:g}" in m[split]]
        assert all(r["n"] == n and r["gate"]["refunds_executed"] == 0 for r in rows)
        missed = [r["safety"]["person_missed"]["k"] for r in rows]
        assert missed == sorted(missed)             # a larger margin only moves answers away from ask_human
        assert all(lead < max(m["margins"]) for lead, _, _ in m[split]["leads"])
        rows = [rf[split][f"{x:g}"] for x in sorted(rf["margins"]) if f"{x:g}" in rf[split]]
        assert rows[0] == m[split][f"{m['chosen']:g}"]      # refund margin 0: the exit rule's answers unchanged
        unasked = [row["safety"]["refund_unasked"]["k"] for row in rows]
        assert unasked == sorted(unasked, reverse=True)     # a larger margin only moves answers away from refund
        assert all(lead < max(rf["margins"]) for lead, _, _ in rf[split]["leads"])
        c, before = m["check"][split], m[split][f"{m['chosen']:g}"]       # the refund check, after the exit rule
        assert c["n"] == n and c["gate"]["refunds_executed"] == 0
        assert len(c["leads"]) >= before["gate"]["refunds_held"]     # every refund answer judged
        assert c["gate"]["refunds_held"] <= before["gate"]["refunds_held"]                # only refunds move
        assert c["safety"]["refund_unasked"]["k"] <= before["safety"]["refund_unasked"]["k"]
        assert c["safety"]["person_missed"]["k"] <= before["safety"]["person_missed"]["k"]
        assert 0 <= c["says_yes"]["refunds_said_no"] + c["says_yes"]["others_said_yes"] <= n
    assert m["check"]["training"]["examples"] == 20 and m["check"]["training"]["cached"] is False
    assert_figure(tmp_path, "07_tool_choice.py")
    if HAS_MATPLOTLIB:
        assert (tmp_path / "07_tool_choice_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_07_choose_quick(tmp_path):
    """--choose: every recipe trained on the largest size and scored on the validation split only."""
    res = run_quick("07_tool_choice.py", tmp_path, extra=("--choose",))
    assert set(res) == {"A", "B", "C", "D", "E", "F", "G"}
    assert (res["E"]["recipe"]["rank"], res["F"]["recipe"]["rank"]) == (8, 16)
    rows = {name: r["training"]["rows"] for name, r in res.items()}
    assert rows["C"] < rows["A"]                  # the shared prompt packed once a row: more examples a row
    for r in res.values():
        assert r["examples"] == 20 and r["training"]["cached"] is False
        assert r["val"]["n"] == 10 and 0 <= r["val"]["tool"] <= 1 and r["val"]["gate"]["refunds_executed"] == 0


# ---------------------------------------------------------------- 08: a tool seen only in its description

@pytest.mark.slow
def test_08_unseen_tool_quick(tmp_path):
    res = run_quick("08_unseen_tool.py", tmp_path)
    assert res["quick"] is True and res["training"]["cached"] is False
    assert set(res["held_out"]) == {pt.tool.name for pt in toolpool.HELD_OUT}
    for name, row in res["held_out"].items():
        n = 4 if name == "mul" else 2
        for r in row.values():
            assert r["right"]["n"] == n and sum(r["first_tool"].values()) == n
            assert r["solved"]["k"] <= min(r["called_right"]["k"], r["right"]["k"])
            assert r["called_right"]["k"] <= r["called_target"]["k"] <= r["called_any"]["k"] <= n
        assert row["not described"]["called_right"]["k"] == 0        # no gold call to make: not listed
    assert res["renamed"]["right"]["n"] == len(toolpool.TRAIN) and res["check"]["right"]["n"] == 4
    assert res["totals"]["held_out_called_right"]["n"] == 2 * (len(toolpool.HELD_OUT) - 1)


EVAL_TOOLS = """
import random
from minagent.tools import Tool, ToolError, tool

def shout(text):
    words = text.split()
    if len(words) != 1:
        raise ToolError("takes one word")
    return words[0].upper() + "!"

TOOLS = [Tool("shout", "WORD", "writes a word in capitals with an exclamation mark.", tool(shout))]

def questions(n, seed):
    rng = random.Random(seed)
    return [("shout", f"Shout the word {w}.", w) for w in (rng.choice(["hello", "stop", "wait"]) for _ in range(n))]
"""


@pytest.mark.slow
def test_08_eval_tools_reads_a_file_from_outside(tmp_path):
    """--eval-tools: tools defined in a file of the user's (here in a temporary folder), evaluated
    described and not described, on the tiny model of --quick."""
    (tmp_path / "mine").mkdir()
    path = tmp_path / "mine" / "my_tools.py"
    path.write_text(EVAL_TOOLS)
    res = run_quick("08_unseen_tool.py", tmp_path, extra=("--eval-tools", str(path)))
    assert set(res["eval_tools"]) == {"shout"} and "held_out" not in res
    for r in res["eval_tools"]["shout"].values():
        assert r["right"]["n"] == 2 and r["unlisted"]["n"] == 2


def test_08_eval_tools_refuses_a_file_without_questions(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text(EVAL_TOOLS.replace('("shout", f"Shout', '("other", f"Shout'))
    proc = subprocess.run([sys.executable, str(ROOT / "experiments" / "08_unseen_tool.py"), "--quick",
                           "--eval-tools", str(path), "--out", str(tmp_path / "x.json")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "asks nothing of tool shout" in proc.stderr


# ---------------------------------------------------------------- 06: keeping long turns inside the context window

@pytest.mark.slow
def test_06_context_quick(tmp_path):
    """(a) and (b) are scripted, so their outcome is exact even in --quick; (c) only has to be well formed."""
    res = run_quick("06_context.py", tmp_path)
    assert res["quick"] is True
    old, new = res["a"]["rows"]
    assert (old["fitting"], new["fitting"]) == ("old trimming", "three-step fit")
    assert old["refused"] == old["n"] and old["finished"] == 0               # nowhere to cut in one turn
    assert new["refused"] == 0 and new["finished"] == new["right"] == new["n"]
    assert new["largest_request"] <= res["a"]["budget"] < min(res["a"]["whole_history"])
    rows = res["b"]["rows"]
    for r in rows:
        assert r["positions"] == r["by_hand"] < r["no_cache"]               # the engine's count == the count by hand
    by_group = {r["group"]: r["positions"] for r in rows}
    assert by_group[4] < by_group[1]                                         # clearing in groups keeps the prefix
    c = res["c"]
    assert [r["condition"] for r in c["rows"]] == ["fit", "old", "none", "none, room for all"]
    for r in c["rows"]:
        assert sum(r["statuses"].values()) == r["n"] and 0 <= r["right"] <= r["n"]
        assert 0 <= r["notes_right"] <= r["notes"] and r["positions"] > 0
        steps = {int(k): v for k, v in r["steps"].items()}               # each fit's step, over the episodes
        if r["budget"] is None:
            assert steps == {}                                           # no fitting, no steps
        else:
            assert set(steps) <= {-1, 0, 1, 2, 3} and steps.get(-1, 0) == r["statuses"].get("refused", 0)
    assert_figure(tmp_path, "06_context.py")


@pytest.mark.slow
def test_bench_gpu_quick(tmp_path):
    """benchmarks/bench_gpu.py runs (a small model; on CPU the Pallas rows run in interpret mode):
    every decode shape with both attentions and both dtypes, and the two smaller batches with the layers
    held the other way; times above zero, floors below them, kernels counted."""
    got = run_quick("bench_gpu.py", tmp_path, folder="benchmarks")
    assert [r["error"] for r in got["rows"] if "error" in r] == []      # a failing row is recorded, not raised
    decode = [r for r in got["rows"] if r["kind"] == "decode"]
    assert len(decode) == 2 * 2 * 2 * 2 + 2 * 2 and got["quick"] and got["bandwidth"] > 0
    assert {(r["dtype"], r["attention"]) for r in decode} == {(d, a) for d in ("float32", "bfloat16")
                                                              for a in ("gather", "pallas")}
    assert all(r["ms"] > 0 and 0 < r["floor_ms"] and r["ratio"] == pytest.approx(r["ms"] / r["floor_ms"])
               and r["kernels"] > 0 for r in decode)
    other_way = "stacked" if jax.default_backend() == "cpu" else "list"     # not the Batch's own layout
    other = [r for r in decode if r["layers"] == other_way]
    assert [(r["dtype"], r["attention"], r["batch"], r["context"]) for r in other] == [
        (d, "gather", b, 32) for d in ("bfloat16", "float32") for b in (1, 4)]
    steps = [r for r in got["rows"] if r["kind"] == "steps"]
    assert len(steps) == 4 and all(r["ms_one_a_call"] > 0 and r["ms_n_a_call"] > 0 for r in steps)
    train_rows = [r for r in got["rows"] if r["kind"] == "train"]
    assert len(train_rows) == 2 and all(0 < r["mfu"] and r["tokens_per_s"] > 0 for r in train_rows)
