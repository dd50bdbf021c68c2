"""The Batch: pause and resume, page accounting, no recompilation, the cost of no cache (tiny models, CPU).

    python -m pytest tests/engine/test_batch.py -q

The design documents' test comes first: a sequence paused on a pause token and
resumed with appended tokens produces exactly what a sequence given the whole
text as its prompt produces, without taking one more cache page.
"""

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minagent import decode, model
from minagent.batch import Batch, Stuck
from minagent.runner import RunnerConfig
from minagent.cache import pages_for

V = 40


def tiny_model(scale=4.0, d_model=32):
    """Random weights, scaled up so that greedy decoding does not repeat one token forever."""
    cfg = model.Config(vocab_size=V, d_model=d_model, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)
    params = model.init(jax.random.PRNGKey(0), cfg)
    return jax.tree.map(lambda w: scale * w if w.ndim > 1 else w, params), cfg


PARAMS, CFG = tiny_model()


def run(batch):
    """Step until nothing advances on its own; -> {id: [tokens returned by step()]}."""
    out = {}
    while batch.running():
        for i, t in batch.step().items():
            out.setdefault(i, []).append(t)
    return out


@pytest.mark.parametrize("temperature", [0.0, pytest.param(1.0, marks=pytest.mark.slow)])
def test_paused_and_resumed_equals_prompted_whole(temperature):
    prompt, appended = [3, 14, 15, 9, 2, 6], [5, 35, 8, 9, 7]
    kw = dict(slots=3, n_pages=40, page_size=4, max_len=64, temperature=temperature, keep_logits=True)
    # Find a token this prompt samples after a few steps and make it the pause token.
    probe = Batch(PARAMS, CFG, **kw)
    first = run_ids(probe, probe.add(prompt, 12, seed=7))
    k = max(j for j in range(len(first)) if first[j] not in first[:j])
    assert k >= 2, f"degenerate probe {first}"
    pause = first[k]

    batch = Batch(PARAMS, CFG, pause_tokens=[pause], **kw)
    a = batch.add(prompt, 40, seed=7)            # a long first limit: its unused reservation must come back
    assert run(batch)[a] == first[:k + 1] and batch.seqs[a].status == "paused"
    assert len(batch.seqs[a].pages) == pages_for(len(prompt) + k, 4)       # the pause token's K/V is not cached
    batch.send(a, batch.seqs[a].tokens + appended, 9)
    b = batch.add(batch.seqs[a].tokens, 9, seed=7)    # the same text, whole, in another slot alongside
    assert len(batch.seqs[b].tokens) == len(batch.seqs[a].tokens)
    out = batch.step()
    assert len(batch.seqs[a].pages) == len(batch.seqs[b].pages)                # the same reservation for the stretch
    assert batch.pool.n_used == 2 * len(batch.seqs[b].pages)
    for i, tokens in run(batch).items():
        out[i] = [out[i]] + tokens
    assert out[a] == out[b] and batch.seqs[a].status == batch.seqs[b].status
    np.testing.assert_allclose(np.stack(batch.seqs[a].logits)[k + 1:], np.stack(batch.seqs[b].logits), atol=1e-5, rtol=0)
    assert batch.seqs[a].tokens == batch.seqs[b].tokens
    assert batch.seqs[a].pages != batch.seqs[b].pages and len(batch.seqs[a].pages) == len(batch.seqs[b].pages)
    assert batch.pool.n_used == 2 * len(batch.seqs[b].pages)
    # and only the new tokens went through the model: every token once, except the last one sampled
    assert batch.seqs[a].positions == len(batch.seqs[a].tokens) - 1 == batch.seqs[b].positions


@pytest.mark.parametrize("attention, per_layer", [("gather", True),
                                                   pytest.param("gather", False, marks=pytest.mark.slow),
                                                   pytest.param("pallas", True, marks=pytest.mark.slow)])
def test_batch_equals_forward(attention, per_layer):
    """Sequences of many lengths, chunked prefills, a queue, growing decode widths: logits == forward's
    (either attention in the decode step, Pallas in interpret mode off a GPU; weights per layer or stacked)."""
    params, cfg, page_size = PARAMS, CFG, 4
    if attention == "pallas":          # pages and heads of 16 or more (Triton's dot): a wider model, larger pages
        (params, cfg), page_size = tiny_model(d_model=64), 16
    runner = RunnerConfig(buckets=(4, 16), prefill_rows=(1, 2), attention=attention, per_layer=per_layer,
                          decode_rows=(2,))              # steps of 2 rows once some have finished
    batch = Batch(params, cfg, slots=3, n_pages=40, page_size=page_size, max_len=64, keep_logits=True, runner=runner)
    assert isinstance(batch.runner.params["layers"], list) == per_layer
    prompts = [[7], [5, 6, 7, 8, 9], list(range(1, 18)), [(3 * j) % V for j in range(40)]]
    ids = [batch.add(p, 12) for p in prompts]
    while batch.running():
        batch.step()
        for i in ids:
            if batch.seqs[i].status == "length":
                batch.finish(i)
    forward = jax.jit(model.forward, static_argnums=1)
    for i, p in zip(ids, prompts):
        tokens = batch.seqs[i].tokens
        ref_TxV = np.asarray(forward(params, cfg, np.array([tokens])))[0, len(p) - 1:-1]
        np.testing.assert_allclose(np.stack(batch.seqs[i].logits), ref_TxV, atol=1e-5, rtol=0)
        assert tokens[len(p):] == list(ref_TxV.argmax(-1))


def run_ids(batch, id):
    return run(batch)[id]


@pytest.mark.slow
def test_sampling_does_not_depend_on_slot_or_company():
    prompt = [1, 2, 3, 4, 5]
    alone = Batch(PARAMS, CFG, slots=4, page_size=4, max_len=48, temperature=1.0, top_k=10)
    want = run_ids(alone, alone.add(prompt, 20, seed=11))
    crowd = Batch(PARAMS, CFG, slots=4, page_size=4, max_len=48, temperature=1.0, top_k=10)
    for n in (7, 3, 12):                          # others first: ours lands in slot 3
        crowd.add(list(range(1, n + 1)), 15)
    i = crowd.add(prompt, 20, seed=11)
    assert run_ids(crowd, i) == want and crowd.seqs[i].slot == 3
    assert len(set(want)) > 3


@pytest.mark.slow
def test_a_mask_limits_one_sequence_and_sees_its_stretch():
    """A sequence added with a mask samples only what the mask allows; the mask is asked with the tokens
    sampled so far in the stretch (from [] again after send); an unmasked neighbour samples as if alone."""
    seen = []

    def even(sampled):
        seen.append(list(sampled))
        allowed_V = np.zeros(V, bool)
        allowed_V[::2] = True
        return allowed_V

    kw = dict(slots=2, page_size=4, max_len=40, temperature=1.0)
    batch = Batch(PARAMS, CFG, **kw)
    a, b = batch.add([1, 2, 3], 5, mask=even), batch.add([4, 5], 6, seed=9)
    run(batch)
    written = batch.seqs[a].tokens[3:]
    assert len(written) == 5 and all(t % 2 == 0 for t in written)
    assert seen == [written[:k] for k in range(5)]
    batch.send(a, batch.seqs[a].tokens + [7], 2)
    run(batch)
    assert seen[5:] == [[], batch.seqs[a].tokens[9:10]] and all(t % 2 == 0 for t in batch.seqs[a].tokens[9:])
    alone = Batch(PARAMS, CFG, **kw)
    assert run_ids(alone, alone.add([4, 5], 6, seed=9)) == batch.seqs[b].tokens[2:]


@pytest.mark.slow                   # a few seconds of compiling: the default suite stays under 2 minutes
def test_cache_false_rereads_everything():
    """A resume-heavy schedule: the same tokens with and without the cache, positions counted exactly."""
    counts, texts = {}, {}
    for use_cache in (True, False):
        batch = Batch(PARAMS, CFG, slots=2, page_size=4, max_len=64, reuse_cache=use_cache)
        ids = [batch.add([1, 2, 3], 2), batch.add([7, 8, 9, 10, 11], 3)]
        # Without a cache a stretch pushes the whole episode so far, then limit - 1 sampled tokens.
        rereads = {ids[0]: 3 + 2 - 1, ids[1]: 5 + 3 - 1}
        for round in range(5):
            run(batch)
            for i in ids:
                assert batch.seqs[i].status == "length"
                batch.send(i, batch.seqs[i].tokens + [round + 1, 4], 2)
                rereads[i] += len(batch.seqs[i].tokens) + 2 - 1
        run(batch)
        counts[use_cache] = {i: s.positions for i, s in batch.seqs.items()}
        texts[use_cache] = [batch.seqs[i].tokens for i in ids]
    assert counts[False] == rereads
    assert texts[True] == texts[False]
    assert counts[True] == {i: len(t) - 1 for i, t in zip(ids, texts[True])}
    assert sum(counts[False].values()) > 2.5 * sum(counts[True].values())


@pytest.mark.slow
def test_no_recompilation_after_warmup(monkeypatch):
    """200 sequences of prompt lengths 1..100 and varied limits, short prompts prefilled beside the decode
    step (up to 8 rows of them, beside_rows): nothing compiles after warmup()."""
    rng = np.random.RandomState(0)
    batch = Batch(PARAMS, CFG, slots=8, n_pages=8 * 32 + 1, page_size=4, max_len=128, stop_tokens=[0],
                  runner=RunnerConfig(prefill_rows=(2, 8), prefill_positions=128, buckets=(16, 64, 128),
                                      decode_rows=(2,), prefill_beside=16, beside_rows=8))
    batch.warmup()
    warm = batch.compiles
    beside, real = [], decode.decode_prefill_step
    monkeypatch.setattr(decode, "decode_prefill_step", lambda *a: beside.append(1) or real(*a))
    # a prefill per (rows 2, bucket, width) and (rows 8, bucket 16, width), a sample per prefill row count,
    # a decode per (rows 2 or 8, width 1, ..., 32), and one with a prefill of 2 or 8 rows beside it per
    # (rows, width)
    assert warm <= 3 * 6 + 6 + 2 + 2 * 6 + 2 * 2 * 6
    for _ in range(200):
        batch.add(list(rng.randint(1, V, rng.randint(1, 101))), int(rng.randint(1, 25)))
    steps = 0
    while batch.running():
        batch.step()
        steps += 1
        for i in batch.seqs:
            if batch.seqs[i].status in ("stopped", "length"):
                batch.finish(i)
    assert batch.compiles == warm, f"{batch.compiles - warm} recompilations after warm-up"
    assert batch.pool.n_free == 8 * 32 and steps > 100 and len(beside) > 10


@pytest.mark.slow
def test_short_chunks_are_padded_little(monkeypatch):
    """An agent's prefill chunks are short (a prompt, a tool's result and the turn marker): with the
    default buckets no chunk of up to 64 tokens is padded to more than twice its length, or 8.
    Every padding position costs as much as a real one (bench_agent: 13.0 s of prefill at
    (16, 64, ...), 8.1 s at (8, 16, 32, 64, ...), for the same 64 episodes; with each chunk's
    last token in it, 56 % of the positions prefilled held a token, 72 % with 12 and 24 added)."""
    padded = []                                    # (tokens in the chunk's longest row, bucket)
    real_step = decode.prefill_step

    def prefill_step(params, cfg, cache, tokens_BxT, start_B, n_new_B, table_BxW):
        padded.append((int(np.max(n_new_B)), tokens_BxT.shape[1]))
        return real_step(params, cfg, cache, tokens_BxT, start_B, n_new_B, table_BxW)
    monkeypatch.setattr(decode, "prefill_step", prefill_step)
    batch = Batch(PARAMS, CFG, slots=1, n_pages=1 + 20, page_size=4, max_len=80, stop_tokens=[0])
    for n in (2, 5, 9, 12, 17, 30, 33, 64):        # prompts: prefilled whole, then sampled from
        i = batch.add([1 + t % (V - 1) for t in range(n)], 1)
        run(batch)
        batch.finish(i)
    assert [longest for longest, _ in padded] == [2, 5, 9, 12, 17, 30, 33, 64]
    assert all(bucket <= max(8, 2 * longest) for longest, bucket in padded), padded


def test_a_prompt_and_a_result_cost_one_model_call_each(monkeypatch):
    """A sequence with several pending tokens samples its next one from the prefill's logits: a
    prompt costs one prefill call, not a prefill call and a decode call, and so does a resume.
    The tokens and logits are those of the full forward pass over the final text."""
    calls = []
    real = decode.prefill_step, decode.decode_step

    def count(kind, fn):
        def step(*args, **kw):
            calls.append(kind)
            return fn(*args, **kw)
        return step
    monkeypatch.setattr(decode, "prefill_step", count("prefill", real[0]))
    monkeypatch.setattr(decode, "decode_step", count("decode", real[1]))
    batch = Batch(PARAMS, CFG, slots=1, n_pages=1 + 10, page_size=4, max_len=40, keep_logits=True)
    prompt = [3, 14, 15, 9, 2, 6]
    i = batch.add(prompt, 4)
    sampled = run(batch)[i]
    assert calls == ["prefill", "decode", "decode", "decode"] and len(sampled) == 4
    seq = batch.seqs[i]
    assert seq.positions == len(seq.tokens) - 1              # every position pushed once
    batch.send(i, seq.tokens + [7, 8, 9], 2)                  # a resume: 1 pending + 3 appended
    del calls[:]
    run(batch)
    assert calls == ["prefill", "decode"] and seq.positions == len(seq.tokens) - 1

    # The reference: the whole text through model.forward at once; position t predicts t + 1.
    logits_TxV = model.forward(PARAMS, CFG, np.array([seq.tokens]))[0]
    want = [int(t) for t in np.argmax(np.asarray(logits_TxV), axis=-1)]
    n = len(prompt)
    assert sampled == want[n - 1:n + 3]
    np.testing.assert_allclose(seq.logits[0], logits_TxV[n - 1], rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(seq.logits[4], logits_TxV[n + 4 + 2], rtol=2e-4, atol=2e-4)


@pytest.mark.slow
def test_a_decode_step_computes_the_active_rows_only(monkeypatch):
    """A decode step runs the active slots padded to the smallest row count that holds them
    (RunnerConfig.decode_rows), not every slot: the same tokens and logits as steps over every
    slot, with pauses, finishes and resumes moving sequences in and out of the rows."""
    rows = []                                       # (rows computed, of which active) per decode step
    real = decode.decode_step

    def decode_step(params, cfg, cache, slots, *args):
        rows.append((len(slots.active_B), int(np.sum(slots.active_B))))
        return real(params, cfg, cache, slots, *args)
    monkeypatch.setattr(decode, "decode_step", decode_step)

    def play(decode_rows):
        batch = Batch(PARAMS, CFG, slots=6, n_pages=40, page_size=8, max_len=32, temperature=1.0,
                      pause_tokens=[5], keep_logits=True, runner=RunnerConfig(decode_rows=decode_rows))
        ids = [batch.add([1 + (3 * i + j) % (V - 1) for j in range(2 + i)], 3 + 2 * i, seed=i) for i in range(6)]
        for _ in range(2):                          # resume what paused or ran out, once
            run(batch)
            for i in ids:
                if batch.seqs[i].status in ("paused", "length") and len(batch.seqs[i].tokens) < 24:
                    batch.send(i, batch.seqs[i].tokens + [7, 8], 4)
        run(batch)
        return {i: (batch.seqs[i].tokens, np.stack(batch.seqs[i].logits)) for i in ids}

    every = play(decode_rows=())
    assert {r for r, _ in rows} == {6}
    del rows[:]
    packed = play(decode_rows=(2, 4))
    assert all(r == min(x for x in (2, 4, 6) if x >= active) for r, active in rows), rows
    assert {2, 4} <= {r for r, _ in rows}           # the schedule did shrink the rows
    for i in every:
        assert packed[i][0] == every[i][0]
        np.testing.assert_allclose(packed[i][1], every[i][1], atol=1e-5, rtol=0)


def play_with_resumes(runner, temperature=0.0):
    """Six sequences of different lengths on a batch with `runner` (a RunnerConfig), each
    resumed with 1 to 3 more tokens whenever it pauses on token 5 or runs out, three rounds, so
    that prefills and decode steps meet at different times -> (the batch, {id: (tokens, the
    logits of each token sampled)})."""
    batch = Batch(PARAMS, CFG, slots=6, n_pages=80, page_size=4, max_len=48, pause_tokens=[5],
                  temperature=temperature, keep_logits=True, runner=runner)
    ids = [batch.add([1 + (3 * i + j) % (V - 1) for j in range(2 + 5 * i)], 3 + 3 * i, seed=i)
           for i in range(6)]
    for _ in range(3):                          # resume what paused or ran out, at different times
        while batch.running():
            batch.step()
            for i in ids:
                if batch.seqs[i].status in ("paused", "length") and len(batch.seqs[i].tokens) < 36:
                    batch.send(i, batch.seqs[i].tokens + [7, 8, 9][:1 + i % 3], 4)
    return batch, {i: (batch.seqs[i].tokens, np.stack(batch.seqs[i].logits)) for i in ids}


@pytest.mark.slow            # the fast suite checks the step itself (test_decode.py)
def test_a_prefill_beside_the_decode_step_changes_no_token(monkeypatch):
    """A resume's few tokens go through the model in the decode step's call while other sequences
    decode (RunnerConfig.prefill_beside): the same tokens and logits as a prefill call
    of their own (prefill_beside=None), in fewer model calls; a prefill with nothing to decode
    beside it, or too long, still has its own call. With beside_rows, more rows wait for the step
    (fewer prefill calls of their own), the same tokens and logits again."""
    calls, beside_rows = [], []                       # beside_rows: each call of both, its prefill rows
    for name in ("prefill_step", "decode_step", "decode_prefill_step"):
        def step(*args, real=getattr(decode, name), name=name, **kw):
            calls.append(name)
            if name == "decode_prefill_step":
                beside_rows.append(args[4].shape[0])                # tokens_RxT
            return real(*args, **kw)
        monkeypatch.setattr(decode, name, step)

    _, alone = play_with_resumes(RunnerConfig(prefill_rows=(2, 4), prefill_beside=None))
    n_alone = len(calls)
    assert "decode_prefill_step" not in calls
    del calls[:]
    _, together = play_with_resumes(RunnerConfig(prefill_rows=(2, 4), prefill_beside=4))
    assert calls.count("decode_prefill_step") >= 3 and "prefill_step" in calls, calls
    assert len(calls) < n_alone
    prefills_together = calls.count("prefill_step")
    assert set(beside_rows) == {2}, beside_rows
    del calls[:], beside_rows[:]
    # beside_rows: up to 4 rows wait for the decode step, padded to 2 or 4
    _, more = play_with_resumes(RunnerConfig(prefill_rows=(2, 4), prefill_beside=4, beside_rows=4))
    assert 4 in beside_rows and calls.count("prefill_step") < prefills_together, (calls, beside_rows)
    for i in alone:
        for other in (together, more):
            assert other[i][0] == alone[i][0]
            np.testing.assert_allclose(other[i][1], alone[i][1], atol=1e-5, rtol=0)


@pytest.mark.slow
def test_prefill_calls_take_as_many_rows_as_wait(monkeypatch):
    """A prefill call runs at the largest row count the waiting chunks fill (RunnerConfig.prefill_rows)
    whose bucket it serves (rows x bucket <= prefill_positions), the rest at the smallest: fewer calls
    than one row at a time, and the same tokens and logits."""
    calls = []                                      # (rows computed, rows holding a chunk, bucket)
    real = decode.prefill_step

    def prefill_step(params, cfg, cache, tokens_BxT, start_B, n_new_B, table_BxW):
        calls.append((len(n_new_B), int(np.sum(np.asarray(n_new_B) > 0)), tokens_BxT.shape[1]))
        return real(params, cfg, cache, tokens_BxT, start_B, n_new_B, table_BxW)
    monkeypatch.setattr(decode, "prefill_step", prefill_step)

    def play(prefill_rows):
        batch = Batch(PARAMS, CFG, slots=8, n_pages=80, page_size=8, max_len=32, pause_tokens=[5],
                      keep_logits=True, runner=RunnerConfig(prefill_rows=prefill_rows, buckets=(4, 8, 16),
                                                            prefill_positions=16))
        ids = [batch.add([1 + (5 * i + j) % (V - 1) for j in range(2 + 3 * (i % 4))], 4, seed=i)
               for i in range(8)]
        run(batch)
        for i in ids:                               # every sequence resumes with a result of 3 tokens
            batch.send(i, batch.seqs[i].tokens + [7, 8, 9], 4)
        run(batch)
        return {i: (batch.seqs[i].tokens, np.stack(batch.seqs[i].logits)) for i in ids}

    alone = play(prefill_rows=(1,))
    n_alone = len(calls)
    assert {r for r, _, _ in calls} == {1}
    del calls[:]
    together = play(prefill_rows=(1, 2, 4))
    assert len(calls) < n_alone / 2, (len(calls), n_alone)
    assert all(r == 1 or r * bucket <= 16 for r, _, bucket in calls), calls      # only shapes it serves
    assert {(4, 4, 4), (2, 2, 8)} <= set(calls), calls                # the larger counts did run, full
    for i in alone:
        assert together[i][0] == alone[i][0]
        np.testing.assert_allclose(together[i][1], alone[i][1], atol=1e-5, rtol=0)


def test_prefill_size_fills_the_largest_row_count_it_can():
    runner = Batch(PARAMS, CFG, slots=64, n_pages=2, page_size=4, max_len=1024,
                   runner=RunnerConfig(prefill_rows=(4, 16, 64), prefill_positions=1024)).runner
    assert runner.prefill_size([[10] * 42]) == 16          # 42 results: 16, 16, then 4s
    assert runner.prefill_size([[10] * 64]) == 64          # 64 x bucket 12 = 768 positions
    assert runner.prefill_size([[30] * 64]) == 16          # 64 x 32 is over 1,024: 16
    assert runner.prefill_size([[10] * 3]) == 4            # fewer than 4: padded to 4
    assert runner.prefill_size([[10] * 15 + [300] * 9]) == 4   # the 16 shortest hold a 300-token chunk
    assert runner.prefill_size([[10] * 16 + [300] * 9]) == 16  # the 16 shortest are short
    assert runner.prefill_size([[], [10] * 20]) == 16      # a mesh: some device fills it


def test_a_prefill_goes_beside_the_decode_step_up_to_beside_rows():
    """What waits goes in the decode step's call when it fits: at most beside_rows rows (the smallest
    prefill row count by default), chunks of at most prefill_beside tokens."""
    def runner(**kw):
        return Batch(PARAMS, CFG, slots=64, n_pages=2, page_size=4, max_len=1024,
                     runner=RunnerConfig(prefill_rows=(2, 4, 8, 16), prefill_beside=12, **kw)).runner
    default = runner()
    assert default.beside_rows == [2] and default.fits_beside([10, 12])
    assert not default.fits_beside([10] * 3)
    more = runner(beside_rows=8)
    assert more.beside_rows == [2, 4, 8] and more.fits_beside([10] * 8)
    assert not more.fits_beside([10] * 9) and not more.fits_beside([10, 13])   # too many; too long
    assert runner(beside_rows=6).beside_rows == [2, 4]


def test_pages_hold_back_then_clear_error():
    batch = Batch(PARAMS, CFG, slots=2, n_pages=1 + 5, page_size=4, max_len=40)
    a = batch.add([1, 2, 3, 4], 13)                # 16 positions: 4 pages
    b = batch.add([5, 6, 7], 6)                    # 8 positions: 2 pages, only 1 left
    for _ in range(13):
        assert list(batch.step()) == [a]
        assert batch.seqs[b].status == "queued"         # held back, not corrupted
    assert batch.seqs[a].status == "length" and len(batch.seqs[a].tokens) == 4 + 13
    with pytest.raises(Stuck, match="wait for pages"):
        batch.step()                               # nothing runs, nothing will free pages by itself
    batch.finish(a)
    assert len(run(batch)[b]) == 6
    batch.finish(b)
    assert batch.pool.n_free == 5
    with pytest.raises(ValueError, match="longer than the cache"):
        batch.add(list(range(1, 30)), 20)          # 49 > max_len
    with pytest.raises(ValueError, match="longer than the cache"):
        batch.add(list(range(1, 30)), 5)           # needs 9 pages, the pool has 5
    with pytest.raises(ValueError, match="not integers in the vocabulary"):
        batch.add([V + 3], 2)


def test_slots_queue_and_finish():
    batch = Batch(PARAMS, CFG, slots=1, page_size=4, max_len=32)
    a, b = batch.add([1, 2], 3), batch.add([3, 4], 3)
    for _ in range(3):
        assert list(batch.step()) == [a]
    assert batch.seqs[a].status == "length" and batch.seqs[b].status == "queued"
    with pytest.raises(Stuck, match="wait for a slot"):
        batch.step()
    batch.finish(a)
    run(batch)
    assert batch.seqs[b].status == "length" and batch.seqs[a].tokens[:2] == [1, 2] and len(batch.seqs[a].tokens) == 5
    with pytest.raises(ValueError, match="only paused"):
        batch.send(a, batch.seqs[a].tokens + [1], 2)     # finished sequences do not come back


# ---------------------------------------------------------------- random schedules

SLOTS, S, MAX_LEN = 3, 4, 40
PAUSE, STOP = [3, 13, 23, 33], [4]                  # sampled at temperature 1, both come up often

add_op = st.tuples(st.just("add"), st.integers(1, 20), st.integers(1, 12))
step_op = st.tuples(st.just("step"), st.integers(1, 6))
op = st.one_of(
    add_op,
    step_op, step_op,
    st.tuples(st.just("resume"), st.integers(0, 50), st.integers(0, 8), st.integers(1, 10)),
    st.tuples(st.just("resume"), st.integers(0, 50), st.integers(0, 8), st.integers(1, 10)),
    st.tuples(st.just("rewrite"), st.integers(0, 50), st.integers(0, 40), st.integers(0, 8), st.integers(1, 10)),
    st.tuples(st.just("park"), st.integers(0, 50)),
    st.tuples(st.just("finish"), st.integers(0, 50)),
)


def check_invariants(batch):
    owners = {}
    for s in batch.seqs.values():
        for p in s.pages:
            assert p not in owners, f"page {p} owned twice"
            owners[p] = s.id
        assert len(s.tokens) <= MAX_LEN and s.limit >= 0
        if s.status != "finished":
            assert len(s.pages) >= pages_for(s.cached, S)           # every cached position has a page
        if s.slot is not None:
            row = batch.state.page_table_BxW[s.slot]
            assert list(row[:len(s.pages)]) == s.pages and not row[len(s.pages):].any()
    assert batch.pool.n_used == len(owners)


def play(schedule, use_cache):
    batch = Batch(PARAMS, CFG, slots=SLOTS, n_pages=1 + SLOTS * pages_for(MAX_LEN, S), page_size=S,
                  max_len=MAX_LEN, pause_tokens=PAUSE, stop_tokens=STOP, reuse_cache=use_cache, temperature=1.0,
                  runner=RunnerConfig(buckets=(4, 16), prefill_rows=(2,), decode_rows=(2,)))
    log, stretch = [], {}
    for o in schedule:
        ids = sorted(batch.seqs)
        if o[0] == "add":
            prompt = [(7 * o[1] + j) % (V - 5) + 5 for j in range(o[1])]
            stretch[batch.add(prompt, o[2])] = (0, o[2])
        elif o[0] == "step":
            for _ in range(o[1]):
                try:
                    out = batch.step()
                except Stuck:
                    break                           # stuck until the caller finishes something: step() says so
                log.append(out)
                for i in out:
                    done, limit = stretch[i]
                    stretch[i] = (done + 1, limit)
                    assert done + 1 <= limit
        elif o[0] == "resume":
            waiting = [i for i in ids if batch.seqs[i].status in ("paused", "stopped", "length")]
            i = waiting[o[1] % len(waiting)] if waiting else None
            if i is not None and len(batch.seqs[i].tokens) + o[2] + o[3] <= MAX_LEN:
                batch.send(i, batch.seqs[i].tokens + [5 + (i + j) % 30 for j in range(o[2])], o[3])
                stretch[i] = (0, o[3])
        elif o[0] == "rewrite":            # keep a prefix of the tokens, then new ones
            waiting = [i for i in ids if batch.seqs[i].status in ("paused", "stopped", "length")]
            i = waiting[o[1] % len(waiting)] if waiting else None
            if i is not None:
                old = batch.seqs[i].tokens
                new = old[:o[2]] + [5 + (i + j) % 30 for j in range(o[3])]
                if new and len(new) + o[4] <= MAX_LEN:
                    shared = next((j for j, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
                    cached = len(old) - len(batch.seqs[i].pending)
                    shared = min(shared, cached, len(new) - 1)
                    keep = shared if use_cache else 0              # positions kept; the pages, either way
                    assert batch.send(i, new, o[4]) == len(new) - keep
                    assert len(batch.seqs[i].pages) == pages_for(shared, S)
                    stretch[i] = (0, o[4])
        elif o[0] == "park":
            waiting = [i for i in ids if batch.seqs[i].status in ("paused", "stopped", "length")]
            if waiting:
                batch.park(waiting[o[1] % len(waiting)])
        elif o[0] == "finish" and ids:
            batch.finish(ids[o[1] % len(ids)])
        check_invariants(batch)
    for i in batch.seqs:
        batch.finish(i)
    assert batch.pool.n_free == batch.pool.n_pages - 1, "leaked pages"
    return log, [batch.seqs[i].tokens for i in sorted(batch.seqs)]


SCHEDULES = (st.lists(add_op, min_size=1, max_size=5), st.lists(op, min_size=10, max_size=40))


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(*SCHEDULES)
def test_random_schedules(adds, schedule):
    """Any schedule of add, step, send (a resume, or a rewritten start), park and finish: no exception, no leaked page, limits kept,
    and the same tokens with and without cache."""
    assert play(adds + schedule, True) == play(adds + schedule, False)


@pytest.mark.slow
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(*SCHEDULES)
def test_many_random_schedules(adds, schedule):
    """The same, on more schedules."""
    assert play(adds + schedule, True) == play(adds + schedule, False)


@pytest.mark.slow
def test_bfloat16_weights_with_either_cache():
    """bfloat16 weights (norms, softmax and logits in float32): with a bfloat16 cache the paged steps
    give bfloat16 forward's logits; with a float32 cache (the default off a GPU) they stay within
    bfloat16's error of float32 forward's (5 % of the logits' scale here)."""
    import dataclasses
    import jax.numpy as jnp
    cfg16 = dataclasses.replace(CFG, dtype="bfloat16")
    params16 = jax.tree.map(lambda w: w.astype(jnp.bfloat16), PARAMS)
    prompt = [(3 * j) % V for j in range(20)]
    for cache_dtype in ("bfloat16", "float32"):
        batch = Batch(params16, cfg16, slots=2, n_pages=20, page_size=4, max_len=64, keep_logits=True,
                      runner=RunnerConfig(cache_dtype=cache_dtype))
        i = batch.add(prompt, 12)
        while batch.running():
            batch.step()
        assert batch.runner.kv["k"].dtype == jnp.dtype(cache_dtype)
        tokens, got = [batch.seqs[i].tokens], np.stack(batch.seqs[i].logits)
        ref16 = np.asarray(model.forward(params16, cfg16, np.array(tokens)))[0, len(prompt) - 1:-1]
        ref32 = np.asarray(model.forward(PARAMS, CFG, np.array(tokens)))[0, len(prompt) - 1:-1]
        if cache_dtype == "bfloat16":
            np.testing.assert_allclose(got, ref16, atol=1e-5, rtol=0)
        assert np.abs(got - ref32).max() < 0.05 * np.abs(ref32).max()


def test_the_module_docstrings_example_runs():
    """batch.py's usage example, as written: step, and send the paused sequence its result (every
    token pauses here, so each step ends a stretch); the last send is followed by finish()."""
    from minagent.batch import Status
    ASSISTANT, result = 4, [5, 6]
    batch = Batch(PARAMS, CFG, slots=2, page_size=4, max_len=64, pause_tokens=range(V), stop_tokens=[])
    i = batch.add([1, 2], limit=40)
    sends = 0
    while batch.running():
        batch.step()
        if batch.seqs[i].status is Status.PAUSED:
            if sends == 3:
                batch.finish(i)
                break
            batch.send(i, batch.seqs[i].tokens + result + [ASSISTANT], limit=40)
            sends += 1
    assert sends == 3 and batch.seqs[i].status is Status.FINISHED and batch.pool.n_used == 0
    assert batch.seqs[i].tokens[:2] == [1, 2] and len(batch.seqs[i].tokens) == 2 + 3 * 4 + 1


@pytest.mark.slow            # the fast suite checks the step itself (test_decode.py)
def test_packed_calls_change_no_token(monkeypatch):
    """RunnerConfig(packed=True): each call's products take only its real tokens (a prefill's
    chunks without their padding, a decode step without its idle rows), rounded up to a packed
    count: the same tokens and logits as the calls over every position, with pauses, resumes and
    prefills beside the decode step; fewer positions through the products; warmup refuses."""
    took = []                               # (real tokens, positions packed, all positions) a call
    for name in ("prefill_step", "decode_step", "decode_prefill_step"):
        def step(*args, real=getattr(decode, name), name=name, **kw):
            if name == "prefill_step":
                n_real, M = int(np.sum(args[5])), args[3].size
            else:
                slots = args[3]
                n_real, M = int(np.sum(slots.active_B)), len(slots.active_B)
                if name == "decode_prefill_step":
                    n_real, M = n_real + int(np.sum(args[6])), M + args[4].size
            took.append((n_real, kw.get("packed", M), M))
            return real(*args, **kw)
        monkeypatch.setattr(decode, name, step)

    def play(packed):
        return play_with_resumes(RunnerConfig(prefill_rows=(2, 4), decode_rows=(4,),
                                              prefill_beside=4, packed=packed), temperature=1.0)

    _, every = play(packed=False)
    assert sum(J < M for _, J, M in took) == 0
    all_positions = sum(M for *_, M in took)
    del took[:]
    batch, packed = play(packed=True)
    assert all(n_real <= J <= M for n_real, J, M in took), took
    assert sum(J < M for _, J, M in took) >= 5, took             # packed: fewer positions
    assert sum(J for _, J, _ in took) < 0.8 * all_positions, (took, all_positions)
    for i in every:
        assert packed[i][0] == every[i][0]
        np.testing.assert_allclose(packed[i][1], every[i][1], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="packed"):
        batch.warmup()
