"""A transformer that writes by rote: weights set by hand so that greedy decoding follows a script.

    params, cfg = rote(tok, "<|assistant|>ok<|end|>")     # answers "ok<|end|>" after any <|assistant|>

The layers add nothing (their output projections are zero), so the last position's logits
depend on its token only: token a is embedded as the one-hot of its state s(a), and the
head maps state s(a) to the token that follows a in the scripts. It runs through the real
Batch, cache and decode step, so the agent loop can be tested and timed on episodes known
exactly, without training anything (tests/, benchmarks/bench_tools.py).
"""

import jax
import numpy as np

from minagent import model

WIDTH = 16          # one config for every script, so their steps compile once: at most 15 rules


def rote(tok, *scripts):
    """-> (params, cfg) of a model that, after token a, writes the token that follows a in `scripts`."""
    rules = {}
    for script in scripts:
        ids = tok.encode(script)                  # the scripts are the program's: markers are markers
        for a, b in zip(ids, ids[1:]):
            if rules.setdefault(a, b) != b:
                raise ValueError(f"{tok.decode([a])!r} is followed by two different tokens in the scripts")
    if len(rules) >= WIDTH:
        raise ValueError(f"{len(rules)} rules: a rote model of width {WIDTH} holds at most {WIDTH - 1}")
    cfg = model.Config(vocab_size=tok.n_vocab, d_model=WIDTH, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=8,
                       tie_embeddings=False)
    params = model.init(jax.random.PRNGKey(0), cfg)
    layers = dict(params["layers"], wo=0 * params["layers"]["wo"], w_down=0 * params["layers"]["w_down"])
    state = {a: s for s, a in enumerate(rules, 1)}                  # state 0: every other token
    embed_VxD = np.zeros((cfg.vocab_size, WIDTH), np.float32)
    embed_VxD[np.arange(cfg.vocab_size), [state.get(a, 0) for a in range(cfg.vocab_size)]] = 1
    unembed_DxV = np.zeros((WIDTH, cfg.vocab_size), np.float32)
    for a, b in rules.items():
        unembed_DxV[state[a], b] = 10.0
    return dict(params, layers=layers, embed=jax.numpy.asarray(embed_VxD), unembed=jax.numpy.asarray(unembed_DxV)), cfg
