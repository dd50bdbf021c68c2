"""Batch.send with a changed view: the cache of the prefix it shares with the old one is reused.

    python -m pytest tests/engine/test_prefix.py -q

A history of tool rounds is sent as view A; then view B, where an old result is
cleared (replaced by a short note), is sent instead. Continuing from the reused
prefix must give what a fresh sequence prefilling all of B gives (logits within
1e-5, the same greedy tokens), while pushing only the positions from the first
changed token on.
"""

import jax
import numpy as np
import pytest

from minagent import chat, model
from minagent.batch import Batch
from minagent.cache import pages_for
from minagent.chat import Message

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


CLEARED = Message("result", "[result cleared]")


def render(view, tok):
    return [int(t) for t in chat.render([chat.render_message(m, FMT) for m in view], tok)[0]]


def batch(tiny, **kw):
    return Batch(*tiny, slots=2, n_pages=96, page_size=S, max_len=256, keep_logits=True, **kw)


def test_rewrite_after_clearing_equals_fresh_prefill(tok, tiny):
    h = history()
    view_a = h
    view_b = tuple(CLEARED if j == 2 else m for j, m in enumerate(h))     # the oldest result cleared
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
    assert reuse.seqs[r].status == "length" and len(reuse.seqs[r].pages) == pages_for(len(a), S)
    pushed_a = reuse.seqs[r].positions
    assert reuse.send(r, b, 10) == len(b) - shared                  # exactly the changed part
    assert shared % S and len(reuse.seqs[r].pages) == pages_for(shared, S)  # the part-used page stays
    while reuse.running():
        reuse.step()

    assert reuse.seqs[r].tokens == fresh.seqs[f].tokens                          # the same greedy tokens
    np.testing.assert_allclose(np.stack(reuse.seqs[r].logits)[1:], np.stack(fresh.seqs[f].logits), atol=1e-5, rtol=0)
    assert reuse.seqs[r].positions - pushed_a == fresh.seqs[f].positions - shared
    assert reuse.seqs[r].refilled == len(b) - shared
    # pages: as many as B given whole as a prompt, and none leaked
    assert len(reuse.seqs[r].pages) == len(fresh.seqs[f].pages)
    reuse.finish(r)
    assert reuse.pool.n_free == reuse.pool.n_pages - 1


def test_rewrite_checks_status_and_without_cache_pushes_everything(tok, tiny):
    h = history()
    a = render(h[:3], tok)
    b = render(h[:2] + (CLEARED,), tok)
    plain = batch(tiny, reuse_cache=False)
    i = plain.add(a, 2)
    with pytest.raises(ValueError, match="only paused"):
        plain.send(i, b, 4)                 # queued
    plain.step()
    with pytest.raises(ValueError, match="only paused"):
        plain.send(i, b, 4)                 # running
    plain.step()
    with pytest.raises(ValueError, match="longer than the cache"):
        plain.send(i, b, 256)               # past max_len: nothing changes
    assert plain.seqs[i].tokens[:len(a)] == a
    assert plain.send(i, b, 4) == len(b)    # no cache, nothing kept: every position pushed again,
    assert len(plain.seqs[i].pages) == pages_for(len(render(h[:2], tok)), S)   # into the pages it holds
    while plain.running():
        plain.step()
    plain.finish(i)
    assert plain.pool.n_free == plain.pool.n_pages - 1


def test_appending_keeps_every_cached_position(tok, tiny):
    """A resume is a send whose tokens extend the old ones: every cached position stays, nothing is refilled."""
    a = render(history()[:3], tok)
    bt = batch(tiny)
    i = bt.add(a, 3)
    while bt.running():
        bt.step()
    assert bt.send(i, bt.seqs[i].tokens + [5, 6, 7], 4) == 1 + 3     # the last token sampled, and the new ones
    while bt.running():
        bt.step()
    seq = bt.seqs[i]
    assert seq.positions == len(seq.tokens) - 1 and seq.refilled == 0    # every token once
    assert len(seq.pages) == pages_for(len(seq.tokens) - 1, S)
