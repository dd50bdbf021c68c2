"""minagent's SmolLM2 forward pass against Hugging Face transformers, on the same GGUF file.

    pip install -e '.[ref]'       # transformers' GGUF loading also needs accelerate
    python benchmarks/compare_hf.py          # about 1.5 min on 2 CPU cores, mostly loading

Both sides dequantize the same Q4_1/Q8_0 file to float32. transformers' GGUF
loader un-permutes the q and k rows into its "rotate_half" RoPE convention;
minagent keeps GGUF's row order and rotates adjacent pairs (model.rope). The
two conventions are the same rotation applied to differently ordered rows, so
the logits must agree to float32 rounding. Prints the largest |logit
difference| per prompt (target <= 1e-3) and writes benchmarks/results/compare_hf.json.
"""

import argparse
import json
import pathlib
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from minagent import model, tokenfile, weights

PROMPTS = {
    "chatml": "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "chatml_system": "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                     "<|im_end|>\n<|im_start|>user\nWhat is 4821 + 3907?<|im_end|>\n<|im_start|>assistant\n",
    "plain": "The quick brown fox jumps over the lazy dog. Rotary embeddings rotate pairs of dimensions",
    "plain_long": " ".join(["Paris is the capital and largest city of France."] * 12),
}
TARGET = 1e-3


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", default=None, help="path of the GGUF file (default: weights.smollm2_path())")
    parser.add_argument("--out", default="benchmarks/results/compare_hf.json")
    args = parser.parse_args()
    path = pathlib.Path(args.gguf or weights.smollm2_path())
    torch.set_num_threads(2)

    t0 = time.time()
    hf_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    hf.eval()
    params, cfg = weights.load_params(path)
    tok = tokenfile.from_gguf(path)
    print(f"loaded both in {time.time() - t0:.1f} s")
    hf_cfg = hf.config
    print(f"transformers: rms_norm_eps {hf_cfg.rms_norm_eps}, rope_theta "
          f"{getattr(hf_cfg, 'rope_theta', None) or hf_cfg.rope_parameters}; "
          f"minagent: norm_eps {cfg.norm_eps}, rope_theta {cfg.rope_theta}")

    forward = jax.jit(model.forward, static_argnums=1)
    rows = []
    print(f"\n{'prompt':<14} {'tokens':>6} {'ids equal':>9} {'max |dlogit|':>12} {'max |logit|':>11} {'argmax agree':>12}")
    for name, text in PROMPTS.items():
        ids = hf_tok(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            theirs_TxV = hf(torch.tensor([ids])).logits[0].numpy()
        ours_TxV = np.asarray(forward(params, cfg, jnp.asarray([ids], jnp.int32))[0])
        diff = float(np.abs(ours_TxV - theirs_TxV).max())
        agree = float((ours_TxV.argmax(-1) == theirs_TxV.argmax(-1)).mean())
        row = {"prompt": name, "tokens": len(ids), "ids_equal": tok.encode(text) == ids,
               "max_abs_logit_diff": diff, "max_abs_logit": float(np.abs(theirs_TxV).max()),
               "argmax_agreement": agree}
        rows.append(row)
        print(f"{name:<14} {len(ids):>6} {str(row['ids_equal']):>9} {diff:>12.2e} "
              f"{row['max_abs_logit']:>11.2f} {agree:>12.3f}")

    worst = max(r["max_abs_logit_diff"] for r in rows)
    verdict = "ok" if worst <= TARGET else "ABOVE TARGET"
    print(f"\nworst max |logit difference| {worst:.2e} (target <= {TARGET:g}): {verdict}")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "what": "max |logit difference|, minagent vs transformers, SmolLM2-135M-Instruct Q4_1 GGUF, float32",
        "gguf": path.name, "target": TARGET, "worst": worst, "prompts": rows,
        "versions": {"jax": jax.__version__, "torch": torch.__version__,
                     "transformers": __import__("transformers").__version__},
        "machine": platform.machine(), "date": time.strftime("%Y-%m-%d"),
    }, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
