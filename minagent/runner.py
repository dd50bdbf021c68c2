"""The device side of a Batch: the weights and the KV cache where the steps read them, the
jitted steps (on one device or over a mesh), the shapes they compile for, and the count of
compilations.

The Batch (batch.py) decides which sequences run and which tokens go where; the Runner
turns those decisions into fixed-shape arrays and runs decode.py's steps on them:

    runner = Runner(params, cfg, RunnerConfig(), slots=8, n_pages=64, page_size=16, max_len=256)
    R = runner.prefill_size([[len(tokens), ...]])               # rows for the next prefill call
    logits = runner.prefill({0: (tokens, start, pages), ...}, R)  # new tokens into their pages
    tokens_R = runner.sample(logits, seeds_R, positions_R)     # each prefill row's next token
    later, logits_RxV, rows_R, _ = runner.decode(slots)        # one token for every active slot
    runner.warmup()                                            # compile every shape now

Shapes. A step reads every page in its table's width, so a step gets only as many columns
as its longest row needs, rounded up to a power of two: 1, 2, 4, ..., W. Reading all W
pages of every row would cost max_len keys per row per layer; this costs at most twice
the longest row's length, for at most log2(W) + 1 shapes per step kind. A prefill chunk of
n tokens is padded to the smallest bucket (8, 12, 16, 24, 32, 64, 256, 1024) that holds it: the
short ones are close together because an agent's chunks are short (a prompt of a few dozen
tokens; a tool's result with the markers around it, 8 to 17 tokens in SmolLM2's chat format),
and every padding position costs as much as a real one. Each bucket is one more shape to
compile, for every width.

Prefill rows. A prefill call computes 4 or 16 rows: as many waiting chunks as fill 16, the
few left over in 4 (padded). A call reads every weight once, however many rows it pushes, and
larger products run closer to the cores' peak, so one call of 16 tool results costs less than
four calls of 4 (SmolLM2 on 2 CPU cores: 146 ms against 4 x 51 ms for chunks of 12 tokens;
64 episodes' prefill 4.4 -> 3.5 s). The larger row count serves chunks of up to
prefill_positions / 16 tokens, so that it adds shapes only where short chunks wait together:
prompts at the start of a batch, tool results coming back.

A prefill beside the decode step (RunnerConfig.prefill_beside, off by default). When what
waits fits one call of the smallest row count with chunks of at most prefill_beside tokens (a
few tool results, say), it runs in the decode step's call (decode.decode_prefill_step), its
chunks padded to prefill_beside: the weights are read once for both (64 episodes of SmolLM2 on
2 cores: 42 prefill calls -> 22). Each decode shape compiles a second time with those rows
beside it, which is why it is off by default: see the memory mappings below.
RunnerConfig.beside_rows lets more wait for the step: up to that many rows, in the smallest
prefill row count that holds them, each such row count one more compiled shape a decode shape.

Every shape is one more compiled step, and on CPU several hundred to a thousand more memory
mappings (SmolLM2's float32 decode step with its 30 layers unrolled, per_layer: 976; stacked: 137;
in int8 with bfloat16 beside, per_layer: 520), where Linux allows a process 65,530 by default.
A 64-slot SmolLM2 batch's warm-up compiles 94 shapes (113 with a row count of 64 as well reached
57,442 mappings), and a second batch warmed up in the same process can run LLVM out of them (an
abort, "Cannot allocate memory"). So can one such batch with a prefill beside the decode step:
24 more shapes of about 720 mappings each (int8 with bfloat16 beside; a decode step's: 520).
Fewer buckets or row counts, per_layer=False (5 % slower decode steps at 8 to 64 rows), a process
per batch, or compiling shapes as they come (no warm-up) keep under it.

Rows. A decode step computes only the active slots (running; not paused, finished or free),
padded with idle ones up to the smallest row count that holds them: 8, 16, 32, ... slots. In an
agent's batch half the slots can be waiting for a tool or done while the others decode (64
episodes of SmolLM2: 43 % of the slot-steps held a sequence), and an idle row costs a decode
step as much as a busy one. Each row count is one more shape to compile, for every width.

Packed calls (RunnerConfig.packed, off by default). Buckets and row counts keep the shapes
few, and the padding they add costs the products as much as real tokens: a fifth of the
positions of 64 SmolLM2 episodes. Packed, a call's products take only its real tokens, their
count rounded up to 4, 5, 6 or 7 times a power of two (decode.extend_groups' packed); attention
still reads each row as B x T. Those counts are known only when a call is made, so the shapes
compile as a run meets them, and warmup refuses (64 episodes, int8 with bfloat16 beside, a
prefill beside the step, 2 cores of a Zen 4: 7.0-7.8 s -> 6.4-6.8 s, the same episodes).

On a mesh (mesh.py) device d holds its block of slots and its own n_pages pages: page ids
are global (device d's: d * P to d * P + P - 1, the first its null page), and each device
reads them as its own, id % P, so jax.shard_map runs the one-device step on each block.
"""

import dataclasses
import functools
import numbers

import jax
import numpy as np

from minagent import decode
from minagent.cache import NULL_PAGE, init_cache, pages_for
from minagent.mesh import PAGES, ROWS, WHOLE, automatic


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    """How the steps run; none of it changes what a sequence samples.

    prefill_rows   the row counts a prefill call runs at (on each device; one compiled shape each,
                   for every bucket it serves and every width)
    prefill_positions  a row count above the smallest serves only buckets T with rows x T
                   at most this: long chunks go 4 at a time, short ones up to 16
    buckets        the lengths a prefill chunk is padded to (one compiled shape each)
    attention      "gather" or "pallas": how a decode step reads a row's pages (decode.extend)
    cache_dtype    the KV cache's dtype; default: the weights' dtype on a GPU, float32 elsewhere
                   (XLA on CPU would convert a bfloat16 pool to float32 and back in every layer)
    per_layer      hold the weights as a list of layers (unstack_layers) rather than stacked;
                   default: on CPU only
    mesh           a one-axis "data" mesh of D devices (mesh.data_mesh), or None for one device
    decode_rows    the row counts a decode step runs at (one compiled shape each, for every
                   width; the slot count is always one); on a mesh, every slot, always
    prefill_beside a prefill that fits one call of the smallest row count (or of beside_rows),
                   chunks of at most this many tokens (padded to it), runs in the decode step's
                   call when there is one (decode.decode_prefill_step: one pass over the weights
                   for both); None (the default): always a call of its own. Each decode shape
                   compiles a second time with those rows beside it ("Shapes" above). Not on a
                   mesh
    beside_rows    the most rows such a prefill may take, padded to the smallest prefill row
                   count that holds them; None: the smallest prefill row count. A call of both
                   then takes what would be prefill calls of their own (64 episodes of SmolLM2,
                   int8 with bfloat16 beside, packed, prefill_rows (2, 4, 8, 16), on 2 cores of
                   a Zen 4: up to 16 rows, 66 calls -> 53, 5.4-5.7 s -> 5.1-5.2 s)
    packed         a call's products take only its real tokens (decode.extend_groups' packed), their
                   count rounded up to 4, 5, 6 or 7 times a power of two (at most a quarter more),
                   not every row's chunk padded to its bucket and every idle row. One compiled
                   shape for each such count a call meets: warmup refuses (compile by running).
                   Not on a mesh
    """
    prefill_rows: tuple = (4, 16)
    prefill_positions: int = 1024
    buckets: tuple = (8, 12, 16, 24, 32, 64, 256, 1024)
    attention: str = "gather"
    cache_dtype: str | None = None
    per_layer: bool | None = None
    mesh: object = None
    decode_rows: tuple = (8, 16, 32, 64, 128, 256)
    prefill_beside: int | None = None
    beside_rows: int | None = None
    packed: bool = False


def unstack_layers(params):
    """params whose "layers" are stacked [L, ...] arrays (model.py's layout) -> the same params
    with "layers" a list of L per-layer dicts. The Runner does this once on CPU; extend accepts
    both layouts.

    Why: a scan over stacked weights slices layer l's matrices out of the [L, ...] arrays at
    every step, and on CPU that slice is a copy. Separate arrays are read where they lie
    (SmolLM2 on 2 CPU cores: the step at batch 1 takes about two thirds of the scan's time).
    The price: the step is traced layer by layer, so a deep model compiles more slowly (about
    ten times longer), and every call passes 9 arrays a layer (SmolLM2: 270), whose dispatch a
    fast GPU step would feel; so off a CPU the weights stay stacked (RunnerConfig.per_layer).
    """
    layers = params["layers"]
    if isinstance(layers, list):
        return params
    n_layers = jax.tree.leaves(layers)[0].shape[0]
    return {**params, "layers": [jax.tree.map(lambda a: a[l], layers) for l in range(n_layers)]}


class Runner:
    """decode.py's steps for `slots` rows over one KV cache of n_pages x page_size (on
    each device)."""

    def __init__(self, params, cfg, config, *, slots, n_pages, page_size, max_len):
        rc = config
        def integer(x):                                 # Python's or numpy's, not a bool
            return isinstance(x, numbers.Integral) and not isinstance(x, bool)
        if not rc.buckets or not all(integer(b) and b >= 1 for b in rc.buckets):
            raise ValueError(f"buckets={rc.buckets!r}: prefill lengths, integers >= 1")
        if not rc.prefill_rows or not all(integer(r) and r >= 1 for r in rc.prefill_rows):
            raise ValueError(f"prefill_rows={rc.prefill_rows!r}: row counts, integers >= 1")
        if not integer(rc.prefill_positions) or rc.prefill_positions < 1:
            raise ValueError(f"prefill_positions={rc.prefill_positions!r}: an integer >= 1")
        if not all(integer(r) and r >= 1 for r in rc.decode_rows):
            raise ValueError(f"decode_rows={rc.decode_rows!r}: row counts, integers >= 1")
        if rc.prefill_beside is not None and (not integer(rc.prefill_beside)
                                              or rc.prefill_beside < 1):
            raise ValueError(f"prefill_beside={rc.prefill_beside!r}: an integer >= 1, or None")
        if rc.beside_rows is not None and (not integer(rc.beside_rows) or rc.beside_rows < 1):
            raise ValueError(f"beside_rows={rc.beside_rows!r}: an integer >= 1, or None")
        if rc.attention not in ("gather", "pallas"):
            raise ValueError(f"attention={rc.attention!r}: 'gather' or 'pallas'")
        if rc.attention == "pallas":
            decode.check_pallas(page_size, cfg.head_dim)
        self.mesh = None if rc.mesh is None else automatic(rc.mesh)
        self.n_devices = D = 1 if self.mesh is None else self.mesh.size
        if self.mesh is not None and (self.mesh.axis_names != ("data",) or slots % D):
            raise ValueError(f"mesh {dict(self.mesh.shape)} for {slots} slots: one axis, 'data', "
                             f"dividing the slots")
        if rc.per_layer if rc.per_layer is not None else jax.default_backend() == "cpu":
            params = unstack_layers(params)
        cache_dtype = rc.cache_dtype or (cfg.dtype if jax.default_backend() == "gpu" else "float32")
        self.params, self.cfg, self.attention = params, cfg, rc.attention
        self.kv = init_cache(cfg, n_pages * D, page_size, cache_dtype)   # k, v: [L, K, P, Z, H]
        if self.mesh is not None:                  # device d holds pages d * P ... (d + 1) * P - 1
            self.kv = jax.device_put(self.kv, jax.sharding.NamedSharding(self.mesh, PAGES))
            self.params = jax.device_put(self.params, jax.sharding.NamedSharding(self.mesh, WHOLE))
        self.slots, self.page_size = slots, page_size
        # More prefill rows than slots would all be padding; no chunk is longer than max_len.
        self.prefill_rows = sorted({min(r, slots // D) for r in rc.prefill_rows})
        self.prefill_positions = rc.prefill_positions
        # the length prefill rows beside a decode step are padded to; None: never (or on a mesh)
        self.beside = None if D > 1 or rc.prefill_beside is None else min(rc.prefill_beside,
                                                                          max_len)
        # the row counts such a prefill runs at: the smallest, and any others up to beside_rows
        self.beside_rows = [r for r in self.prefill_rows
                            if r == self.prefill_rows[0] or r <= (rc.beside_rows or 0)]
        self.buckets = sorted({min(b, max_len) for b in rc.buckets})
        idle = [R for R in self.prefill_rows if not any(self.serves(R, T) for T in self.buckets)]
        if idle:
            raise ValueError(f"prefill_rows {idle} serve no bucket: rows x bucket is over "
                             f"prefill_positions={rc.prefill_positions} for each of {self.buckets}")
        W = pages_for(max_len, page_size)
        self.widths = sorted({min(2 ** i, W) for i in range(W.bit_length() + 1)})
        # On a mesh each device steps its own block of slots: all of them, always.
        self.rows = [slots] if D > 1 else sorted({r for r in rc.decode_rows if r < slots} | {slots})
        self.pack = rc.packed and D == 1
        self.compiles = 0                          # traces of the jitted steps this runner caused

    def width(self, n_positions):
        """Page-table columns a step gets for rows of up to n positions: pages_for(n), rounded
        up to a width."""
        need = pages_for(n_positions, self.page_size)
        return next(w for w in self.widths if w >= need)

    def bucket(self, n_tokens):
        """The length a chunk of n tokens is padded to."""
        return next(t for t in self.buckets if t >= n_tokens)

    def serves(self, R, T):
        """Whether a prefill call of R rows a device runs chunks of bucket T (a compiled shape)."""
        return R == self.prefill_rows[0] or R * T <= self.prefill_positions

    def packed(self, n_real, M):
        """extend_groups' packed for a call of n_real real tokens in M positions: the products'
        positions, or None (all M: packing off, or it would take no fewer)."""
        J = next((j for j in PACKED if j >= n_real), M) if self.pack else M
        return J if J < M else None

    def prefill_size(self, waiting):
        """Rows a device for the next prefill call: waiting[d], the lengths of device d's waiting
        chunks, shortest first -> R, one of prefill_rows. The largest row count that some device's
        waiting chunks fill and that serves their bucket (each device takes its R shortest); the
        smallest when fewer wait."""
        for R in reversed(self.prefill_rows):
            taken = [n for lengths in waiting for n in lengths[:R]]
            if R <= max(map(len, waiting)) and self.serves(R, self.bucket(max(taken))):
                return R
        return self.prefill_rows[0]

    def prefill(self, rows, R):
        """Push rows of new tokens into their pages, in one call of R rows a device (prefill_size):
        rows {b: (tokens, start, pages)}, b a prefill row (device d's: d * R ... d * R + R - 1),
        the tokens at positions start, start + 1, ... At most the largest bucket of tokens a row;
        the row's pages must hold them. -> logits_BxV of each row's last new token, on the device
        (for sample)."""
        n_rows = R * self.n_devices
        T = self.bucket(max(len(tokens) for tokens, _, _ in rows.values()))
        if R not in self.prefill_rows or not self.serves(R, T):
            raise ValueError(f"a prefill call of {R} rows with chunks of {T} tokens: not a shape "
                             f"of this runner (prefill_size picks one)")
        W = self.width(max(start + len(tokens) for tokens, start, _ in rows.values()))
        args = _prefill_rows(rows, n_rows, T, W)
        logits_BxV, self.kv = self._run(decode.prefill_step, *args,
                                        packed=self.packed(int(args[2].sum()), n_rows * T))
        return logits_BxV

    def sample(self, logits_BxV, seeds_B, positions_B, temperature=0.0, top_k=0,
               allowed_BxV=None):
        """The token each prefill row samples from its logits (decode.sample_step) -> int32 [B]
        on the host."""
        before = sum(decode.TRACES.values())
        tokens_B = decode.sample_step(logits_BxV, seeds_B, positions_B, temperature, top_k,
                                      allowed_BxV)
        self.compiles += sum(decode.TRACES.values()) - before
        return np.asarray(tokens_B)

    def step_rows(self, active_B):
        """The slots a decode step computes: the active ones, then idle ones up to the smallest
        row count that holds them -> int [R], in slot order."""
        active = np.flatnonzero(active_B)
        R = next(r for r in self.rows if r >= len(active))
        idle = np.flatnonzero(~np.asarray(active_B, bool))[:R - len(active)]
        return np.sort(np.concatenate([active, idle]))

    def fits_beside(self, lengths):
        """Whether prefill chunks of these lengths (a device's, shortest first) go in the decode
        step's call (RunnerConfig.prefill_beside and beside_rows)."""
        return (self.beside is not None and len(lengths) <= self.beside_rows[-1]
                and lengths[-1] <= self.beside)

    def decode(self, slots, temperature=0.0, top_k=0, allowed_BxV=None, beside=None):
        """One decode step for every active slot -> (the Slots one token later, on the host;
        logits_RxV on the device; rows_R: the slot of each row of the logits; the logits of
        `beside`'s rows, or None).

        beside: a prefill's rows {b: (tokens, start, pages)} (as prefill takes them, fits_beside)
        pushed in the same call."""
        # + 1: the pending token's position is written too
        reach = int(slots.lengths_B[slots.active_B].max(initial=0)) + 1
        if beside:
            reach = max(reach, *(start + len(tokens) for tokens, start, _ in beside.values()))
        W = self.width(reach)
        rows_R = self.step_rows(slots.active_B)
        part = _rows_of(slots, rows_R, W)
        allowed_RxV = None if allowed_BxV is None else allowed_BxV[rows_R]
        active = int(part.active_B.sum())                 # the decode rows' real tokens
        if beside:
            R = next(r for r in self.beside_rows if r >= len(beside))
            prefill = _prefill_rows(beside, R, self.beside, W)
            J = self.packed(active + int(prefill[2].sum()), len(rows_R) + prefill[0].size)
            later, logits_RxV, beside_logits, self.kv = self._run(
                decode.decode_prefill_step, part, *prefill, temperature, top_k, allowed_RxV,
                self.attention, packed=J)
        else:
            later, logits_RxV, self.kv = self._run(decode.decode_step, part, temperature, top_k,
                                                   allowed_RxV, self.attention,
                                                   packed=self.packed(active, len(rows_R)))
            beside_logits = None
        return _put_rows(slots, rows_R, later), logits_RxV, rows_R, beside_logits

    def decode_n(self, slots, left_B, ends_V, n, temperature=0.0, top_k=0):
        """Up to n decode steps in one call (decode.decode_steps) -> (the Slots after, tokens_NxB
        on the host: -1 where a slot sampled nothing)."""
        reach_B = slots.lengths_B + np.minimum(n, left_B)
        W = self.width(int(reach_B[slots.active_B].max(initial=0)))
        rows_R = self.step_rows(slots.active_B)
        later, tokens_NxR, self.kv = self._run(decode.decode_steps, _rows_of(slots, rows_R, W),
                                               left_B[rows_R], ends_V, n, temperature, top_k,
                                               self.attention)
        tokens_NxB = np.full((n, self.slots), -1, np.int32)
        tokens_NxB[:, rows_R] = np.asarray(tokens_NxR)
        return _put_rows(slots, rows_R, later), tokens_NxB

    def warmup(self, temperature=0.0, top_k=0, masked=False, steps=()):
        """Compile every shape the steps can use (prefill: rows x bucket x width; decode: rows x
        width) on idle rows.

        Idle rows (n_new = 0, active False) write only to the null page, so this changes no
        sequence. Sampling from a prefill's logits compiles too, on logits placed as a prefill
        leaves them. masked=True also compiles the steps that sample with a token mask.
        steps: each n also compiles decode_n(n) for one running slot, at every width (the agent
        loop's episode alone: its stretch in one call). Not with RunnerConfig.packed: its shapes
        are the calls' counts of real tokens, which a run meets (a few) and a warm-up would have
        to try (all).
        """
        if self.pack:
            raise ValueError("warmup with RunnerConfig(packed=True): its shapes are each call's "
                             "count of real tokens; compile them by running the batch instead")
        V = self.cfg.vocab_size
        for R in self.prefill_rows:
            n_rows = R * self.n_devices
            zeros_R = np.zeros(n_rows, np.int32)
            for shorter, T in zip([0] + self.buckets, self.buckets):
                for W in self.widths:
                    # a chunk gets bucket T only if it is longer than `shorter`
                    if self.serves(R, T) and W >= self.width(shorter + 1):
                        logits_RxV, self.kv = self._run(decode.prefill_step,
                                                        np.zeros((n_rows, T), np.int32), zeros_R,
                                                        zeros_R, np.zeros((n_rows, W), np.int32))
            for allowed in [None] + ([np.ones((n_rows, V), bool)] if masked else []):
                self.sample(logits_RxV, zeros_R, zeros_R, temperature, top_k, allowed)
        for W in self.widths:
            for R in self.rows:
                idle = decode.Slots.idle(R, W)
                for allowed in [None] + ([np.ones((R, V), bool)] if masked else []):
                    _, _, self.kv = self._run(decode.decode_step, idle, temperature, top_k,
                                              allowed, self.attention)
                    for R_beside in self.beside_rows if self.beside else []:
                        prefill = _prefill_rows({}, R_beside, self.beside, W)
                        *_, self.kv = self._run(decode.decode_prefill_step, idle, *prefill,
                                                temperature, top_k, allowed, self.attention)
            for n in steps:            # one slot running: the smallest row count
                R = self.rows[0]
                _, _, self.kv = self._run(decode.decode_steps, decode.Slots.idle(R, W),
                                          np.zeros(R, np.int32), np.zeros(V, bool), n,
                                          temperature, top_k, self.attention)

    def _run(self, step, *args, packed=None):
        """Call a step of decode.py on this runner's weights and cache (over the mesh if there
        is one). packed (Runner.packed) goes to the step only when it packs: unpacked, the step
        is called as it always was."""
        before = sum(decode.TRACES.values())
        if self.mesh is None:
            out = step(self.params, self.cfg, self.kv, *args,
                       **({} if packed is None else {"packed": packed}))
        else:
            out = ON_MESH[step](self.mesh, self.params, self.cfg, self.kv, *args)
        self.compiles += sum(decode.TRACES.values()) - before
        return out


# extend_groups' packed counts: 4, 5, 6 and 7 times a power of two (Runner.packed)
PACKED = sorted(a << k for k in range(20) for a in (4, 5, 6, 7))


def _prefill_rows(rows, n_rows, T, W):
    """A prefill's rows {b: (tokens, start, pages)} as the arrays extend takes (host arrays):
    tokens_BxT, start_B, n_new_B, page_table_BxW; rows not given are padding (n_new 0)."""
    tokens_BxT = np.zeros((n_rows, T), np.int32)
    table_BxW = np.full((n_rows, W), NULL_PAGE, np.int32)
    start_B, n_new_B = np.zeros(n_rows, np.int32), np.zeros(n_rows, np.int32)
    for b, (tokens, start, pages) in rows.items():
        tokens_BxT[b, :len(tokens)] = tokens
        start_B[b], n_new_B[b] = start, len(tokens)
        table_BxW[b, :min(len(pages), W)] = pages[:W]
    return tokens_BxT, start_B, n_new_B, table_BxW


def _rows_of(slots, rows_R, W):
    """The Slots of the slots rows_R, with W page-table columns (host arrays)."""
    part = jax.tree.map(lambda a: a[rows_R], slots)
    return dataclasses.replace(part, page_table_BxW=part.page_table_BxW[:, :W])


def _put_rows(slots, rows_R, later):
    """slots with rows_R's pending tokens and lengths taken from `later` (their step's Slots):
    the one device -> host copy of a decode step."""
    tokens_B, lengths_B = slots.tokens_B.copy(), slots.lengths_B.copy()
    tokens_B[rows_R], lengths_B[rows_R] = np.asarray(later.tokens_B), np.asarray(later.lengths_B)
    return dataclasses.replace(slots, tokens_B=tokens_B, lengths_B=lengths_B)


# ---------------------------------------------------------------- the steps over a mesh of devices
# Each wraps the one-device step in jax.shard_map: device d gets its block of rows and of pages,
# and reads the global page ids of its rows' tables as its own, id % P.

@functools.partial(jax.jit, static_argnames=("mesh", "cfg"), donate_argnames=("cache",))
def prefill_step_on(mesh, params, cfg, cache, tokens_BxT, start_B, n_new_B, page_table_BxW):
    """decode.prefill_step with rows and pages split over `mesh`: device d takes rows
    d * B / D ... (d + 1) * B / D - 1 (and returns their logits)."""
    def part(params, cache, tokens_BxT, start_B, n_new_B, page_table_BxW):
        P = cache["k"].shape[2]
        return decode.prefill_step(params, cfg, cache, tokens_BxT, start_B, n_new_B,
                                   page_table_BxW % P)
    return jax.shard_map(part, mesh=mesh, in_specs=(WHOLE, PAGES, ROWS, ROWS, ROWS, ROWS),
                         out_specs=(ROWS, PAGES))(params, cache, tokens_BxT, start_B, n_new_B,
                                                  page_table_BxW)


@functools.partial(jax.jit, static_argnames=("mesh", "cfg", "temperature", "top_k", "attention"),
                   donate_argnames=("cache",))
def decode_step_on(mesh, params, cfg, cache, slots, temperature=0.0, top_k=0, allowed_BxV=None,
                   attention="gather"):
    """decode.decode_step with slots and pages split over `mesh`."""
    def part(params, cache, slots, allowed_BxV):
        P = cache["k"].shape[2]
        local = dataclasses.replace(slots, page_table_BxW=slots.page_table_BxW % P)
        later, logits_BxV, cache = decode.decode_step(params, cfg, cache, local, temperature, top_k,
                                                      allowed_BxV, attention)
        return dataclasses.replace(later, page_table_BxW=slots.page_table_BxW), logits_BxV, cache
    return jax.shard_map(part, mesh=mesh, in_specs=(WHOLE, PAGES, ROWS, ROWS),
                         out_specs=(ROWS, ROWS, PAGES))(params, cache, slots, allowed_BxV)


@functools.partial(jax.jit, donate_argnames=("cache",),
                   static_argnames=("mesh", "cfg", "n", "temperature", "top_k", "attention"))
def decode_steps_on(mesh, params, cfg, cache, slots, left_B, ends_V, n, temperature=0.0, top_k=0,
                    attention="gather"):
    """decode.decode_steps with slots and pages split over `mesh` (tokens_NxB: split along B)."""
    def part(params, cache, slots, left_B, ends_V):
        P = cache["k"].shape[2]
        local = dataclasses.replace(slots, page_table_BxW=slots.page_table_BxW % P)
        later, tokens_NxB, cache = decode.decode_steps(params, cfg, cache, local, left_B, ends_V, n,
                                                       temperature, top_k, attention)
        return dataclasses.replace(later, page_table_BxW=slots.page_table_BxW), tokens_NxB, cache
    return jax.shard_map(part, mesh=mesh, in_specs=(WHOLE, PAGES, ROWS, ROWS, WHOLE),
                         out_specs=(ROWS, jax.sharding.PartitionSpec(None, "data"), PAGES))(
                             params, cache, slots, left_B, ends_V)


# decode's step -> the same step over a mesh (Runner._run picks from here when it has a mesh)
ON_MESH = {decode.prefill_step: prefill_step_on, decode.decode_step: decode_step_on,
           decode.decode_steps: decode_steps_on}
