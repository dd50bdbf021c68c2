"""Paged extend/decode against the whole-sequence forward pass (tiny random models, CPU).

    python -m pytest tests/engine/test_decode.py -q

The reference is model.forward on each row's whole sequence: the paged cache
must give the same logits (float32, within 1e-5) whatever the page size, the
chunking into prefill and decode calls, the order of the pages in the pool,
the other rows of the batch, and whatever garbage sits in pages a row does
not own.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minagent import decode, model, runner
from minagent.batch import Batch
from minagent.runner import RunnerConfig
from minagent.cache import PagePool, init_cache, pages_for

extend = jax.jit(decode.extend, static_argnums=1)
forward = jax.jit(model.forward, static_argnums=1)


def tiny(n_heads=4, n_kv_heads=2, tie=True, seed=0, vocab=61, d_model=32):
    cfg = model.Config(vocab_size=vocab, d_model=d_model, n_layers=2, n_heads=n_heads, n_kv_heads=n_kv_heads,
                       d_ff=48, tie_embeddings=tie)
    return model.init(jax.random.PRNGKey(seed), cfg), cfg


class Rows:
    """Rows of whole token sequences pushed through the paged cache in chunks, as the Batch does.

    Each row gets its pages from a PagePool in a shuffled order (so pages are
    not contiguous), and `push` checks every returned logit against forward.
    """

    def __init__(self, params, cfg, seqs, page_size, n_pages=None, garbage=None):
        self.params, self.cfg, self.seqs, self.Z = params, cfg, seqs, page_size
        max_len = max(len(s) for s in seqs)
        self.W = pages_for(max_len, page_size) + 1                    # one spare column stays null
        n_pages = n_pages or 1 + len(seqs) * self.W + 5               # some pages stay free
        self.cache = init_cache(cfg, n_pages, page_size)
        self.pool = PagePool(n_pages)
        rng = np.random.RandomState(len(seqs) * 7 + page_size)
        rng.shuffle(self.pool.free[0])
        self.table_BxW = np.zeros((len(seqs), self.W), np.int32)
        for r, s in enumerate(seqs):
            pages = self.pool.alloc(pages_for(len(s), page_size))
            self.table_BxW[r, :len(pages)] = pages
        self.length_B = np.zeros(len(seqs), np.int32)
        # One forward call for all rows: padding at the end changes no earlier position (causal).
        padded_BxT = np.zeros((len(seqs), max_len), np.int32)
        for r, s in enumerate(seqs):
            padded_BxT[r, :len(s)] = s
        self.reference = np.asarray(forward(params, cfg, padded_BxT))

    def push(self, n_new_B, T=None):
        """Push the next n_new_B[r] tokens of each row in one extend call of width T; check the logits."""
        n_new_B = np.asarray(n_new_B, np.int32)
        T = T or max(1, int(n_new_B.max()))
        tokens_BxT = np.zeros((len(self.seqs), T), np.int32)
        for r, s in enumerate(self.seqs):
            tokens_BxT[r, :n_new_B[r]] = s[self.length_B[r]:self.length_B[r] + n_new_B[r]]
        logits_BxV, self.cache = extend(self.params, self.cfg, self.cache, tokens_BxT, self.length_B, n_new_B,
                                        self.table_BxW)
        self.length_B = self.length_B + n_new_B
        for r in np.flatnonzero(n_new_B):
            want = self.reference[r][self.length_B[r] - 1]
            np.testing.assert_allclose(logits_BxV[r], want, atol=1e-5, rtol=0)
        return logits_BxV


@pytest.mark.parametrize("n_heads,n_kv_heads,tie,page_size", [
    (4, 4, True, 1), *[pytest.param(*p, marks=pytest.mark.slow) for p in
                       [(4, 2, False, 4), (4, 1, True, 16), (2, 1, False, 4), (4, 2, True, 16)]]])
def test_extend_equals_forward(n_heads, n_kv_heads, tie, page_size):
    params, cfg = tiny(n_heads, n_kv_heads, tie)
    rng = np.random.RandomState(page_size)
    lengths = [19, 6, 0, 23]                         # row 2 is idle throughout
    seqs = [list(rng.randint(0, cfg.vocab_size, n)) for n in lengths]
    rows = Rows(params, cfg, seqs, page_size)
    rows.push([7, 3, 0, 9], T=16)                    # a padded prefill chunk, rows of different lengths
    rows.push([5, 0, 0, 8], T=16)                    # a second chunk from the middle; row 1 idles
    while any(rows.length_B < lengths):              # then token by token; finished rows idle
        rows.push((rows.length_B < lengths).astype(np.int32), T=1)


@pytest.mark.parametrize("page_size", [pytest.param(1, marks=pytest.mark.slow), 4])
def test_greedy_decode_after_prefill_equals_forward(page_size):
    """Prefill a prompt, decode greedily with decode_step; forward on the result agrees at every step."""
    params, cfg = tiny(seed=3)
    params = jax.tree.map(lambda w: 5 * w if w.ndim > 1 else w, params)   # peakier logits: varied tokens
    prompts = [[5, 9, 2, 7, 7, 1], [3]]
    n_gen, Z = 12, page_size
    W = pages_for(len(prompts[0]) + n_gen, Z)
    cache = init_cache(cfg, 1 + 2 * W, Z)
    table_BxW = np.arange(1, 1 + 2 * W, dtype=np.int32).reshape(2, W)
    tokens = [list(p) for p in prompts]
    # Prefill all but the last prompt token; decode_step pushes the last one. (The Batch pushes them
    # all and samples from the prefill's logits: test_batch.py checks that path.)
    n_pre = np.array([len(p) - 1 for p in prompts], np.int32)
    pre_BxT = np.zeros((2, 8), np.int32)
    for r, p in enumerate(prompts):
        pre_BxT[r, :len(p) - 1] = p[:-1]
    _, cache = extend(params, cfg, cache, pre_BxT, np.zeros(2, np.int32), n_pre, table_BxW)
    got = [[], []]
    for _ in range(n_gen):
        last_B = np.array([t[-1] for t in tokens], np.int32)
        lengths_B = np.array([len(t) - 1 for t in tokens], np.int32)
        slots = decode.Slots(last_B, lengths_B, np.ones(2, bool), np.zeros(2, np.int32), table_BxW)
        later, logits_BxV, cache = decode.decode_step(params, cfg, cache, slots)
        np.testing.assert_array_equal(later.lengths_B, lengths_B + 1)
        next_B = later.tokens_B
        for r in range(2):
            tokens[r].append(int(next_B[r]))
            got[r].append(np.asarray(logits_BxV[r]))
    for r in range(2):
        ref_TxV = forward(params, cfg, jnp.asarray([tokens[r]]))[0]
        n = len(prompts[r])
        np.testing.assert_allclose(np.stack(got[r]), ref_TxV[n - 1:-1], atol=1e-5, rtol=0)
        assert tokens[r][n:] == list(np.argmax(ref_TxV[n - 1:-1], axis=-1))
        assert len(set(tokens[r][n:])) > 2, "degenerate test: greedy repeats one token"


def test_paused_slot_is_bit_identical():
    """Slot 1 is paused (active False) mid-page while slots 0 and 2 step: its pages do not change one bit."""
    params, cfg = tiny(seed=1)
    Z, W = 4, 4
    cache = init_cache(cfg, 1 + 3 * W, Z)
    table_BxW = np.arange(1, 1 + 3 * W, dtype=np.int32).reshape(3, W)
    prompt_BxT = np.random.RandomState(0).randint(0, cfg.vocab_size, (3, 6)).astype(np.int32)
    lengths_B = np.array([6, 5, 3], np.int32)         # slot 1 stops at 5: position 5 is in its page 2
    _, cache = extend(params, cfg, cache, prompt_BxT, np.zeros(3, np.int32), lengths_B, table_BxW)
    table_before, lengths_before = table_BxW.copy(), lengths_B.copy()
    own_pages = table_BxW[1]
    k_before, v_before = np.asarray(cache["k"][:, :, own_pages]), np.asarray(cache["v"][:, :, own_pages])
    untouched = np.setdiff1d(np.arange(1 + 3 * W), table_BxW[[0, 2]].ravel())   # null page may change
    untouched = untouched[untouched != 0]
    all_before = np.asarray(cache["k"][:, :, untouched])
    active_B = np.array([True, False, True])
    for step in range(5):
        tokens_B = np.array([step + 1, 99 % cfg.vocab_size, step + 2], np.int32)
        slots = decode.Slots(tokens_B, lengths_B, active_B, np.arange(3, dtype=np.int32), table_BxW)
        later, _, cache = decode.decode_step(params, cfg, cache, slots)
        assert later.tokens_B[1] == tokens_B[1]          # the paused slot's pending token stays
        lengths_B = np.asarray(later.lengths_B)
    assert np.array_equal(np.asarray(cache["k"][:, :, own_pages]), k_before)
    assert np.array_equal(np.asarray(cache["v"][:, :, own_pages]), v_before)
    assert np.array_equal(np.asarray(cache["k"][:, :, untouched]), all_before)
    assert lengths_B[1] == lengths_before[1] and np.array_equal(table_BxW, table_before)
    assert lengths_B[0] == 11                         # and the others did move


@pytest.mark.parametrize("garbage", [np.nan, *[pytest.param(g, marks=pytest.mark.slow) for g in (1e30, -np.inf)]])
def test_garbage_in_unowned_pages_changes_nothing(garbage):
    """Fill the null page, the free pages and each row's not-yet-written positions with garbage: same logits."""
    params, cfg = tiny(seed=2)
    rng = np.random.RandomState(1)
    lengths = [13, 5, 9]
    seqs = [list(rng.randint(0, cfg.vocab_size, n)) for n in lengths]
    clean, dirty = Rows(params, cfg, seqs, 4), Rows(params, cfg, seqs, 4)
    # Every page is garbage at first: the null page, free pages (as if freed by another sequence),
    # and the rows' own pages beyond what they have written.
    dirty.cache = jax.tree.map(lambda c: jnp.full_like(c, garbage), dirty.cache)
    for n_new in ([6, 2, 8], [4, 0, 1], [1, 1, 0], [1, 1, 0], [1, 1, 0]):
        want, got = clean.push(n_new, T=8), dirty.push(n_new, T=8)   # push itself checks against forward
        assert np.isfinite(np.asarray(got)).all()
        np.testing.assert_array_equal(got[np.asarray(n_new) > 0], want[np.asarray(n_new) > 0])


def test_no_copy_of_the_cache_per_layer():
    """The cache is carried through the layer scan and donated: peak temporary memory is far below its size."""
    params, cfg = tiny()
    cache = init_cache(cfg, 1025, 16)                  # 2 x 2 MiB per layer: a per-layer copy would show
    cache_bytes = sum(c.nbytes for c in cache.values())
    slots = decode.Slots(np.zeros(4, np.int32), np.zeros(4, np.int32), np.ones(4, bool), np.zeros(4, np.int32),
                         np.zeros((4, 8), np.int32))
    lowered = decode.decode_step.lower(params, cfg, cache, slots)
    mem = lowered.compile().memory_analysis()
    if mem is None:
        pytest.skip("this backend reports no memory analysis")
    assert mem.alias_size_in_bytes >= cache_bytes                  # donated: the output reuses the input
    assert mem.temp_size_in_bytes < cache_bytes / 4, (mem.temp_size_in_bytes, cache_bytes)


@functools.lru_cache
def _logits(seed, B=6, V=50):
    return jax.random.normal(jax.random.PRNGKey(seed), (B, V)) * 2


@pytest.mark.parametrize("top_k", [0, 5])
def test_sampling_depends_on_sequence_not_slot(top_k):
    """Row order and the other rows' logits do not change what a (seed, position) sequence draws."""
    logits_BxV = _logits(0)
    seeds_B, pos_B = np.array([3, 1, 4, 1, 5, 9], np.int32), np.array([7, 7, 2, 8, 0, 30], np.int32)
    drawn = np.asarray(decode.sample(logits_BxV, seeds_B, pos_B, 1.0, top_k))
    perm = np.array([4, 2, 0, 5, 1, 3])
    again = np.asarray(decode.sample(logits_BxV[perm], seeds_B[perm], pos_B[perm], 1.0, top_k))
    assert np.array_equal(again, drawn[perm])
    others = _logits(1).at[0].set(logits_BxV[0])       # row 0 unchanged, every other row different
    assert decode.sample(others, seeds_B, pos_B, 1.0, top_k)[0] == drawn[0]
    # Different positions draw differently (not one frozen key): 40 draws of row 0 are not all the same.
    many = [int(decode.sample(logits_BxV, seeds_B, pos_B + i, 1.0, top_k)[0]) for i in range(40)]
    assert len(set(many)) > 1
    if top_k:
        allowed = set(np.argsort(-np.asarray(logits_BxV[0]))[:top_k].tolist())
        assert set(many) <= allowed


def test_greedy_sampling_is_argmax():
    """Greedy sampling is NumPy's argmax row by row, ties (the first), NaN (the first NaN) and
    infinities included, jitted or not (decode.argmax's two reductions)."""
    logits_BxV = np.array(_logits(2))
    logits_BxV[1, [3, 17]] = logits_BxV[1].max() + 1               # a tie: the first wins
    logits_BxV[2, [9, 4]] = np.nan                                 # the first NaN, not the max
    logits_BxV[3] = -np.inf                                        # nothing: index 0
    logits_BxV[4, [30, 2]] = [np.inf, np.nan]                      # NaN over +inf
    logits_BxV[5, [40, 41]] = np.inf
    zeros_B = np.zeros(6, np.int32)
    want = np.argmax(logits_BxV, axis=-1)
    assert want.tolist()[1:] == [3, 4, 0, 2, 40]
    got = decode.sample(logits_BxV, zeros_B, zeros_B, 0.0, 0)
    jitted = jax.jit(decode.sample)(logits_BxV, zeros_B, zeros_B)
    assert np.array_equal(got, want) and np.array_equal(jitted, want)


def cache_converts(cfg, cache_dtype=None):
    """Convert ops in the compiled decode step whose shape holds the whole pool (K, P, Z, H)."""
    params = model.init(jax.random.PRNGKey(0), cfg)
    cache = init_cache(cfg, 65, 8, cache_dtype)
    hlo = decode.decode_step.lower(params, cfg, cache, decode.Slots.idle(4, 4)).compile().as_text()
    pool = ",".join(map(str, cache["k"].shape[1:]))
    return [line for line in hlo.splitlines() if " convert(" in line and pool in line]


@pytest.mark.slow
def test_no_cache_shaped_converts_in_the_default_decode_step():
    """With the default float32 weights and cache, the compiled step converts nothing of the cache's
    size: a convert of the whole pool per layer would cost as much as reading it. The count bites:
    with a bfloat16 cache XLA on CPU converts the pool to float32 and back in every layer; so off
    a GPU the Batch keeps bfloat16 weights' cache in float32, and that step converts nothing."""
    _, cfg = tiny()
    assert cfg.dtype == "float32" and cache_converts(cfg) == []
    bf16 = dataclasses.replace(cfg, dtype="bfloat16")
    assert cache_converts(bf16, "float32") == []
    if jax.default_backend() == "cpu":
        assert len(cache_converts(bf16)) >= 2 * cfg.n_layers
        assert Batch(model.init(jax.random.PRNGKey(0), bf16), bf16, slots=1).runner.kv["k"].dtype == jnp.float32


@pytest.mark.slow         # Pallas is opt-in; on CPU it runs in interpret mode, slowly
def test_pallas_attention_equals_the_gather_path():
    """JAX's Pallas paged-attention kernel (interpret mode off a GPU) against the gather path, in the
    decode step: random page tables in a shuffled pool, lengths from 1 to the table's width,
    paused rows and a free one, finite garbage in every page a row has not written. Same logits
    and cache (to float tolerance), same sampled tokens."""
    params, cfg = tiny(seed=3, d_model=64)                      # head_dim 16: Triton's dot needs 16
    rng = np.random.RandomState(4)
    B, Z, W, n_pages = 6, 16, 4, 32
    cache = init_cache(cfg, n_pages, Z)
    cache = jax.tree.map(lambda c: jnp.asarray(rng.normal(size=c.shape) * 3, c.dtype), cache)   # old K/V
    pool = PagePool(n_pages)
    rng.shuffle(pool.free[0])
    lengths_B = np.array([0, 1, 5, 12, 30, 17], np.int32)         # row 0 is free: nothing, no pages
    table_BxW = np.zeros((B, W), np.int32)
    for b, n in enumerate(lengths_B):
        pages = pool.alloc(pages_for(int(n) + 4, Z)) if n else []
        table_BxW[b, :len(pages)] = pages
    # Prefill what each row holds (the gather path: T > 1), so the pages hold real keys and values.
    prompt_BxT = rng.randint(0, cfg.vocab_size, (B, 32)).astype(np.int32)
    _, cache = extend(params, cfg, cache, prompt_BxT, np.zeros(B, np.int32), lengths_B, table_BxW)
    slots = decode.Slots(rng.randint(0, cfg.vocab_size, B).astype(np.int32), lengths_B,
                         np.array([False, True, True, False, True, True]), np.arange(B, dtype=np.int32), table_BxW)
    caches = {a: jax.tree.map(jnp.copy, cache) for a in ("gather", "pallas")}
    states, logits = {a: slots for a in caches}, {a: [] for a in caches}
    for _ in range(4):                                          # row 4 crosses into a new page
        for a in caches:
            states[a], lg, caches[a] = decode.decode_step(params, cfg, caches[a], states[a], attention=a)
            logits[a].append(np.asarray(lg))
    active_B = slots.active_B
    got, want = np.stack(logits["pallas"])[:, active_B], np.stack(logits["gather"])[:, active_B]
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    assert np.array_equal(states["pallas"].tokens_B, states["gather"].tokens_B)
    assert np.array_equal(states["pallas"].lengths_B, states["gather"].lengths_B)
    for name in ("k", "v"):
        # (layer 1's keys differ as its input does: layer 0's attention, to float tolerance)
        np.testing.assert_allclose(caches["pallas"][name][:, :, 1:], caches["gather"][name][:, :, 1:], atol=2e-5)
    with pytest.raises(ValueError, match="'pallas' for one"):
        decode.extend(params, cfg, cache, prompt_BxT, np.zeros(B, np.int32), lengths_B, table_BxW, "pallas")


def test_pallas_refuses_the_shapes_triton_cannot_compile():
    """Suspected, and confirmed by reading the kernel: it multiplies [16, head_dim] by [head_dim, pages *
    page_size] with Triton's dot, which needs 16 or more on each side, and at the Batch's first table
    width (one page) it loads one page at a time. Interpret mode would run page_size 4 anyway; a GPU
    would not compile it. So the Batch and the kernel's wrapper refuse it, on every backend."""
    params, cfg = tiny(d_model=64)                               # head_dim 16
    for page_size in (4, 8):
        with pytest.raises(ValueError, match="page_size >= 16"):
            Batch(params, cfg, slots=2, page_size=page_size, runner=RunnerConfig(attention="pallas"))
    small, small_cfg = tiny()                                    # head_dim 8
    with pytest.raises(ValueError, match="head_dim >= 16"):
        Batch(small, small_cfg, slots=2, page_size=16, runner=RunnerConfig(attention="pallas"))
    Batch(params, cfg, slots=2, page_size=16, runner=RunnerConfig(attention="pallas"))
    Batch(small, small_cfg, slots=2, page_size=4)               # the gather path takes any shape
    cache = init_cache(cfg, 4, 8)
    with pytest.raises(ValueError, match="page_size >= 16"):
        decode.paged_attention(jnp.zeros((1, 4, 16)), cache["k"], cache["v"], 0, np.ones((1, 1), np.int32),
                                np.ones(1, np.int32))


def nan_token_model(bad=5):
    """A tiny model whose token `bad` embeds as NaN (untied: its output row stays finite)."""
    params, cfg = tiny(d_model=64, vocab=40, tie=False)
    return {**params, "embed": params["embed"].at[bad].set(jnp.nan)}, cfg


@pytest.mark.parametrize("attention", ["gather", pytest.param("pallas", marks=pytest.mark.slow)])
def test_a_non_finite_value_of_one_sequence_reaches_no_other(attention):
    """Suspected: the Pallas kernel multiplies the masked weights of positions past a row's length by
    their values, so a NaN left in a page (by a sequence that overflowed, then gave the page back)
    would reach the next owner, where the gather path zeroes masked values. Confirmed in interpret
    mode (the next owner's logits were NaN). Now a key or value that overflows is written as 0: the
    cache holds only finite numbers, the overflow shows in its own sequence's logits, and the next
    owner of its page decodes as if alone, in both paths."""
    params, cfg = nan_token_model()
    kw = dict(slots=1, n_pages=3, page_size=16, max_len=32, runner=RunnerConfig(attention=attention), keep_logits=True)
    batch = Batch(params, cfg, **kw)
    a = batch.add([1, 2, 3, 4, 5], 3)                  # the decode step pushes token 5: it overflows
    while batch.running():
        batch.step()
    assert np.isnan(batch.seqs[a].logits[0]).all()
    batch.finish(a)
    b = batch.add([10, 11], 6)                         # takes a's page: positions 2 to 7 were a's
    while batch.running():
        batch.step()
    alone = Batch(params, cfg, **kw)
    c = alone.add([10, 11], 6)
    while alone.running():
        alone.step()
    got, want = np.stack(batch.seqs[b].logits), np.stack(alone.seqs[c].logits)
    assert 5 not in batch.seqs[b].tokens and np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert all(bool(jnp.isfinite(batch.runner.kv[n]).all()) for n in ("k", "v"))


@pytest.mark.parametrize("per_layer, attention", [(True, "gather"),
                                                   pytest.param(False, "gather", marks=pytest.mark.slow),
                                                   pytest.param(True, "pallas", marks=pytest.mark.slow)])
def test_a_prefill_beside_a_decode_step_equals_the_two_calls(per_layer, attention):
    """decode_prefill_step pushes a decode step's rows and a prefill's rows through the model in one
    call (extend_groups): the same logits, sampled tokens and cache as prefill_step then decode_step,
    with a paused slot, a padding row of the prefill, and the rows on pages of their own. With
    attention="pallas" the decode rows read their pages with the Pallas kernel, the prefill's rows
    with the gather path, in the same call. Packed (extend_groups' packed: the products take the
    15 real tokens of the 27 positions, in 15 or 20), the same again."""
    pallas = attention == "pallas"
    params, cfg = tiny(seed=4, d_model=64 if pallas else 32)    # Pallas: head_dim 16, pages of 16
    if per_layer:
        params = runner.unstack_layers(params)
    Z, W = (16, 2) if pallas else (4, 5)
    rng = np.random.RandomState(3)
    cache = init_cache(cfg, 1 + 6 * W, Z)
    table_6xW = np.arange(1, 1 + 6 * W, dtype=np.int32).reshape(6, W)      # slots 0-2, prefill rows 3-5
    lengths_6 = np.array([9, 4, 13, 7, 0, 11], np.int32)                    # what each row holds already
    prompt_6xT = rng.randint(0, cfg.vocab_size, (6, 16)).astype(np.int32)
    _, cache = extend(params, cfg, cache, prompt_6xT, np.zeros(6, np.int32), lengths_6, table_6xW)
    slots = decode.Slots(rng.randint(0, cfg.vocab_size, 3).astype(np.int32), lengths_6[:3],
                         np.array([True, False, True]), np.arange(3, dtype=np.int32), table_6xW[:3])
    chunk_3xT = rng.randint(0, cfg.vocab_size, (3, 8)).astype(np.int32)
    prefill = (chunk_3xT, lengths_6[3:], np.array([5, 8, 0], np.int32), table_6xW[3:])   # row 5: padding

    copy = functools.partial(jax.tree.map, jnp.copy)
    step = jax.jit(decode.decode_prefill_step.__wrapped__,                     # a compile of its own
                   static_argnames=("cfg", "temperature", "top_k", "attention", "packed"))
    want_RxV, two = decode.prefill_step(params, cfg, copy(cache), *prefill)
    want_later, want_BxV, two = decode.decode_step(params, cfg, two, slots, attention=attention)
    for packed in (None, 15, 20) if not pallas else (None,):
        later, logits_BxV, logits_RxV, one = step(params, cfg, copy(cache), slots, *prefill,
                                                  attention=attention, packed=packed)
        rows = slice(None) if packed is None else np.array([0, 2])   # packed: none for the paused slot
        np.testing.assert_allclose(logits_BxV[rows], want_BxV[rows], atol=1e-5, rtol=0)
        np.testing.assert_allclose(logits_RxV[:2], want_RxV[:2], atol=1e-5, rtol=0)
        np.testing.assert_array_equal(later.tokens_B[rows], want_later.tokens_B[rows])
        np.testing.assert_array_equal(later.lengths_B, [10, 4, 14])
        for name in ("k", "v"):                       # every page but the null page, which padding writes
            np.testing.assert_allclose(one[name][:, :, 1:], two[name][:, :, 1:], atol=1e-5, rtol=0)
            assert not np.array_equal(one[name][:, :, 1:], cache[name][:, :, 1:])   # and they did write
    if pallas:                  # and the kernel's rows are the gather path's (to the kernel's tolerance)
        _, gather_BxV, _ = decode.decode_step(params, cfg, decode.prefill_step(params, cfg, copy(cache),
                                                                               *prefill)[1], slots)
        np.testing.assert_allclose(logits_BxV, gather_BxV, atol=2e-5, rtol=0)
