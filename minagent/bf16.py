"""bfloat16 matrices for decoding on CPU: `params = bf16.matrices(params)`, then Batch(params, ...)
as before. Each matrix a token multiplies (projections, output head) is held in bfloat16, half
float32's bytes; the embedding table, the norms and every activation stay float32. model.dense
rounds x to bfloat16 for those products and sums them in float32.

Why: a batch's steps are held by arithmetic, not by the weights' bytes, and a CPU with AVX512_BF16
(AMD Zen 4; Intel Xeons since Cooper Lake) multiplies bfloat16 pairs at twice float32's rate.
SmolLM2's 211 products, 2 cores of an AMD EPYC Zen 4: 27 / 65 / 159 ms at 16 / 64 / 192 rows,
against 47 / 123 / 300 in float32 (int8.dot: 46 / 161 / 473); 64 agent episodes in one batch
7.0-8.0 s against 12.5 s that evening (benchmarks/bench_agent.py --bf16). Weights and
activations both in bfloat16 (Config.dtype) are slower than float32 on a CPU, even with float32
sums: XLA converts each elementwise step's operands to float32 and back (the same 64 episodes:
11.8 s against 10.9 s).

For batches, not for one row: XLA runs a bfloat16 product of a single row of x slowly (the 211
products at 1 row: 235 ms, float32 32 ms), so a batch of one slot is slower than in float32
(the 64 episodes one at a time: 113.6 s, against 47.1 s in float32 on such a CPU); int8.quantize
is the format for that, and int8.quantize(params, bf16=True) holds both: int8 for one row, these
bfloat16 matrices for more. Not measured on a CPU without AVX512_BF16, where XLA has no bfloat16
product to use: measure there before you choose it (benchmarks/bench_agent.py --bf16 --quick).

The numbers move by bfloat16's rounding (8 mantissa bits): logits by a few hundredths, so greedy
decoding can part from float32's where its two best tokens are that close.
"""

import jax.numpy as jnp


def matrices(params):
    """params (model.init's layout, float32) with each projection and the output head in bfloat16;
    the head becomes a matrix of its own ("unembed") if it was the embedding table (tied), which
    stays float32 for the lookup."""
    layers = {name: w.astype(jnp.bfloat16) if name.startswith("w") else w
              for name, w in params["layers"].items()}
    head_DxV = params["unembed"] if "unembed" in params else params["embed"].T
    return {**params, "layers": layers, "unembed": head_DxV.astype(jnp.bfloat16)}
