"""Smoke test of benchmarks/bench_agent.py: its --quick run, minagent's two loops alone.

    python -m pytest -m slow tests/experiments/test_bench_agent.py     # a few minutes on 2 cores

The script runs in a subprocess (it is a program, not a module) with --quick --no-ref, so it needs
neither torch nor llama.cpp, and trains nothing: it uses 03's tool adapter if its checkpoint is
there, else the base model. The test checks the JSON's structure and that minagent batched and
minagent one by one wrote the same episodes; not the times, which depend on the machine.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest
from conftest import FAST_COMPILE

ROOT = pathlib.Path(__file__).resolve().parents[2]
LOOPS = ("minagent batched", "minagent one by one")


@pytest.mark.slow
def test_bench_agent_quick(tmp_path, smollm2_gguf):
    out = tmp_path / "agent.json"
    # The script times real models: without conftest's flag that turns XLA's optimisations off.
    xla_flags = os.environ.get("XLA_FLAGS", "").replace(FAST_COMPILE, "").strip()
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"), "XLA_FLAGS": xla_flags,
           "MINAGENT_SMOLLM2": str(smollm2_gguf)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_agent.py"), "--quick", "--no-ref",
                           "--episodes", "4", "--out", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())

    assert set(result) >= {"cpu", "workload", "weights", "logit_checks", "runs", "reference", "versions"}
    assert result["cpu"]["model"] and set(result["cpu"]["flags"]) >= {"avx512f", "avx512_vnni", "amx_int8"}
    assert result["workload"]["episodes"] == 4 and result["quick"] is True
    ((threads, loops),) = result["runs"].items()             # --quick: one thread setting, all cores
    assert int(threads) == len(os.sched_getaffinity(0))
    assert set(loops) == set(LOOPS)
    for name in LOOPS:
        f = loops[name]
        assert f["seconds"] > 0 and f["episodes_per_s"] > 0 and f["positions"] > 0
        assert f["compiles_while_timed"] == 0                  # the warm-up compiled every shape the run uses
        assert set(f["time_split"]) == {"model (jitted calls)", "Batch host work", "loop host work",
                                        "tools (in worker threads)"}
        # The same greedy episodes, batched or one at a time: same tokens, calls and answers.
        assert f["identical"] == f["same_tokens"] == 4 and f["parted"] == []
        # The model's calls split into decode and prefill: together they pushed every position once.
        calls = f["model_calls"]
        assert calls["decode"]["real_positions"] + calls["prefill"]["real_positions"] == f["positions"]
        assert all(0 < c["real_rows"] <= c["rows"] and 0 < c["real_positions"] <= c["positions"]
                   for c in calls.values())
        assert f["decode_bytes_per_s"] > 0
    # One at a time, every decode row holds the one sequence.
    decode_one = loops["minagent one by one"]["model_calls"]["decode"]
    assert decode_one["rows"] == decode_one["real_rows"] == decode_one["calls"]
    assert result["read_bandwidth"][threads] > 0 and result["bare_products_s_bytes"][threads][0] > 0
    assert loops["minagent batched"]["minagent_batched_speedup"] == 1.0
    # Both loops push the same positions: each episode's own tokens, whatever shares its batch.
    assert loops["minagent batched"]["positions"] == loops["minagent one by one"]["positions"]
    assert "minagent batched" in proc.stdout and "identical" in proc.stdout


def test_int8_with_bfloat16_beside_is_one_format_whose_decode_step_reads_the_int8_bytes():
    """--int8 --bf16: int8.quantize(params, bf16=True) against llama.cpp's Q8_0 (transformers left
    out); the bytes a decode step at batch 1 reads are the int8 ones, the bfloat16 copies not
    counted (each is twice its int8 matrix's bytes)."""
    import importlib.util
    import types

    import jax

    from minagent import int8, model
    spec = importlib.util.spec_from_file_location("bench_agent", ROOT / "benchmarks" / "bench_agent.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = bench.parse_args(["--int8", "--bf16"])
    assert args.int8 and args.bf16 and args.gguf_type == "q8_0"
    assert not any(name.startswith("transformers") for name in args.loops)

    cfg = model.Config(vocab_size=40, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)
    params = model.init(jax.random.PRNGKey(0), cfg)

    def read(p):
        run = types.SimpleNamespace(batch=types.SimpleNamespace(runner=types.SimpleNamespace(params=p)))
        return bench.weight_bytes("minagent one by one", run, {}, {})
    alone, beside = int8.quantize(params), int8.quantize(params, bf16=True)
    copies = sum(w.bf16.nbytes for w in [*beside["layers"].values(), beside["unembed"]] if isinstance(w, int8.Int8))
    assert copies > 0 and read(beside) == read(alone)
    assert sum(x.nbytes for x in jax.tree.leaves(beside)) == sum(x.nbytes for x in jax.tree.leaves(alone)) + copies


def test_prefill_rows_and_beside_reach_the_batched_loop_only():
    """--prefill-rows, --beside, --beside-rows and --packed set the batched loop's RunnerConfig (one by one
    keeps its own), such a loop compiles nothing up front (its warm-up is a run of the episodes), and a
    row count under 1, or beside rows without --beside, is refused."""
    import importlib.util

    import jax

    from minagent import chat, model
    from minagent import tokenizer as tk
    spec = importlib.util.spec_from_file_location("bench_agent", ROOT / "benchmarks" / "bench_agent.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = bench.parse_args(["--beside", "12", "--prefill-rows", "2", "4", "8", "--packed", "--beside-rows", "4"])
    assert (args.beside, args.prefill_rows, args.packed, args.beside_rows) == (12, [2, 4, 8], True, 4)
    for bad in (["--prefill-rows", "0", "4"], ["--beside", "12", "--beside-rows", "0"], ["--beside-rows", "4"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)

    tok = tk.train("add 4821 3907 " * 50, vocab_size=300, specials=list(chat.CHATML.specials))   # the bench's format
    cfg = model.Config(vocab_size=tok.n_vocab, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64)
    params = model.init(jax.random.PRNGKey(0), cfg)
    plan = {"beside": 12, "prefill_rows": [2, 4, 8], "packed": True, "beside_rows": 4, "max_len": 64,
            "episodes": 8, "warmup": "shapes"}
    batched = bench.make_loop("minagent batched", params, cfg, tok, 2, plan, {})
    alone = bench.make_loop("minagent one by one", params, cfg, tok, 2, {**plan, "warmup": "run"}, {})   # no compiling
    assert batched.batch.runner.prefill_rows == [2, 4, 8] and batched.batch.runner.beside == 12
    assert batched.batch.runner.beside_rows == [2, 4]
    assert batched.batch.runner.pack and not alone.batch.runner.pack
    assert batched.compile_s is None                          # warmed up by a run, not by every shape
    assert alone.batch.runner.prefill_rows == [1] and alone.batch.runner.beside is None
