"""Shared fixtures. Tests run on CPU, hermetic: no network, tmp_path for files."""

import os

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from minagent import weights  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_gguf():
    """Path to SmolLM2-135M-Instruct.Q4_1.gguf, or skip the test with the command that fetches it."""
    path = weights.smollm2_path()
    if not path.exists():
        pytest.skip(f"SmolLM2 weights not found at {path}; fetch them with `python -m minagent.weights fetch` "
                    f"(or set MINAGENT_SMOLLM2 to the .gguf file)")
    return path
