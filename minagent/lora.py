"""LoRA: train a low-rank change to the model's projections, not the projections themselves.

    lora = init(key, params, rank=8)                       # the adapters: a few small matrices
    tuned = merge(params, lora, alpha=16)                  # W + (alpha / rank) * A @ B, per layer
    lora, history = train_lora(params, cfg, examples, tcfg, rank=8, alpha=16)

For each target projection W [L, in, out] (all L layers at once) the adapter is
a pair A [L, in, r], B [L, r, out] with r much smaller than in and out:

    W' = W + (alpha / r) * A @ B

B starts at zero, so W' == W and the tuned model starts as exactly the base
model (a test checks the logits are unchanged). Only A and B are trained; the
base params are read, never updated. For SmolLM2-135M with r = 8 on all seven
projections that is 2.4 M trained numbers instead of 135 M, and AdamW keeps two
moments for those only. The base model's knowledge (its English) stays in W.

`merge` is a pure function of (params, lora), so the model code is untouched:
the adapter's loss is `train.loss_fn(merge(base, lora), cfg, batch)`, and
jax.grad of it with respect to lora is the whole of LoRA training. (Merging
costs one [in, r] x [r, out] matmul per projection per step: small next to the
forward pass over a batch. The backward pass still forms dL/dW' for each
projection; a fused x @ W + (x @ A) @ B would skip that, at the price of
touching the model code.)

New tokens. model.add_tokens gives new tokens mean-initialised embedding rows:
identical rows, so with tied embeddings two new tokens always get the same
logit and the model could never tell `<|call|>` from `<|result|>` when writing.
LoRA does not touch the embedding table. `new_rows=n` adds a trainable delta
[E, D] to the table's last E rows (with tied embeddings, the output head too),
starting at zero like B.

Shape letters: the legend in model.py (R the rank, E new embedding rows).
"""

import functools

import jax
import jax.numpy as jnp

from minagent import train

TARGETS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")   # the attention and MLP projections


def init(key, params, rank=8, targets=TARGETS, new_rows=0):
    """Adapters for `targets`, plus {"new_rows": [E, D] zeros} if new_rows > 0:

        {name: {"a": [L, I, R] ~ normal(0, 1/sqrt(I)), "b": [L, R, O] zeros}}

    A is random so that B's gradient is not zero at the start; B is zero so that
    the tuned model starts exactly at the base model.
    """
    lora = {}
    for name, k in zip(targets, jax.random.split(key, len(targets))):
        L, I, O = params["layers"][name].shape
        dtype = params["layers"][name].dtype
        lora[name] = {"a": (jax.random.normal(k, (L, I, rank)) / I ** 0.5).astype(dtype),
                      "b": jnp.zeros((L, rank, O), dtype)}
    if new_rows:
        lora["new_rows"] = jnp.zeros((new_rows, params["embed"].shape[1]), params["embed"].dtype)
    return lora


def merge(params, lora, alpha=16.0):
    """-> params with W + (alpha / rank) * A @ B for each adapted projection (rank read from A).

    Example, one layer, rank 1, alpha 1: W = [[1, 0], [0, 1]], A = [[1], [2]], B = [[3, 4]]
        W' = W + A @ B = [[1 + 3, 0 + 4], [0 + 6, 1 + 8]] = [[4, 4], [6, 9]]
    """
    layers = dict(params["layers"])
    for name, ab in lora.items():
        if name == "new_rows":
            continue
        a_LxIxR, b_LxRxO = ab["a"], ab["b"]
        scale = alpha / a_LxIxR.shape[-1]
        layers[name] = layers[name] + (scale * (a_LxIxR @ b_LxRxO)).astype(layers[name].dtype)
    out = {**params, "layers": layers}
    if "new_rows" in lora:
        n = lora["new_rows"].shape[0]
        out["embed"] = params["embed"].at[-n:].add(lora["new_rows"])           # [V, D]
        if "unembed" in params:   # untied head: the same delta on the new tokens' output columns
            out["unembed"] = params["unembed"].at[:, -n:].add(lora["new_rows"].T)
    return out


def n_trained(lora):
    return sum(x.size for x in jax.tree_util.tree_leaves(lora))


def adapter_loss(lora, cfg, batch, frozen, alpha):
    """train.loss_fn of the base model (`frozen`) with the adapters merged in."""
    return train.loss_fn(merge(frozen, lora, alpha), cfg, batch)


@functools.lru_cache(maxsize=None)
def _loss_with(alpha):
    """One loss function per alpha, so train's compiled-step cache can find it again."""
    return functools.partial(adapter_loss, alpha=alpha)


def train_lora(base, cfg, examples, tcfg, rank=8, alpha=16.0, targets=TARGETS, new_rows=0, seed=0,
               lora=None, **kw):
    """Train adapters on (tokens, authors) traces with train.train's loop -> (lora, history).

    Everything of train.train applies (packing, AdamW with warm-up and cosine,
    progress, checkpoints of the adapters: pass checkpoint_path). `base` is never
    modified. Pass `lora` to continue from existing adapters.
    """
    if lora is None:
        lora = init(jax.random.PRNGKey(seed), base, rank, targets, new_rows)
    return train.train(lora, cfg, examples, tcfg, loss=_loss_with(float(alpha)), frozen=base, **kw)
