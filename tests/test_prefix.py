"""Batch.rewrite: a new view of an episode reuses the cache of the prefix it shares with the old one.

    /work/venv/bin/python -m pytest tests/test_prefix.py -q       # about 20 s on 2 CPU cores

The issue's test: a history of tool rounds is sent as view A; then view B, where
an old result is cleared (replaced by context.CLEARED_NOTE), is swapped in with
rewrite(). Continuing from the reused prefix must give what a fresh sequence
prefilling all of B gives (logits within 1e-5, the same greedy tokens), while
pushing only the positions from the first changed token on.
"""

import jax
import numpy as np
import pytest

from minagent import chat, model
from minagent import context as cx
from minagent.batch import Batch
from minagent.cache import pages_for
from minagent.context import Message

FMT = chat.MINAGENT
S = 4                               # a small page size: the kept prefix ends inside a page


@pytest.fixture(scope="module")
def tiny(tok):
    """Random weights, scaled up so that greedy decoding does not repeat one token forever."""
    cfg = model.Config(vocab_size=tok.n_vocab, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)
    params = model.init(jax.random.PRNGKey(0), cfg)
    return jax.tree.map(lambda w: 4.0 * w if w.ndim > 1 else w, params), cfg


def history():
    """A brief, then three rounds of a call and a long-ish result."""
    h = [Message("first", "Sort the numbers of each line.")]
    for j, line in enumerate(["81 5 23 7 70 12", "4821 3907 16 9", "5 3 1 4 2 8 6 7"]):
        h += [Message("model", f"{FMT.call}sort {line}{FMT.result}"),
              Message("result", " ".join(sorted(line.split(), key=int)))]
    return tuple(h)


def render(view, tok):
    return [int(t) for t in chat.render(cx.render_view(view, FMT), tok)[0]]


def batch(tiny, **kw):
    return Batch(*tiny, slots=2, n_pages=96, page_size=S, max_len=256, keep_logits=True, **kw)


def test_rewrite_after_clearing_equals_fresh_prefill(tok, tiny):
    h = history()
    view_a = h
    view_b = tuple(cx.CLEARED if j == 2 else m for j, m in enumerate(h))     # the oldest result cleared
    a, b = render(view_a, tok), render(view_b, tok)
    shared = len(render(h[:2], tok))          # the tokens of the messages before the cleared one
    assert a[:shared] == b[:shared] and a[shared] != b[shared]

    fresh = batch(tiny)
    f = fresh.add(b, 10)
    while fresh.running():
        fresh.step()

    reuse = batch(tiny)
    r = reuse.add(a, 1)                       # view A goes through the model, one token is sampled
    reuse.step()
    assert reuse.status(r) == "length" and len(reuse.pages(r)) == pages_for(len(a), S)
    pushed_a = reuse.positions[r]
    assert reuse.rewrite(r, b, 10) == len(b) - shared                  # exactly the changed part
    assert shared % S and len(reuse.pages(r)) == pages_for(shared, S)  # the part-used page stays
    while reuse.running():
        reuse.step()

    assert reuse.tokens(r) == fresh.tokens(f)                          # the same greedy tokens
    np.testing.assert_allclose(reuse.logits(r)[1:], fresh.logits(f), atol=1e-5, rtol=0)
    assert reuse.positions[r] - pushed_a == fresh.positions[f] - shared
    assert reuse.reprefilled == {r: len(b) - shared} and reuse.total_reprefilled == len(b) - shared
    # pages: as many as B given whole as a prompt, and none leaked
    assert len(reuse.pages(r)) == len(fresh.pages(f))
    reuse.finish(r)
    assert reuse.pool.n_free == reuse.pool.n_pages - 1


def test_rewrite_checks_status_and_without_cache_pushes_everything(tok, tiny):
    h = history()
    a = render(h[:3], tok)
    b = render(h[:2] + (cx.CLEARED,), tok)
    plain = batch(tiny, cache=False)
    i = plain.add(a, 2)
    with pytest.raises(ValueError, match="only paused"):
        plain.rewrite(i, b, 4)                 # queued
    plain.step()
    with pytest.raises(ValueError, match="only paused"):
        plain.rewrite(i, b, 4)                 # running
    plain.step()
    with pytest.raises(ValueError, match="longer than the cache"):
        plain.rewrite(i, b, 256)               # past max_len: nothing changes
    assert plain.tokens(i)[:len(a)] == a
    assert plain.rewrite(i, b, 4) == len(b)    # no cache, nothing kept
    assert plain.pages(i) == []
    while plain.running():
        plain.step()
    plain.finish(i)
    assert plain.pool.n_free == plain.pool.n_pages - 1


def test_identical_view_keeps_all_but_the_last_token(tok, tiny):
    """Rewriting a view with itself plus appended tokens costs what resume() costs."""
    a = render(history()[:3], tok)
    costs = []
    for move in ("resume", "rewrite"):
        bt = batch(tiny)
        i = bt.add(a, 3)
        while bt.running():
            bt.step()
        extra = [5, 6, 7]
        if move == "resume":
            bt.resume(i, extra, 4)
        else:
            bt.rewrite(i, bt.tokens(i) + extra, 4)
        while bt.running():
            bt.step()
        costs.append((bt.positions[i], bt.tokens(i), len(bt.pages(i))))
    assert costs[0] == costs[1]
