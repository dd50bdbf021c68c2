"""The masked-loss trainer: exact loss masks, packing, overfitting, checkpoints, schedule.

Run: python -m pytest tests/engine/test_train.py -q

Examples are built directly as (tokens, authors) arrays: no tokenizer needed.
authors: 0 = written by the program (prompt, tool result), 1 = by the model.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minagent import model
from minagent import train as tr

TINY = model.Config(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128)
PROGRAM, MODEL = 0, 1


def trace(rng, n, block=5):
    """n random tokens in alternating blocks: program (a prompt, a tool result), model, program, ..."""
    tokens = rng.integers(0, TINY.vocab_size, n).astype(np.int32)
    authors = ((np.arange(n) // block) % 2).astype(np.uint8)   # starts with the program
    return tokens, authors


@pytest.fixture(scope="module")
def params():
    return model.init(jax.random.PRNGKey(0), TINY)


def as_jnp(batch):
    return {k: jnp.asarray(v) for k, v in batch.items()}


# (loss, n), grads = LOSS_AND_GRAD(params, cfg, batch); one compilation shared by the tests below
LOSS_AND_GRAD = jax.jit(jax.value_and_grad(tr.loss_fn, has_aux=True), static_argnums=1)


def assert_same_gradient(g_a, g_b):
    """Bit for bit on CPU. On a GPU, XLA adds a scatter (the embedding table's gradient, where a
    token occurs more than once) with atomic adds, in whatever order the threads arrive, so two
    runs of the same program differ in the last bits (on an H200: 1.5e-8, one or two float32 ulps):
    there, equal to float32 rounding. (XLA's --xla_gpu_deterministic_ops would make them exact, but
    it also changes the decode step's buffers: test_decode's check that no step copies the cache
    then sees a 32 MiB temporary; the tests run the kernels users run.)"""
    for a, b in zip(jax.tree.leaves(g_a), jax.tree.leaves(g_b)):
        if jax.default_backend() == "cpu":
            np.testing.assert_array_equal(a, b)
        else:
            a, b = np.asarray(a), np.asarray(b)
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * float(np.abs(a).max()))


# ---------------------------------------------------------------- 1. the mask is exact

def test_mask_from_authors_known_answer():
    # <|call|> add 4 8 <|result|> 12 <|assistant|> 12 <|end|>: the tool's "12" and the
    # <|assistant|> the program writes after it are read, never learned.
    authors = np.array([1, 1, 1, 1, 1, 0, 0, 1, 1], np.uint8)
    data = tr.pack([(np.arange(9, dtype=np.int32), authors)], seq_len=12)
    np.testing.assert_array_equal(data["mask"][0], [1, 1, 1, 1, 0, 0, 1, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(data["targets"][0, :8], np.arange(1, 9))


def test_gradient_is_exactly_zero_on_program_tokens(params):
    rng = np.random.default_rng(0)
    batch = as_jnp(tr.pack([trace(rng, n) for n in (30, 17, 40, 9)], seq_len=64))
    logits = model.forward(params, TINY, batch["tokens"], batch["positions"], batch["segments"])

    def loss_of_logits(logits_BxTxV):
        return tr.masked_mean(tr.token_nll(logits_BxTxV, batch["targets"]), batch["mask"])[0]

    g_BxTxV = np.asarray(jax.grad(loss_of_logits)(logits))
    unsupervised = np.asarray(batch["mask"]) == 0
    assert np.all(g_BxTxV[unsupervised] == 0.0)                    # exactly, not approximately
    assert np.all(np.abs(g_BxTxV[~unsupervised]).max(axis=-1) > 0)


def test_program_targets_do_not_change_loss_or_gradient(params):
    rng = np.random.default_rng(1)
    batch = tr.pack([trace(rng, n) for n in (30, 17, 40, 9)], seq_len=64)
    other = dict(batch)   # new targets wherever the program wrote the token
    other["targets"] = np.where(batch["mask"] == 0, rng.integers(0, TINY.vocab_size, batch["targets"].shape),
                                batch["targets"]).astype(np.int32)
    assert (other["targets"] != batch["targets"]).any()
    (loss_a, _), g_a = LOSS_AND_GRAD(params, TINY, as_jnp(batch))
    (loss_b, _), g_b = LOSS_AND_GRAD(params, TINY, as_jnp(other))
    assert float(loss_a) == float(loss_b)
    assert_same_gradient(g_a, g_b)


def test_trailing_tool_result_does_not_change_loss_or_gradient(params):
    # A trace that ends with a tool result the model has not answered yet: the
    # result's tokens (inputs and targets) are in the trace but not in the loss.
    rng = np.random.default_rng(2)
    tokens, authors = trace(rng, 25)              # blocks of 5: tokens 20..24 are the program's
    changed = tokens.copy()
    changed[20:] = rng.integers(0, TINY.vocab_size, 5)
    neighbour = trace(rng, 40)                    # in a second row: the same [2, 64] shape as above
    (loss_a, _), g_a = LOSS_AND_GRAD(params, TINY, as_jnp(tr.pack([(tokens, authors), neighbour], 64)))
    (loss_b, _), g_b = LOSS_AND_GRAD(params, TINY, as_jnp(tr.pack([(changed, authors), neighbour], 64)))
    assert float(loss_a) == float(loss_b)
    assert_same_gradient(g_a, g_b)


# ---------------------------------------------------------------- 2. normalisation

def test_loss_is_mean_nll_over_supervised_tokens(params):
    rng = np.random.default_rng(3)
    examples = [trace(rng, n, block=b) for n, b in ((30, 3), (17, 7), (40, 4))]
    batch = tr.pack(examples, seq_len=64)
    loss, n = tr.loss_fn(params, TINY, as_jnp(batch))

    logits = np.asarray(model.forward(params, TINY, batch["tokens"], batch["positions"], batch["segments"]),
                        np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
    expected_n = sum(int((a[1:] == MODEL).sum()) for _, a in examples)
    assert int(n) == expected_n
    np.testing.assert_allclose(float(loss), nll[batch["mask"] == 1].mean(), rtol=1e-5)


# ---------------------------------------------------------------- 3. packing

def test_packing_keeps_traces_whole_first_fit():
    rng = np.random.default_rng(4)
    lengths = [6, 5, 4, 3]
    data = tr.pack([trace(rng, n) for n in lengths], seq_len=10)
    # first fit: 6 opens row 0, 5 opens row 1, 4 fits in row 0, 3 in row 1
    np.testing.assert_array_equal(data["segments"], [[1] * 6 + [2] * 4, [1] * 5 + [2] * 3 + [0] * 2])

    examples = [trace(rng, int(n)) for n in rng.integers(1, 50, 40)]
    data = tr.pack(examples, seq_len=64)
    found = []
    for r in range(len(data["tokens"])):
        seg = data["segments"][r]
        for s in range(1, seg.max() + 1):
            (where,) = np.nonzero(seg == s)
            assert (np.diff(where) == 1).all()                             # contiguous
            np.testing.assert_array_equal(data["positions"][r, where], np.arange(len(where)))
            found.append(tuple(data["tokens"][r, where]))
        assert (seg[seg.argmin():] == 0).all() if (seg == 0).any() else True  # padding only at the end
    assert sorted(found) == sorted(tuple(t) for t, _ in examples)          # every trace once, whole


def test_trace_longer_than_seq_len_raises():
    rng = np.random.default_rng(5)
    with pytest.raises(ValueError, match="trace 1 has 65 tokens, more than seq_len=64"):
        tr.pack([trace(rng, 10), trace(rng, 65)], seq_len=64)
    with pytest.raises(ValueError, match="trace 0 has 10 tokens but 9 authors"):
        tr.pack([(np.zeros(10, np.int32), np.zeros(9, np.uint8))], seq_len=64)


def test_packed_trace_gets_the_loss_it_gets_alone(params):
    rng = np.random.default_rng(6)
    a, b, c = trace(rng, 20), trace(rng, 25), trace(rng, 15)
    alone, packed = tr.pack([a], 64), tr.pack([b, a, c], 64)   # a sits at 25..44, between b and c
    assert packed["segments"][0, 25] == 2 and len(packed["tokens"]) == 1
    nll = jax.jit(lambda p, d: tr.token_nll(model.forward(p, TINY, d["tokens"], d["positions"], d["segments"]),
                                            d["targets"]))
    np.testing.assert_allclose(np.asarray(nll(params, as_jnp(packed)))[0, 25:45],
                               np.asarray(nll(params, as_jnp(alone)))[0, :20], atol=1e-5)


@pytest.mark.slow                   # a few seconds of compiling: the default suite stays under 2 minutes
def test_a_shared_prefix_packs_once_a_row_and_changes_no_loss_or_gradient(params):
    """Traces that start with the same prompt: packed with prefix=, each row holds it once and more
    traces fit, yet every supervised token gets the same loss, and the gradient is the same sum."""
    rng = np.random.default_rng(8)
    prefix = rng.integers(0, TINY.vocab_size, 24).astype(np.int32)
    examples = [(np.r_[prefix, t], np.r_[np.zeros(24, np.uint8), a])
                for t, a in (trace(rng, n) for n in (9, 14, 6, 5, 4))]
    plain, shared = tr.pack(examples, 64), tr.pack(examples, 64, prefix=list(prefix))
    assert (len(plain["tokens"]), len(shared["tokens"])) == (3, 1)
    np.testing.assert_array_equal(shared["segments"][0, :24], -1)
    (loss_a, n_a), g_a = LOSS_AND_GRAD(params, TINY, as_jnp(plain))
    (loss_b, n_b), g_b = LOSS_AND_GRAD(params, TINY, as_jnp(shared))
    assert int(n_a) == int(n_b) > 0
    np.testing.assert_allclose(float(loss_a), float(loss_b), rtol=1e-5)
    for x, y in zip(jax.tree.leaves(g_a), jax.tree.leaves(g_b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=2e-5)
    with pytest.raises(ValueError, match="does not start with the prefix"):
        tr.pack(examples + [trace(rng, 30)], 64, prefix=list(prefix))


# ---------------------------------------------------------------- 4. it learns

@pytest.mark.slow
def test_tiny_model_overfits_one_trace(params):
    example = trace(np.random.default_rng(7), 48)
    tcfg = tr.TrainConfig(steps=150, batch_size=1, seq_len=48, lr=3e-3, warmup=10, log_every=50)
    assert tr.evaluate(params, TINY, [example], seq_len=48, batch_size=1)["loss"] > 3.0   # ln 64 = 4.16
    trained, _ = tr.train(params, TINY, [example], tcfg, progress=False)
    assert tr.evaluate(trained, TINY, [example], seq_len=48, batch_size=1)["loss"] < 0.05
    assert jax.tree.leaves(params)[0].shape   # the caller's params are still alive (not donated)


@pytest.mark.slow                   # a few seconds of compiling: the default suite stays under 2 minutes
def test_evaluate_counts_the_supervised_tokens():
    rng = np.random.default_rng(8)
    examples = [trace(rng, 20), trace(rng, 30)]
    p = model.init(jax.random.PRNGKey(1), TINY)
    ev = tr.evaluate(p, TINY, examples, seq_len=32, batch_size=4)
    assert ev["n_tokens"] == sum(int(a[1:].sum()) for _, a in examples)
    t, a = examples[0]                                 # a trace alone, unpacked
    nll, _ = tr.masked_mean(tr.token_nll(model.forward(p, TINY, t[None, :-1]), t[None, 1:]), a[None, 1:])
    np.testing.assert_allclose(tr.evaluate(p, TINY, examples[:1], seq_len=32, batch_size=4)["loss"], nll, rtol=1e-5)


# ---------------------------------------------------------------- 5. checkpoints

def test_resume_from_checkpoint_matches_an_unbroken_run(params, tmp_path):
    rng = np.random.default_rng(9)
    examples = [trace(rng, int(n)) for n in rng.integers(5, 30, 12)]
    tcfg = tr.TrainConfig(steps=8, batch_size=2, seq_len=32, warmup=2, log_every=1)
    straight, hist = tr.train(params, TINY, examples, tcfg, progress=False)

    path = tmp_path / "ck.npz"
    _, first = tr.train(params, TINY, examples, tcfg, progress=False, checkpoint_path=path, stop_at=5)
    ck = tr.load_checkpoint(path)
    assert ck["step"] == 5 and ck["cfg"] == TINY and ck["tcfg"] == tcfg
    resumed, second = tr.train(ck["params"], ck["cfg"], examples, ck["tcfg"], progress=False,
                               opt_state=ck["opt_state"], start_step=ck["step"])
    np.testing.assert_allclose([h["loss"] for h in first + second], [h["loss"] for h in hist], rtol=0, atol=1e-6)
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(straight)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_checkpoint_round_trip_with_tokenizer_and_extra(params, tmp_path):
    from minagent import tokenizer as tk
    tok = tk.train("the quick brown fox jumps over the lazy dog 4821 + 3907 = 8728. " * 20, vocab_size=300)
    path = tmp_path / "ck.npz"
    opt_state = tr.make_optimizer(tr.TrainConfig()).init(params)
    tr.save_checkpoint(path, params, opt_state, TINY, tr.TrainConfig(), 7, tokenizer=tok, extra={"note": "hi"})
    ck = tr.load_checkpoint(path, params_like=params, opt_state_like=opt_state)
    assert ck["extra"] == {"note": "hi"} and ck["step"] == 7
    assert ck["tokenizer"].encode("the fox 4821") == tok.encode("the fox 4821")
    for a, b in zip(jax.tree.leaves((params, opt_state)), jax.tree.leaves((ck["params"], ck["opt_state"]))):
        np.testing.assert_array_equal(a, b)


def test_checkpoint_file_mode_follows_the_umask(params, tmp_path):
    old = os.umask(0o022)
    try:
        tr.save_checkpoint(tmp_path / "ck.npz", params, None, TINY, tr.TrainConfig(), 0)
    finally:
        os.umask(old)
    assert (tmp_path / "ck.npz").stat().st_mode & 0o777 == 0o644      # not mkstemp's private 0600


def test_bad_checkpoints_raise_clear_errors(params, tmp_path, monkeypatch):
    path = tmp_path / "ck.npz"
    tr.save_checkpoint(path, params, None, TINY, tr.TrainConfig(), 3)
    good = path.read_bytes()
    bad = tmp_path / "bad.npz"
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0xFF
    for content in (good[: len(good) // 2], os.urandom(2000), bytes(flipped)):
        bad.write_bytes(content)
        with pytest.raises(ValueError, match="truncated or corrupt"):
            tr.load_checkpoint(bad)

    def shapes(cfg):   # a params template without computing any params
        return jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), cfg))

    other = shapes(model.Config(**{**TINY.__dict__, "d_model": 32}))
    with pytest.raises(ValueError, match=r"leaf params/embed has shape \(64, 64\).*\(64, 32\) expected"):
        tr.load_checkpoint(path, params_like=other)
    untied = shapes(model.Config(**{**TINY.__dict__, "tie_embeddings": False}))
    with pytest.raises(ValueError, match=r"missing \['params/unembed'\]"):
        tr.load_checkpoint(path, params_like=untied)

    monkeypatch.setattr(tr, "FORMAT_VERSION", 99)
    tr.save_checkpoint(bad, params, None, TINY, tr.TrainConfig(), 3)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="format version 99"):
        tr.load_checkpoint(bad)


def test_checkpoint_write_is_atomic(params, tmp_path, monkeypatch):
    path = tmp_path / "ck.npz"
    tr.save_checkpoint(path, params, None, TINY, tr.TrainConfig(), 1)

    def dies_halfway(f, **arrays):
        f.write(b"PK\x03\x04 half a zip file")
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", dies_halfway)
    with pytest.raises(OSError, match="disk full"):
        tr.save_checkpoint(path, params, None, TINY, tr.TrainConfig(), 2)
    monkeypatch.undo()
    assert tr.load_checkpoint(path)["step"] == 1          # the old checkpoint, whole
    assert os.listdir(tmp_path) == ["ck.npz"]             # and no temporary file left behind


def test_a_killed_write_leaves_nothing_after_the_next_save(params, tmp_path):
    """SIGKILL gives no chance to clean up: what it leaves, the next save of that checkpoint removes."""
    path = tmp_path / "ck.npz"
    (tmp_path / "ck.npz.k1ll3d.tmp").write_bytes(b"PK\x03\x04 half")        # as a killed save leaves it
    (tmp_path / "other.npz.x.tmp").write_bytes(b"another checkpoint's")       # not ours: kept
    tr.save_checkpoint(path, params, None, TINY, tr.TrainConfig(), 3)
    assert sorted(os.listdir(tmp_path)) == ["ck.npz", "other.npz.x.tmp"]
    assert tr.load_checkpoint(path)["step"] == 3


# ---------------------------------------------------------------- 6. schedule and optimizer

def test_lr_schedule_warmup_then_cosine():
    lr_at = tr.lr_schedule(tr.TrainConfig(steps=110, warmup=10, lr=1.0, min_lr_ratio=0.1))
    expected = {0: 0.1, 4: 0.5, 9: 1.0, 10: 1.0, 60: 0.55, 110: 0.1, 200: 0.1}
    for step, lr in expected.items():
        np.testing.assert_allclose(float(lr_at(step)), lr, rtol=1e-6, err_msg=f"step {step}")


@pytest.mark.slow                   # a few seconds of compiling: the default suite stays under 2 minutes
def test_optimizer_uses_schedule_and_spares_norms():
    tcfg = tr.TrainConfig(steps=100, warmup=10, lr=0.5, weight_decay=0.1)
    p = {"w": jnp.full((2, 2), 2.0), "attn_norm": jnp.full((2, 2), 2.0)}
    opt = tr.make_optimizer(tcfg)
    # Zero gradient: Adam's part of the update is 0, only weight decay moves a weight, by -lr * wd * w.
    updates, _ = opt.update(jax.tree.map(jnp.zeros_like, p), opt.init(p), p)
    np.testing.assert_allclose(updates["w"], -0.05 * 0.1 * 2.0, rtol=1e-6)   # lr at step 0 = 0.5 / 10
    np.testing.assert_array_equal(updates["attn_norm"], 0.0)
