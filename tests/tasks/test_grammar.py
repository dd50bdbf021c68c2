"""Constrained decoding (minagent/constrain.py): whatever the logits, an answer sampled under the mask is a
call that shop.validate accepts; and the mask forbids no gold answer.

    python -m pytest tests/tasks/test_grammar.py -q

The tokenizer is trained in-process on a few gold calls and some prose (hermetic, no GGUF file);
the models are tiny with random weights.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minagent import chat, decode, model
from minagent.tasks.shop import data as shop_data
from minagent.tasks.shop import gate as shop
from minagent.tasks.shop import grammar as constrain
from minagent import tokenizer as tk
from minagent.batch import Batch
from minagent.runner import RunnerConfig
from minagent.cache import init_cache

PROSE = ("Where is my order? The shop is open on Monday. Please refund the amount, thanks! "
         "Can you book a repair for my bike on Friday? I am not sure what I need. ") * 20
GOLD = [shop_data.gold_json(r) for r in shop_data.train_set(50)]
TOK = tk.train(PROSE + "\n".join(GOLD), vocab_size=400)
END = TOK.special("<|end|>")
C = constrain.Constraint(TOK, END)


def plain(requests):
    """The requests as prompts of plain text (this tokenizer has no ChatML markers)."""
    return [chat.Segment(chat.PROGRAM, r.text) for r in requests]


def all_requests():
    return shop_data.train_set(500) + shop_data.test_set(0) + shop_data.seen_test_set(200)


# ---------------------------------------------------------------- the automaton

def test_program_follows_gold_json():
    """The pieces come from shop.TOOLS and spell gold_json's formatting."""
    assert constrain.program("refund") == ('{"tool": "', constrain.NAME, '", "args": {"order_id": "',
                                           constrain.ORDER, '", "amount": ', constrain.AMOUNT, "}}")
    for tool, names in shop.TOOLS.items():
        values = [p for p in constrain.program(tool)[2:] if not isinstance(p, str)]
        assert len(values) == len(names)


def test_every_gold_answer_is_accepted():
    """The constraint does not forbid a correct answer: every gold call of every set, char by char and
    as the tokenizer splits it (the tokens the model is trained to write), ends in a done state."""
    for req in all_requests():
        gold = shop_data.gold_json(req)
        state = constrain.walk(gold)
        assert state is not None and constrain.done(state), gold
        ids = TOK.encode(gold)
        for k, t in enumerate(ids):
            assert C(ids[:k])[t], (gold, TOK.decode([t]))
        assert constrain.done(C.state(ids)) and C(ids)[END] and C(ids).sum() == 1


def test_a_day_is_one_of_the_days_validate_accepts():
    """Every day the grammar can write is a gate.DAY; a word that is not a day cannot be written."""
    assert len(constrain.DAYS) == 859 and all(shop.DAY.fullmatch(d) for d in constrain.DAYS)
    booking = '{"tool": "book_repair", "args": {"item": "bike", "day": "%s"}}'
    for day in ("Monday", "next Friday evening", "March 31", "the 22nd of June", "the 11th"):
        assert constrain.done(constrain.walk(booking % day)), day
    for day in ("blorp", "soon", "Monday Monday", "the 40th", "March 32", "the 22th", "monday"):
        state = constrain.walk(booking % day)
        assert state is None or not constrain.done(state), day


@pytest.mark.parametrize("text", [
    '{"tool":"refund", "args": {"order_id": "A1234", "amount": 240}}',      # other spacing: refused
    '{"tool": "refund", "args": {"amount": 240, "order_id": "A1234"}}',     # other key order: refused
    '{"tool": "refund", "args": {"order_id": "A123", "amount": 240}}',
    '{"tool": "refund", "args": {"order_id": "A1234", "amount": 0}}',
    '{"tool": "refund", "args": {"order_id": "A1234", "amount": 0.00}}',
    '{"tool": "refund", "args": {"order_id": "A1234", "amount": 012}}',
    '{"tool": "refund", "args": {"order_id": "A1234", "amount": 10001}}',
    '{"tool": "refund", "args": {"order_id": "A1234", "amount": 240.}}',
    '{"tool": "ask_human", "args": {"reason": " "}}',
    '{"tool": "ask_human", "args": {"reason": ""}}',
    '{"tool": "delete_account", "args": {}}',
    '{"tool": "ask_human", "args": {"reason": "x"}} ',
])
def test_refuses(text):
    """Off the grammar, or not a whole call."""
    state = constrain.walk(text)
    assert state is None or not constrain.done(state)


def test_no_dead_ends_and_few_states():
    """From every reachable state a call can still be finished, so a masked row always has a way out.
    (Most states are inside a day: the prefixes of its 859 spellings.)"""
    states, next_SxC = constrain.tabulate()
    S = len(states)
    assert S < 5000
    can_finish = {s for s in range(S) if constrain.done(states[s])}
    while True:
        more = {s for s in range(S) if s not in can_finish and any(t in can_finish for t in next_SxC[s])}
        if not more:
            break
        can_finish |= more
    assert len(can_finish) == S


@pytest.mark.slow
def test_mask_equals_slow_reference():
    """The vectorised table walk == walking `step` over each token's chars, in every state."""
    specials = set(TOK.specials.values())
    for state in C.states:
        mask_V = C.allowed(state)
        for t in range(TOK.n_vocab):
            if t == END:
                want = constrain.done(state)
            elif t in specials:
                want = False
            else:
                try:
                    text = TOK.piece(t).decode("ascii")
                except UnicodeDecodeError:
                    text = None
                want = bool(text) and text.isprintable() and constrain.walk(text, state) is not None
            assert mask_V[t] == want, (state, TOK.piece(t))


# ---------------------------------------------------------------- sampling under the mask

@functools.cache
def masked_sampler(temperature):
    """The decode step's own masking and sampling, jitted (one compile per temperature)."""
    return jax.jit(lambda logits_BxV, allowed_BxV, seed_B, pos_B: decode.sample(
        decode.mask_logits(logits_BxV, allowed_BxV), seed_B, pos_B, temperature))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), temperature=st.sampled_from([0.0, 0.3, 1.0, 3.0]),
       scale=st.sampled_from([1.0, 5.0]), end_bias=st.sampled_from([0.0, 20.0]))
def test_any_logits_give_a_valid_call(seed, temperature, scale, end_bias):
    """Random logits (even ones that push hard for the end token): the sampled answer validates,
    the end token comes only once the call is done, and the answer fits in max_chars() + 1 tokens."""
    rng = np.random.RandomState(seed % 2**32)
    sample = masked_sampler(temperature)
    ids = []
    while True:
        allowed_V = C(ids)                              # the mask the Batch asks for before each token
        assert allowed_V[END] == constrain.done(C.state(ids))
        logits_V = scale * rng.randn(TOK.n_vocab).astype(np.float32)
        logits_V[END] += end_bias
        t = int(sample(logits_V[None], allowed_V[None], jnp.array([seed % 2**31]), jnp.array([len(ids)]))[0])
        assert allowed_V[t]
        ids.append(t)
        if t == END:
            break
    assert len(ids) <= constrain.max_chars() + 1
    verdict = shop.validate(TOK.decode(ids[:-1]))
    assert verdict.ok, (TOK.decode(ids[:-1]), verdict)


def test_a_row_that_allows_nothing_samples_anything():
    logits_BxV = jnp.asarray(np.random.RandomState(0).randn(2, 7), jnp.float32)
    allowed_BxV = np.zeros((2, 7), bool)
    allowed_BxV[0, 3] = True
    masked_BxV = decode.mask_logits(logits_BxV, allowed_BxV)
    assert np.isneginf(masked_BxV[0]).sum() == 6 and np.isfinite(masked_BxV[1]).all()
    for temperature in (0.0, 1.0):
        next_B = decode.sample(masked_BxV, jnp.arange(2), jnp.zeros(2, jnp.int32), temperature)
        assert next_B[0] == 3 and 0 <= next_B[1] < 7


# ---------------------------------------------------------------- decode_step and the Batch

def tiny_model(vocab):
    cfg = model.Config(vocab_size=vocab, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)
    params = model.init(jax.random.PRNGKey(0), cfg)
    return jax.tree.map(lambda w: 4.0 * w if w.ndim > 1 else w, params), cfg


PARAMS, CFG = tiny_model(TOK.n_vocab)


@pytest.mark.parametrize("temperature", [0.0, pytest.param(1.0, marks=pytest.mark.slow)])
def test_decode_step_with_everything_allowed_equals_unmasked(temperature):
    """allowed_BxV all True changes nothing: the same tokens and logits as allowed_BxV=None."""
    B, W, Z = 2, 2, 8
    table_BxW = np.arange(1, 1 + B * W, dtype=np.int32).reshape(B, W)
    caches = [init_cache(CFG, 1 + B * W, Z) for _ in range(2)]
    slots = decode.Slots(np.array([5, 9], np.int32), np.zeros(B, np.int32), np.ones(B, bool),
                         np.array([1, 2], np.int32), table_BxW)
    for _ in range(6):
        outs = []
        for k, allowed in enumerate([None, np.ones((B, CFG.vocab_size), bool)]):
            later, logits_BxV, caches[k] = decode.decode_step(PARAMS, CFG, caches[k], slots,
                                                              temperature=temperature, allowed_BxV=allowed)
            outs.append((later, np.asarray(logits_BxV)))
        np.testing.assert_array_equal(outs[0][0].tokens_B, outs[1][0].tokens_B)
        np.testing.assert_array_equal(outs[0][1], outs[1][1])
        slots = outs[0][0]


def run(batch):
    while batch.running():
        batch.step()


@pytest.mark.parametrize("temperature", [pytest.param(0.0, marks=pytest.mark.slow), pytest.param(1.0, marks=pytest.mark.slow)])
def test_batch_constrained_rows_validate_and_free_rows_unchanged(temperature):
    """Three constrained sequences and one free one decode together. The constrained answers all
    validate; the free one writes exactly what it writes in a batch without any constraint."""
    prompts = [TOK.encode(r.text) for r in shop_data.test_set(0)[:4]]
    limit = constrain.max_chars() + 1
    kw = dict(slots=4, n_pages=4 * 5 + 1, page_size=64, max_len=320, stop_tokens=[END], temperature=temperature)
    batch = Batch(PARAMS, CFG, **kw)
    ids = [batch.add(p, limit, mask=C if i < 3 else None) for i, p in enumerate(prompts)]
    run(batch)
    for i, p in zip(ids[:3], prompts):
        answer = batch.seqs[i].tokens[len(p):]
        assert batch.seqs[i].status == "stopped" and answer[-1] == END and END not in answer[:-1]
        assert shop.validate(TOK.decode(answer[:-1])).ok, TOK.decode(answer)
    free = Batch(PARAMS, CFG, **kw)
    j = free.add(prompts[3], limit, seed=batch.seqs[ids[3]].seed)
    run(free)
    assert free.seqs[j].tokens == batch.seqs[ids[3]].tokens
    assert not shop.validate(TOK.decode(free.seqs[j].tokens[len(prompts[3]):])).ok      # free decoding is junk


@pytest.mark.slow
def test_answers_helper():
    reqs = shop_data.test_set(0)[:3]
    texts, stopped = constrain.answers(PARAMS, CFG, TOK, plain(reqs), END, C, temperature=1.0)
    assert all(shop.validate(t).ok for t in texts) and all(stopped), texts
    more = shop_data.test_set(0)[:6]          # more prompts than slots: finished ones give theirs back
    texts, stopped = constrain.answers(PARAMS, CFG, TOK, plain(more), END, C, slots=2)
    assert len(texts) == 6 and all(shop.validate(t).ok for t in texts) and all(stopped), texts
    _, stopped = constrain.answers(PARAMS, CFG, TOK, plain(more[:2]), END, limit=3)
    with pytest.raises(ValueError, match="end token"):      # answers could never stop
        constrain.answers(PARAMS, CFG, TOK, plain(reqs), END + 1, C)
    assert stopped == [False, False]          # free answers cut at 3 tokens: the untrained model writes on


def test_answers_refuses_a_mask_of_the_wrong_size():
    with pytest.raises(ValueError, match="constraint masks"):
        constrain.answers(PARAMS, CFG, TOK, plain(shop_data.test_set(0)[:1]), END,
                          constrain.Constraint(TOK, END, n_vocab=TOK.n_vocab + 8))


@pytest.mark.slow
def test_resumed_constrained_sequence_writes_a_second_valid_answer():
    """Each stretch is a new answer: after send() the mask sees only the tokens sampled since, so the
    second stretch is a whole new valid call, not only the end token a finished answer allows."""
    prompt = TOK.encode(shop_data.test_set(0)[0].text)
    limit = constrain.max_chars() + 1
    batch = Batch(PARAMS, CFG, slots=1, n_pages=12, page_size=64, max_len=640, stop_tokens=[END], temperature=1.0)
    i = batch.add(prompt, limit, mask=C)
    run(batch)
    first = batch.seqs[i].tokens[len(prompt):]
    again = TOK.encode(" and once more:")
    batch.send(i, batch.seqs[i].tokens + again, limit)
    run(batch)
    second = batch.seqs[i].tokens[len(prompt) + len(first) + len(again):]
    for answer in (first, second):
        assert answer[-1] == END and len(answer) > 1
        assert shop.validate(TOK.decode(answer[:-1])).ok, TOK.decode(answer)


@pytest.mark.slow
def test_constrained_warmup_leaves_nothing_to_compile():
    """warmup(masked=True) compiles the masked decode step too: a mix of constrained and free
    sequences then compiles nothing."""
    prompts = [TOK.encode(r.text) for r in shop_data.test_set(0)[:6]]
    limit = constrain.max_chars() + 1
    batch = Batch(PARAMS, CFG, slots=3, n_pages=3 * 5 + 1, page_size=64, max_len=320, stop_tokens=[END],
                  runner=RunnerConfig(buckets=(64, 320)))
    batch.warmup(masked=True)
    warm = batch.compiles
    ids = [batch.add(p, limit, mask=C if i % 2 else None) for i, p in enumerate(prompts)]
    while batch.running():
        batch.step()
        for i in ids:
            if batch.seqs[i].status in ("stopped", "length"):
                batch.finish(i)
    assert batch.compiles == warm, f"{batch.compiles - warm} compiles after warm-up"
    assert all(shop.validate(TOK.decode(batch.seqs[i].tokens[len(p):-1])).ok for i, p in zip(ids[1::2], prompts[1::2]))
