"""Recipes shared by the demo (`python -m minagent`) and the experiment scripts.

    tok = mission_tokenizer(train_missions)            # a BPE trained on the missions' own text
    params, cfg, history = train_small(examples, tok, steps=500)
    records = run_missions(params, cfg, tok, test_missions)            # with the calculator
    records = run_missions(params, cfg, tok, test_missions, direct=True)  # the control: no tool
    accuracy(records, test_missions)

A small model from scratch knows no English, so it learns from the missions
alone: the tokenizer is trained on their text, and the pre-tokenizer is
SmolLM2's ("smollm": every digit is its own piece). Copying a number is then
copying a run of digit tokens, the same ten pieces whatever the number.
"""

import time

import jax
import numpy as np

from minagent import agent, chat, model, train
from minagent import tokenizer as tk
from minagent.tools import Toolbox

FMT = chat.MINAGENT
# The mission mix the small models train on: additions weigh four times the other families.
FAMILIES = ("add",) * 4 + ("reverse", "sort", "age", "city", "together", "later", "sort_ages",
                           "retry", "fix", "direct")
SMALL = dict(d_model=128, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=384)


def mission_tokenizer(ms, vocab_size=512, n_text=3000):
    """A byte-level BPE trained on the text of the first n_text missions (digits split first)."""
    text = "\n".join(chat.text(m.trace) for m in ms[:n_text])
    return tk.train(text, vocab_size=vocab_size, pattern=tk.SMOLLM_PATTERN, specials=tk.MINAGENT_SPECIALS)


def examples(ms, tok, direct=False):
    """Rendered (tokens, authors) traces: the tool-using trace, or the direct answer (the control)."""
    return [chat.render(m.direct if direct else m.trace, tok) for m in ms]


def small_tcfg(steps=500, seed=0):
    """The small model's training recipe: batches of 32 x 128 tokens, AdamW at 3e-3."""
    return train.TrainConfig(steps=steps, batch_size=32, seq_len=128, lr=3e-3, warmup=50, seed=seed,
                             log_every=25)


def train_small(exs, tok, steps=500, seed=0, progress=True, **arch):
    """A small Llama-style model trained from scratch on `exs` -> (params, cfg, history)."""
    cfg = model.Config(vocab_size=tok.n_vocab, **{**SMALL, **arch})
    params = model.init(jax.random.PRNGKey(seed), cfg)
    params, history = train.train(params, cfg, exs, small_tcfg(steps, seed), progress=progress)
    return params, cfg, history


def run_missions(params, cfg, tok, ms, direct=False, fmt=FMT, **kw):
    """Each mission's prompt through the agent loop -> records.

    direct=True: the tools refuse every call (an empty toolbox), as for a model
    that was taught to answer without them.
    """
    boxes = [Toolbox(m.seed, fail_first=m.fail_first, tools=() if direct else None) for m in ms]
    kw = {"slots": 64, "max_len": 256, **kw}
    records, _ = agent.run(params, cfg, tok, fmt, [m.trace[0] for m in ms], boxes, **kw)
    return records


def accuracy(records, ms):
    return float(np.mean([r.answer == m.answer for r, m in zip(records, ms)]))


def timed(fn, *args, **kw):
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    return out, time.perf_counter() - t0
