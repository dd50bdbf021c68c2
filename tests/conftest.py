"""Shared fixtures. Tests run on CPU, hermetic: no network, tmp_path for files."""

import os

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from minagent import chat, missions, weights  # noqa: E402
from minagent import tokenizer as tk  # noqa: E402


@pytest.fixture(scope="session")
def tok():
    """A BPE of 400 ids trained on 300 generated missions, with minagent's special tokens.
    (A test module that needs another tokenizer defines its own `tok`, which takes precedence.)"""
    text = "\n".join(chat.text(m.trace) for m in missions.generate(300, seed=0))
    return tk.train(text, vocab_size=400, specials=tk.MINAGENT_SPECIALS)


@pytest.fixture(scope="session")
def smollm2_gguf():
    """Path to SmolLM2-135M-Instruct.Q4_1.gguf, or skip the test with the command that fetches it."""
    path = weights.smollm2_path()
    if not path.exists():
        pytest.skip(f"SmolLM2 weights not found at {path}; fetch them with `python -m minagent.weights fetch` "
                    f"(or set MINAGENT_SMOLLM2 to the .gguf file)")
    return path
