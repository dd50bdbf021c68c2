"""Shared fixtures. Tests run on CPU, hermetic: no network, tmp_path for files.

tests/engine/ tests the engine (minagent/*.py), tests/tasks/ the applications
(minagent/tasks/), tests/experiments/ the experiment scripts' --quick runs.
"""

import os

# CPU by default. The tests' models are tiny, so compiling dominates their time: XLA's backend
# optimisations are turned off (a third less time, the same numbers to the tests' tolerances), and
# XLA:CPU's fusion emitters (MLIR) too, for its older, quicker code generation (a loop batch's
# twenty shapes: 3.6 s against 5.8-6.7 s, AMD EPYC Zen 4, experiments/LOG.md, 2026-12-07).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + FAST_COMPILE).strip()

import jax  # noqa: E402
import pytest  # noqa: E402

# The tests compare paths to float32 tolerances; on a GPU, float32 matmuls would otherwise run in TF32.
if os.environ["JAX_PLATFORMS"] != "cpu":
    jax.config.update("jax_default_matmul_precision", "highest")

from minagent import agent, chat, weights  # noqa: E402
from minagent.tasks import rote as rote_module  # noqa: E402
from minagent import tokenizer as tk  # noqa: E402
from minagent.runner import RunnerConfig  # noqa: E402
from minagent.tasks.calculator import missions  # noqa: E402

# With pytest-xdist (the default: -n 2 in pyproject.toml) both workers compile many of the same steps;
# a compilation cache on disk, made by the controlling process for this run only, lets one worker
# read what the other compiled. The workers inherit its path in MINAGENT_TEST_CACHE.
if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("MINAGENT_TEST_CACHE"):
    jax.config.update("jax_compilation_cache_dir", os.environ["MINAGENT_TEST_CACHE"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_configure(config):
    if not hasattr(config, "workerinput"):             # the controlling process, before workers start
        import tempfile
        config.minagent_cache = os.environ["MINAGENT_TEST_CACHE"] = tempfile.mkdtemp(prefix="minagent-tests-")


def pytest_unconfigure(config):
    if hasattr(config, "minagent_cache"):
        import shutil
        shutil.rmtree(config.minagent_cache, ignore_errors=True)


@pytest.fixture(scope="session")
def tok():
    """A BPE of 400 ids trained on 300 generated missions, with minagent's special tokens.
    (A test module that needs another tokenizer defines its own `tok`, which takes precedence.)"""
    text = "\n".join(chat.text(m.trace) for m in missions.generate(300, seed=0))
    return tk.train(text, vocab_size=400, specials=tk.MINAGENT_SPECIALS)


@pytest.fixture(scope="session")
def stok():
    """The same with "delegate" learned too: a rote model needs each script token to be distinct."""
    text = "\n".join(chat.text(m.trace) for m in missions.generate(300, seed=0))
    return tk.train(text + " delegate" * 300, vocab_size=400, specials=tk.MINAGENT_SPECIALS)


@pytest.fixture(scope="session")
def smollm2_gguf():
    """Path to SmolLM2-135M-Instruct.Q4_1.gguf, or skip the test with the command that fetches it."""
    path = weights.smollm2_path()
    if not path.exists():
        pytest.skip(f"SmolLM2 weights not found at {path}; fetch them with `python -m minagent.weights fetch` "
                    f"(or set MINAGENT_SMOLLM2 to the .gguf file)")
    return path


@pytest.fixture(scope="session")
def rote():
    """minagent.tasks.rote.rote: rote(tok, script, ...) -> (params, cfg) of a model that writes the scripts."""
    return rote_module.rote


# A rote model that calls, and calls again, for the tests of the loop's promises (time limits,
# faulty and slow tools, tools beside the batch).
CALLER = "<|assistant|><|call|>look<|result|>"


def warm_caller(stok):
    """A loop's batch (8 slots, max_len 128) over the CALLER model, every shape compiled before any
    clock starts. Two prefill buckets are enough: these tests time tools, not prefill shapes (fewer
    shapes to compile; test_batch checks warm-up over several buckets)."""
    params, cfg = rote_module.rote(stok, CALLER)
    batch = agent.new_batch(params, cfg, stok, chat.MINAGENT, slots=8, max_len=128,
                            runner=RunnerConfig(buckets=(16, 128)))
    batch.warmup()
    return batch


# A rote script and a toolbox for the loop's tests: a reader that calls, and calls again, and
# long results (184 tokens each for stok), long enough to be worth clearing from a view.
READER = "<|assistant|><|call|>cat x<|result|>"     # reads part after part, forever


def part(n):
    """A long tool result (184 tokens for stok)."""
    return f"part {n}: " + " ".join(str(100 + 7 * j) for j in range(60))


class Parts:
    """A toolbox whose n-th call returns part(n), whatever the call."""

    def __init__(self):
        self.n = 0

    def __call__(self, call):
        self.n += 1
        return part(self.n)
