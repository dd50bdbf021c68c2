"""SmolLM2-135M-Instruct from its GGUF file into minagent's params and tokenizer."""

import os
import pathlib

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path():
    """Where the SmolLM2 GGUF file lives: $MINAGENT_SMOLLM2, else ~/.cache/minagent/."""
    if os.environ.get("MINAGENT_SMOLLM2"):
        return pathlib.Path(os.environ["MINAGENT_SMOLLM2"])
    return pathlib.Path.home() / ".cache" / "minagent" / GGUF_NAME
