"""Shared fixtures. Tests run on CPU, hermetic: no network, tmp_path for files.

tests/engine/ tests the engine (minagent/*.py), tests/tasks/ the applications
(minagent/tasks/), tests/experiments/ the experiment scripts' --quick runs.
"""

import os

# CPU by default. The tests' models are tiny, so compiling dominates their time: XLA's backend
# optimisations are turned off (a third less time, the same numbers to the tests' tolerances).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
FAST_COMPILE = "--xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + FAST_COMPILE).strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# With pytest-xdist (the default: -n 2 in pyproject.toml) both workers compile many of the same steps;
# a compilation cache on disk, shared by the workers of this run only, lets the second read the first's.
if os.environ.get("PYTEST_XDIST_TESTRUNUID"):
    import tempfile
    jax.config.update("jax_compilation_cache_dir",
                      os.path.join(tempfile.gettempdir(), f"minagent-tests-{os.environ['PYTEST_XDIST_TESTRUNUID']}"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_sessionfinish(session):
    """The controller (not a worker) removes the run's compilation cache."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run and not hasattr(session.config, "workerinput"):
        import shutil
        import tempfile
        shutil.rmtree(os.path.join(tempfile.gettempdir(), f"minagent-tests-{run}"), ignore_errors=True)

from minagent import chat, model, weights  # noqa: E402
from minagent import tokenizer as tk  # noqa: E402
from minagent.tasks.calculator import missions  # noqa: E402


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


def rote_model(tok, *scripts):
    """Params of a transformer that, greedily, writes after token a the token that follows a in `scripts`.

    The layers add nothing (their output projections are zero), so the last position's logits
    depend on its token only: token a is embedded as the one-hot of its state s(a), and the head
    maps state s(a) to the token that follows a. rote_model(tok, "<|assistant|>ok<|end|>") answers
    "ok<|end|>" to any prompt that ends with <|assistant|>. It runs through the real Batch, cache
    and decode step, so the loop can be tested on exact, known episodes.
    """
    rules = {}
    for script in scripts:
        ids = tok.encode(script)
        for a, b in zip(ids, ids[1:]):
            assert rules.setdefault(a, b) == b, f"{tok.decode([a])!r} is followed by two different tokens"
    D = 16                                          # one config for every script: its steps compile once
    assert len(rules) < D, "a state per rule, and state 0"
    cfg = model.Config(vocab_size=tok.n_vocab, d_model=D, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=8,
                       tie_embeddings=False)
    params = model.init(jax.random.PRNGKey(0), cfg)
    layers = dict(params["layers"], wo=0 * params["layers"]["wo"], w_down=0 * params["layers"]["w_down"])
    state = {a: s for s, a in enumerate(rules, 1)}                  # state 0: every other token
    embed_VxD = np.zeros((cfg.vocab_size, D), np.float32)
    embed_VxD[np.arange(cfg.vocab_size), [state.get(a, 0) for a in range(cfg.vocab_size)]] = 1
    unembed_DxV = np.zeros((D, cfg.vocab_size), np.float32)
    for a, b in rules.items():
        unembed_DxV[state[a], b] = 10.0
    return dict(params, layers=layers, embed=jax.numpy.asarray(embed_VxD),
                unembed=jax.numpy.asarray(unembed_DxV)), cfg


@pytest.fixture(scope="session")
def rote():
    """rote_model, for tests: rote(tok, script, ...) -> (params, cfg)."""
    return rote_model
