"""Train on rendered traces with a loss on the model's own tokens only.

A training example is a rendered trace `(tokens_T, authors_T)`: every token
carries who wrote it, the program (authors == 0, chat.PROGRAM) or the model
(authors == 1, chat.MODEL; any nonzero value counts as the model). The loss
covers only what the model wrote: the prediction at position t, whose target is
token t+1, is supervised iff authors[t+1] is the model. A tool result is in the
trace, the model reads it, but it never learns to predict it:

    tokens   <|call|> add 4 8 <|result|> 12 <|assistant|> 12 <|end|>
    authors     1      1  1 1     1       0       0        1    1
    target of position t = token t+1; supervised iff its author is 1:
    mask        1      1  1 1     0       0       1        1    -      (last token: no target)

The loss is the mean over supervised tokens (nats per token), so a trace with
a long tool result does not weigh less than one without.

Traces are packed whole into rows of `seq_len` tokens (`pack`); positions
restart at 0 for each trace and `segments` keeps a trace from attending to its
neighbours, so a trace packed with others gets the loss it gets alone.

Shape letters: the legend in model.py.
"""

import dataclasses
import functools
import glob
import itertools
import json
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from minagent import model, tokenfile
from minagent.mesh import automatic

FORMAT_VERSION = 1   # of the checkpoint file; bump it when the layout changes


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 300
    batch_size: int = 16        # rows per step
    seq_len: int = 128          # tokens per row
    lr: float = 3e-3            # peak learning rate, reached at the end of warm-up
    min_lr_ratio: float = 0.1   # cosine decays to lr * min_lr_ratio at the last step
    warmup: int = 20
    weight_decay: float = 0.1   # AdamW's, on every weight except the norms
    clip: float = 1.0           # global gradient norm
    seed: int = 0               # the order of the rows
    eval_every: int = 0         # 0: evaluate only after the last step (if eval_examples are given)
    log_every: int = 10


# ---------------------------------------------------------------- data

def pack(examples, seq_len, pad_id=0, prefix=()):
    """Pack (tokens_T, authors_T) traces into rows of seq_len tokens.

    First fit, in the given order: each trace goes whole into the first row with
    room for it, else into a new row; a trace is never split across rows (its
    later tokens would lose sight of the start). Returns a dict of [R, T] arrays:

        tokens     int32    the traces, then pad_id
        targets    int32    tokens shifted left by one, within each trace
        mask       float32  1.0 where the target was written by the model
        positions  int32    0, 1, 2, ... restarting for each trace
        segments   int32    1, 2, ... for the traces of a row, 0 for padding

    Example, seq_len 6, traces [a b c] and [d e] (authors all 1):
        tokens [a b c d e _]  targets [b c _ e _ _]  mask [1 1 0 1 0 0]
        positions [0 1 2 0 1 0]  segments [1 1 1 2 2 0]

    prefix: tokens every trace starts with (a system prompt), held once a row as segment -1,
    which the row's later positions all see (model.forward); the traces follow without it,
    positions going on from len(prefix). Same logits and loss, more traces a row (a long prompt:
    ~2x, tested).
    """
    P, rows, room = len(prefix), [], np.zeros(0, dtype=np.int64)   # traces in each row, space left
    for i, (tokens, authors) in enumerate(examples):
        n = len(tokens) - P
        if len(authors) != len(tokens):
            raise ValueError(f"trace {i} has {len(tokens)} tokens but {len(authors)} authors")
        if list(tokens[:P]) != list(prefix) or (P and n and authors[P]):
            raise ValueError(f"trace {i} does not start with the prefix followed by a program "
                             f"token")
        if n + P > seq_len:
            raise ValueError(f"trace {i} has {n + P} tokens, more than seq_len={seq_len} (traces "
                             f"are never split)")
        fits = np.flatnonzero(room >= n)
        if len(fits):
            rows[fits[0]].append(i)
            room[fits[0]] -= n
        else:
            rows.append([i])
            room = np.append(room, seq_len - P - n)

    R, T = len(rows), seq_len
    out = dict(tokens=np.full((R, T), pad_id, np.int32), targets=np.full((R, T), pad_id, np.int32),
               mask=np.zeros((R, T), np.float32), positions=np.zeros((R, T), np.int32),
               segments=np.zeros((R, T), np.int32))
    for r, members in enumerate(rows):
        out["tokens"][r, :P], out["positions"][r, :P] = prefix, np.arange(P)
        out["segments"][r, :P] = -1                     # the prefix, seen by every trace of the row
        start = P
        for segment, i in enumerate(members, start=1):
            tokens, authors = (np.asarray(a)[P:] for a in examples[i])
            end = start + len(tokens)
            out["tokens"][r, start:end] = tokens
            out["targets"][r, start:end - 1] = tokens[1:]
            out["mask"][r, start:end - 1] = authors[1:] != 0     # the model wrote the target
            out["positions"][r, start:end] = P + np.arange(len(tokens))
            out["segments"][r, start:end] = segment
            start = end
    return out


def _pad_rows(data, multiple):
    """Append all-padding rows (mask 0) so the row count is a multiple of `multiple`."""
    extra = -len(data["tokens"]) % multiple
    return {k: np.concatenate([v, np.zeros((extra,) + v.shape[1:], v.dtype)])
            for k, v in data.items()}


def _row_stream(n_rows, seed):
    """Row indices forever: a fresh permutation of the rows for each epoch."""
    rng = np.random.default_rng(seed)
    while True:
        yield from rng.permutation(n_rows)


# ---------------------------------------------------------------- loss

def token_nll(logits_BxTxV, targets_BxT):
    """-log softmax(logits)[target] = logsumexp(logits) - logits[target], in nats, at every
    position.

    The second form skips building the [B, T, V] log-probabilities, which with SmolLM2's
    49,152-token vocabulary are the largest array of the step.
    """
    logits_BxTxV = logits_BxTxV.astype(jnp.float32)
    target_logit_BxT = jnp.take_along_axis(logits_BxTxV, targets_BxT[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits_BxTxV, axis=-1) - target_logit_BxT


def masked_mean(nll_BxT, mask_BxT):
    """-> (mean of nll over the positions where mask is 1, how many those are).

    `where` rather than `nll * mask`: a position outside the mask adds exactly 0 even if its
    nll were inf, and its gradient is exactly 0 (a test checks this).
    """
    n_supervised = mask_BxT.sum()
    total = jnp.where(mask_BxT > 0, nll_BxT, 0.0).sum()
    return total / jnp.maximum(n_supervised, 1.0), n_supervised


def loss_fn(params, cfg, batch):
    """-> (nats per supervised token, number of supervised tokens) on a packed batch."""
    logits_BxTxV = model.forward(params, cfg, batch["tokens"], batch["positions"],
                                 batch["segments"])
    return masked_mean(token_nll(logits_BxTxV, batch["targets"]), batch["mask"])


# ---------------------------------------------------------------- optimizer

def lr_schedule(tcfg):
    """step -> learning rate: linear warm-up to lr, then cosine down to lr * min_lr_ratio.

    Step 0 already gets lr / warmup (not 0: a step with lr 0 would be wasted); step
    warmup - 1 gets lr, and the cosine reaches its floor at step `steps`.
    """
    lr, min_lr, warmup = tcfg.lr, tcfg.lr * tcfg.min_lr_ratio, max(tcfg.warmup, 1)

    def lr_at(step):
        warm = lr * (step + 1) / warmup
        progress = jnp.clip((step - warmup) / max(tcfg.steps - warmup, 1), 0.0, 1.0)
        cosine = min_lr + 0.5 * (lr - min_lr) * (1.0 + jnp.cos(jnp.pi * progress))
        return jnp.where(step < tcfg.warmup, warm, cosine)
    return lr_at


def _leaf_name(path):
    """A pytree path as 'layers/wq' (dict keys, attribute names, list indices)."""
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def make_optimizer(tcfg):
    """Clip the global gradient norm, then AdamW with the schedule above.

    No weight decay on the norms: pulling their gains toward 0 would shrink
    every activation, which is not the "simpler model" decay is meant to favour.
    """
    def decay_mask(params):
        return jax.tree.map_with_path(lambda p, _: not _leaf_name(p).endswith("norm"), params)
    return optax.chain(optax.clip_by_global_norm(tcfg.clip),
                       optax.adamw(lr_schedule(tcfg), b1=0.9, b2=0.95,
                                   weight_decay=tcfg.weight_decay, mask=decay_mask))


def make_train_step(cfg, optimizer, loss=None):
    """-> step(params, opt_state, batch, frozen=None) -> (params, opt_state, metrics), jitted.

    params and opt_state are donated: XLA writes the new values into the old buffers, so a
    step holds one copy of the weights and optimizer moments, not two. loss: see train(); None
    is loss_fn on params.
    """
    def objective(params, batch, frozen):
        return loss_fn(params, cfg, batch) if loss is None else loss(params, cfg, batch, frozen)

    def step(params, opt_state, batch, frozen=None):
        (nats, n), grads = jax.value_and_grad(objective, has_aux=True)(params, batch, frozen)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, dict(loss=nats, n_tokens=n, grad_norm=optax.tree.norm(grads))
    return jax.jit(step, donate_argnums=(0, 1))


@functools.lru_cache(maxsize=8)
def _cached_train_step(cfg, tcfg, loss=None):
    """One compiled step per (cfg, tcfg, loss): calling train() again (resuming, a sweep) does
    not recompile."""
    return make_train_step(cfg, make_optimizer(tcfg), loss)


# ---------------------------------------------------------------- on a mesh of devices

def placement(tree, mesh, sharding="data"):
    """Where each leaf of `tree` lives on the mesh: a NamedSharding per leaf.

    "data" (data parallel): every leaf whole on every device; only the batch is split.
    "fsdp" (fully sharded): each leaf split along its largest axis that the device count
    divides, whole where none does (a norm's few numbers, a step counter); XLA gathers a
    weight where a step needs it whole.

        Wq [L, D, NH] = [2, 64, 64] on 8 devices -> P(None, "data", None)
    """
    if sharding not in ("data", "fsdp"):
        raise ValueError(f"sharding={sharding!r}: 'data' or 'fsdp'")
    n = mesh.shape["data"]

    def one(leaf):
        axes = [i for i, d in enumerate(np.shape(leaf)) if d % n == 0 and d >= n]
        spec = [None] * np.ndim(leaf)
        if sharding == "fsdp" and axes:
            spec[max(axes, key=lambda i: np.shape(leaf)[i])] = "data"
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
    return jax.tree.map(one, tree)


# ---------------------------------------------------------------- evaluate and train

@functools.partial(jax.jit, static_argnums=1)
def _summed_nll(params, cfg, batch):
    loss, n = loss_fn(params, cfg, batch)
    return loss * n, n


def evaluate(params, cfg, examples, seq_len, batch_size):
    """-> dict(loss=nats per supervised token, n_tokens)."""
    data = _pad_rows(pack(examples, seq_len), batch_size)   # fixed batch shape: one compilation
    total, n = 0.0, 0.0
    for i in range(0, len(data["tokens"]), batch_size):
        s, c = _summed_nll(params, cfg, {k: v[i:i + batch_size] for k, v in data.items()})
        total, n = total + float(s), n + float(c)
    return dict(loss=total / max(n, 1.0), n_tokens=int(n))


def train(params, cfg, examples, tcfg, eval_examples=None, progress=True, checkpoint_path=None,
          checkpoint_every=0, tokenizer=None, opt_state=None, start_step=0, stop_at=None,
          loss=None, frozen=None, mesh=None, sharding="data", prefix=()):
    """Train for tcfg.steps steps (or until stop_at steps are done) -> (params, history).

    The examples are packed once; each epoch visits the rows in a new order
    (np.random.default_rng(tcfg.seed)), batch_size rows a step, epochs cycling.
    To resume, pass the opt_state and step of a checkpoint: the row order is
    replayed from the seed, so the run continues exactly as if never stopped.
    stop_at ends a run early (saving a checkpoint there, given checkpoint_path); the
    schedule still spans tcfg.steps. prefix: see pack.

    loss, frozen: to train something other than the model's weights. `params`
    is then whatever `loss(params, cfg, batch, frozen) -> (nats per supervised
    token, n)` differentiates; `frozen` is read, never updated. lora.py passes
    the adapters as params and the base model as frozen. (eval_examples need
    the model's weights: evaluate the merged params yourself.)

    mesh, sharding: train over the devices of a mesh (mesh.data_mesh()): each step's rows are
    split over its "data" axis, and params, optimizer state and `frozen` are placed as
    placement(..., sharding) says. The step is the same jitted function; XLA adds the
    communication. batch_size must be a multiple of the devices. Several processes: each
    calls jax.distributed.initialize() first and passes the same examples (docs/engine.md,
    "Several devices").

    history: one dict every log_every steps (and at the last): step (steps
    done), loss (of that step's batch), lr (used by that step), grad_norm,
    tokens_per_s (rows x seq_len, padding included, since the last record;
    the first record includes compilation), eval_loss when evaluated.
    """
    if loss is not None and eval_examples is not None:
        raise ValueError("eval_examples with a custom loss: evaluate the model's merged params "
                         "instead")
    data = pack(examples, tcfg.seq_len, prefix=prefix)   # prefix: see pack
    step_fn, lr_at = _cached_train_step(cfg, tcfg, loss), lr_schedule(tcfg)
    params = jax.tree.map(jnp.array, params)   # a copy: the step donates (frees) its input buffers
    if opt_state is None:
        opt_state = make_optimizer(tcfg).init(params)
    opt_state = jax.tree.map(jnp.array, opt_state)
    place = lambda tree: tree    # noqa: E731    one device: where they are
    if mesh is not None:
        mesh = automatic(mesh)
        if tcfg.batch_size % mesh.size:
            raise ValueError(f"batch_size={tcfg.batch_size} must be a multiple of the mesh's "
                             f"{mesh.size} devices")
        rows_BxT = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
        params, opt_state, frozen = (
            None if t is None else jax.device_put(t, placement(t, mesh, sharding))
            for t in (params, opt_state, frozen))
        # each batch's rows split over the devices
        place = lambda batch: jax.device_put(batch, rows_BxT)   # noqa: E731
    rows = itertools.islice(_row_stream(len(data["tokens"]), tcfg.seed),
                            start_step * tcfg.batch_size, None)

    history, t0, last = [], time.perf_counter(), start_step
    end = tcfg.steps if stop_at is None else min(stop_at, tcfg.steps)
    for step in range(start_step, end):
        idx_B = np.fromiter(rows, np.int64, tcfg.batch_size)
        batch = place({k: v[idx_B] for k, v in data.items()})
        params, opt_state, metrics = step_fn(params, opt_state, batch, frozen)
        done = step + 1
        evaluating = eval_examples is not None and (
            (tcfg.eval_every and done % tcfg.eval_every == 0) or done == end)
        if done % tcfg.log_every == 0 or done == end or evaluating:
            loss = float(metrics["loss"])   # waits for the step: timing below is honest
            dt = time.perf_counter() - t0
            record = dict(step=done, loss=loss, lr=float(lr_at(step)),
                          grad_norm=float(metrics["grad_norm"]),
                          tokens_per_s=(done - last) * tcfg.batch_size * tcfg.seq_len / dt)
            if evaluating:
                ev = evaluate(params, cfg, eval_examples, tcfg.seq_len, tcfg.batch_size)
                record.update({f"eval_{k}": v for k, v in ev.items()})
            history.append(record)
            if progress:
                _show(record, tcfg.steps)
            t0, last = time.perf_counter(), done
        if checkpoint_path and ((checkpoint_every and done % checkpoint_every == 0) or done == end):
            save_checkpoint(checkpoint_path, params, opt_state, cfg, tcfg, done, tokenizer)
    if progress and history:
        print(file=sys.stderr)
    return params, history


def _show(record, total):
    """One line, rewritten in place with '\\r' (no progress-bar dependency)."""
    line = (f"step {record['step']:>6}/{total}  loss {record['loss']:.4f}  lr {record['lr']:.2e}  "
            f"{record['tokens_per_s']:,.0f} tok/s")
    if "eval_loss" in record:
        line += f"  eval {record['eval_loss']:.4f}"
    print("\r" + line, end="", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- checkpoints

def _flatten(tree, prefix):
    """{'params/layers/wq': np array, ...}: one named array per leaf."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {f"{prefix}/{_leaf_name(path)}": np.asarray(leaf) for path, leaf in leaves}


def save_checkpoint(path, params, opt_state, cfg, tcfg, step, tokenizer=None, extra=None):
    """Write one .npz file: every leaf as a named array, plus a JSON header and the tokenizer's
    file.

    Atomic: written to a temporary file in the same directory (PATH.<random>.tmp), then renamed
    over `path` (os.replace), so `path` holds the old checkpoint or the new one, never half of one.
    """
    arrays = _flatten(params, "params")
    if opt_state is not None:
        arrays.update(_flatten(opt_state, "opt_state"))
    # dtypes: .npy has no bfloat16, so each leaf's dtype is kept here
    header = dict(format=FORMAT_VERSION, cfg=dataclasses.asdict(cfg), tcfg=dataclasses.asdict(tcfg),
                  step=int(step), extra=extra, has_opt_state=opt_state is not None,
                  dtypes={k: str(a.dtype) for k, a in arrays.items()})
    if tokenizer is not None:
        arrays["tokenizer"] = np.frombuffer(tokenfile.dumps(tokenizer).encode(), np.uint8)
    arrays["header"] = np.frombuffer(json.dumps(header).encode(), np.uint8)

    # A write killed half-way (SIGKILL, power) leaves its temporary file behind: the next save of
    # the same checkpoint removes it. (So two processes must not save the same path at once.)
    folder, name = os.path.split(os.path.abspath(path))
    for orphan in glob.glob(os.path.join(glob.escape(folder), glob.escape(name) + ".*.tmp")):
        os.remove(orphan)
    fd, tmp_path = tempfile.mkstemp(dir=folder, prefix=name + ".", suffix=".tmp")
    umask = os.umask(0)
    os.umask(umask)
    # mkstemp makes it private (0600); a checkpoint is an ordinary file
    os.chmod(tmp_path, 0o666 & ~umask)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        os.remove(tmp_path)
        raise


def load_checkpoint(path, params_like=None, opt_state_like=None):
    """-> dict(params, opt_state, cfg, tcfg, step, tokenizer, extra).

    params_like / opt_state_like give the expected structure (arrays or
    jax.ShapeDtypeStruct); by default, model.init's and make_optimizer's for the
    stored configs. Any difference, a missing leaf or another shape, is a
    ValueError that names the leaf, as is a truncated or corrupt file.
    """
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}   # reads every member: a bad CRC shows up here
    except FileNotFoundError:
        raise
    except Exception as e:
        raise ValueError(f"{path}: not a readable checkpoint (truncated or corrupt?): {e!r}") from e
    if "header" not in arrays:
        raise ValueError(f"{path}: no header, not a minagent checkpoint")
    header = json.loads(arrays.pop("header").tobytes())
    if header.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: checkpoint format version {header.get('format')}; "
                         f"this minagent reads version {FORMAT_VERSION}")
    try:
        cfg, tcfg = model.Config(**header["cfg"]), TrainConfig(**header["tcfg"])
    except TypeError as e:   # a field was renamed or removed since the file was written
        raise ValueError(f"{path}: the stored Config or TrainConfig does not fit this minagent: "
                         f"{e}") from e

    if params_like is None:
        params_like = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), cfg))
    params = _unflatten(path, arrays, header["dtypes"], "params", params_like)
    opt_state = None
    if header["has_opt_state"]:
        if opt_state_like is None:
            opt_state_like = jax.eval_shape(make_optimizer(tcfg).init, params_like)
        opt_state = _unflatten(path, arrays, header["dtypes"], "opt_state", opt_state_like)

    tok = None
    if "tokenizer" in arrays:
        tok = tokenfile.loads(arrays["tokenizer"].tobytes().decode("utf-8"), path)
    return dict(params=params, opt_state=opt_state, cfg=cfg, tcfg=tcfg, step=header["step"],
                tokenizer=tok, extra=header["extra"])


def _unflatten(path, arrays, dtypes, prefix, like):
    """Rebuild the pytree `like` from the named arrays, checking names and shapes leaf by leaf."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
    names = [f"{prefix}/{_leaf_name(p)}" for p, _ in leaves]
    unexpected = sorted(set(k for k in arrays if k.startswith(prefix + "/")) - set(names))
    missing = [k for k in names if k not in arrays]
    if missing or unexpected:
        raise ValueError(f"{path}: {prefix} do not match the expected structure: "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    out = []
    for name, (_, leaf) in zip(names, leaves):
        a = arrays[name]
        if a.shape != tuple(leaf.shape):
            raise ValueError(f"{path}: leaf {name} has shape {a.shape} in the checkpoint, "
                             f"{tuple(leaf.shape)} expected")
        # bfloat16 comes back from raw bytes
        out.append(jnp.asarray(a.view(jnp.dtype(dtypes[name]))))
    return jax.tree_util.tree_unflatten(treedef, out)
