"""Host-side state of up to B sequences decoding together, with pause and resume.

    batch = Batch(params, cfg, slots=8, pause_tokens=[RESULT], stop_tokens=[END])
    i = batch.add(prompt, limit=40)
    while batch.running():
        batch.step()                                  # one token for every running sequence
        # sequence i paused on <|result|>: resume it with the tool's result
        batch.send(i, batch.seqs[i].tokens + result + [ASSISTANT], limit=40)

Each sequence is a small state machine:

    queued --(slot and pages)--> running --pause token--> paused  --send--> queued
                                         --stop token---> stopped --send--> queued
                                         --limit--------> length  --send--> queued
    any --finish--> finished   (pages back to the pool, slot freed, tokens still readable)

A paused sequence keeps its slot and its pages but no longer goes through the
model: its pause-mask bit (Slots.active_B) is off.

Pending tokens: the tail of a sequence's tokens whose K/V is not in the cache yet.
A running sequence always has one, the last token, which the next decode step pushes.
The subtle case: a sampled `<|result|>` is pending when the sequence pauses, so on
resume it enters the cache with the appended tokens: [<|result|>] + result + [<|assistant|>].

send() keeps the cache of the longest common prefix of the old and new tokens (K/V at
a position depends only on the tokens up to it); a resume is the case where that is
everything. Admission reserves pages for all the stretch can write, and a stretch that
ends gives back what it did not fill: a paused-and-resumed sequence holds as many pages
as the same text given whole. (docs/DESIGN.md: "The pause mask", "Prefix reuse".)
"""

import dataclasses

import jax
import numpy as np

from minagent import decode, devices
from minagent.cache import NULL_PAGE, PagePool, init_cache, pages_for

ADVANCING = ("queued", "running")           # statuses in which a sequence advances without the caller
WAITING = ("paused", "stopped", "length")   # statuses from which send() starts a new stretch


class Stuck(RuntimeError):
    """Nothing can run until the caller finishes a sequence or sends it tokens (a slot or pages to free)."""


def _is_int(x):
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


@dataclasses.dataclass
class Sequence:
    id: int
    tokens: list                   # everything known: prompt, sampled, sent
    pending: list                  # tail of `tokens` whose K/V is not in the cache yet
    limit: int                     # tokens it may still sample in this stretch
    seed: int                      # its sampling stream (sample() folds in the position)
    mask: object = None            # mask(tokens sampled in this stretch) -> bool [V] of allowed tokens, or None
    status: str = "queued"
    slot: int | None = None        # its row in the decode step, while it holds one
    pages: list = dataclasses.field(default_factory=list)
    stretch: int = 0               # index in `tokens` of the first token sampled in this stretch
    positions: int = 0             # positions pushed through the model so far
    refilled: int = 0              # of those, the ones pushed because send() changed more than the end
    logits: list = dataclasses.field(default_factory=list)   # [V] per sampled token, with keep_logits

    @property
    def cached(self):              # positions whose K/V is in the cache
        return len(self.tokens) - len(self.pending)


class Batch:
    """Up to `slots` sequences decoding together over one paged KV cache of `n_pages` x `page_size`.

    max_len bounds a sequence's tokens (prompt + sampled + sent). Sampling: greedy if
    temperature == 0, else temperature and top_k (0: all tokens), one stream per sequence.
    cache=False pushes a sequence's whole token list again at every send (for comparison).
    prefill_rows and buckets fix the prefill shapes (rows x T tokens, T from buckets).
    keep_logits records each sampled token's logits (tests). For GPUs and meshes
    (docs/DESIGN.md, "Several devices"): attention "gather" or "pallas" (decode.extend);
    cache_dtype (default cfg.dtype on a GPU, float32 elsewhere: XLA on CPU would convert
    a bfloat16 pool every layer); per_layer weights (the default on CPU) or stacked; mesh,
    one "data" axis of D devices, each with slots / D slots and its own n_pages pages.
    """

    def __init__(self, params, cfg, *, slots=8, n_pages=256, page_size=16, max_len=1024, stop_tokens=(),
                 pause_tokens=(), cache=True, temperature=0.0, top_k=0, seed=0, prefill_rows=4,
                 buckets=(16, 64, 256, 1024), attention="gather", cache_dtype=None, per_layer=None, mesh=None,
                 keep_logits=False):
        for name, value, least in (("slots", slots, 1), ("n_pages", n_pages, 2), ("page_size", page_size, 1),
                                   ("max_len", max_len, 2), ("top_k", top_k, 0), ("prefill_rows", prefill_rows, 1)):
            if not _is_int(value) or value < least:
                raise ValueError(f"{name}={value!r}: an integer >= {least}")
        if not 0 <= temperature < float("inf"):
            raise ValueError(f"temperature={temperature!r}: >= 0 (0 is greedy)")
        if not buckets or not all(_is_int(b) and b >= 1 for b in buckets):
            raise ValueError(f"buckets={buckets!r}: prefill lengths, integers >= 1")
        if attention not in ("gather", "pallas"):
            raise ValueError(f"attention={attention!r}: 'gather' or 'pallas'")
        if attention == "pallas":
            devices.check_pallas(page_size, cfg.head_dim)
        D = 1 if mesh is None else mesh.size
        mesh = None if mesh is None else devices.automatic(mesh)
        if mesh is not None and (mesh.axis_names != ("data",) or slots % D):
            raise ValueError(f"mesh {dict(mesh.shape)} for {slots} slots: one axis, 'data', dividing the slots")
        per_layer = jax.default_backend() == "cpu" if per_layer is None else per_layer
        if per_layer:
            params = decode.unstack_layers(params)     # a list of layers, read in place (decode.unstack_layers)
        self.params, self.cfg = params, cfg
        self.page_size, self.max_len = page_size, max_len
        self.stop_tokens, self.pause_tokens = frozenset(stop_tokens), frozenset(pause_tokens)
        self._ends_V = np.zeros(cfg.vocab_size, bool)               # for decode_steps: where a stretch ends
        self._ends_V[[t for t in self.stop_tokens | self.pause_tokens if 0 <= t < cfg.vocab_size]] = True
        self.use_cache, self.seed, self.keep_logits = cache, seed, keep_logits
        self.temperature, self.top_k, self.attention = float(temperature), int(top_k), attention
        self.prefill_rows = min(prefill_rows, slots // D)          # more rows than slots would all be padding
        self.buckets = sorted({min(b, max_len) for b in buckets})  # no chunk is longer than max_len
        self.mesh, self.pool = mesh, PagePool(n_pages, devices=D)
        cache_dtype = cache_dtype or (cfg.dtype if jax.default_backend() == "gpu" else "float32")
        self.kv = init_cache(cfg, n_pages * D, page_size, cache_dtype)   # {"k", "v"}: [L, K, P, Z, H]
        if mesh is not None:                                        # device d holds pages d * P ... (d + 1) * P - 1
            self.kv = jax.device_put(self.kv, jax.sharding.NamedSharding(mesh, devices.PAGES))
            self.params = jax.device_put(self.params, jax.sharding.NamedSharding(mesh, devices.WHOLE))
        W = pages_for(max_len, page_size)
        self.state = decode.Slots.idle(slots, W)                    # the decode step's input, kept on the host
        # A step reads every page in its table's width, so it gets only as many columns as its longest
        # row needs, rounded up to a power of two: 1, 2, 4, ..., W. Reading all W pages of every row
        # would cost max_len keys per row per layer; this costs at most twice the longest row's length,
        # for at most log2(W) + 1 shapes per step kind.
        self.widths = sorted({min(2 ** i, W) for i in range(W.bit_length() + 1)})
        self.slots = slots
        self.seqs = {}                                              # id -> Sequence
        self.compiles = 0                                           # traces of the jitted steps we caused
        self._in_slot = [None] * slots                              # slot -> sequence id
        self._queue = []                                            # ids waiting for a slot or pages

    # ------------------------------------------------------------ the caller's moves

    def add(self, tokens, limit, *, seed=None, mask=None):
        """A new sequence, queued; -> its id. `seed` picks its sampling stream (default: from its id).

        mask(sampled) -> bool [V]: the tokens it may sample next, given those sampled so far in
        this stretch (a grammar's constraint, say); every stretch starts from an empty list.
        """
        id = len(self.seqs)
        tokens = self._check(tokens, limit)          # every argument checked before anything changes
        seed = (self.seed * 1_000_003 + id) % 2**31 if seed is None else seed
        if not _is_int(seed) or not 0 <= seed < 2**31:
            raise ValueError(f"seed={seed!r}: an integer in [0, 2**31), a sampling stream of the int32 step")
        if mask is not None and not callable(mask):
            raise ValueError(f"mask={mask!r}: None, or a function of the tokens sampled -> bool [V]")
        self.seqs[id] = Sequence(id, tokens, list(tokens), limit, seed, mask, stretch=len(tokens))
        self._queue.append(id)
        return id

    def send(self, id, tokens, limit):
        """A waiting sequence's new token list, and `limit` more tokens to sample -> positions to push.

        The cached K/V of the longest common prefix of its cached tokens and `tokens` stays (at
        most len(tokens) - 1 positions: the last token is always pending, for the decode step to
        sample from). With page_size 4, cached [u a b c | d e r1 r2 | r3]:

            send(id, [u a b c | d e r1 r2 | r3 <r> x <a>], ...)  keeps 9 positions: a resume
            send(id, [u a b c | d e N], ...)                     keeps 6, pushes N: a changed view

        Pages past the kept prefix go back to the pool; a page holding kept positions and
        later ones stays, and its later positions are overwritten.
        """
        seq = self.seqs[id]
        if seq.status not in WAITING:
            raise ValueError(f"sequence {id} is {seq.status}; only {'/'.join(WAITING)} sequences are sent tokens")
        tokens = self._check(tokens, limit)
        shared = 0
        for old, new in zip(seq.tokens[:min(seq.cached, len(tokens) - 1)], tokens):
            if old != new:
                break
            shared += 1
        # Without a cache nothing is kept, but the pages are, as with one: the same pages hold the same
        # positions either way, so the two runs are scheduled alike and differ only in what they push.
        keep = shared if self.use_cache else 0
        self._release(seq, keep=pages_for(shared, self.page_size))
        if tokens[:len(seq.tokens)] != seq.tokens:          # not only appended to: a changed view
            seq.refilled += len(tokens) - keep
        seq.tokens, seq.pending, seq.stretch = tokens, tokens[keep:], len(tokens)
        seq.limit, seq.status = limit, "queued"
        self._queue.append(id)
        return len(seq.pending)

    def park(self, id):
        """Give a waiting sequence's slot back, keeping its pages (its cache); send() queues it again."""
        seq = self.seqs[id]
        if seq.status not in WAITING:
            raise ValueError(f"sequence {id} is {seq.status}; only {'/'.join(WAITING)} sequences are parked")
        self._leave_slot(seq)

    def finish(self, id):
        """Give the sequence's pages and slot back; its tokens stay readable."""
        seq = self.seqs[id]
        if id in self._queue:
            self._queue.remove(id)
        self._release(seq, keep=0)
        self._leave_slot(seq)
        seq.status = "finished"

    def running(self):
        """Ids of the sequences that advance without the caller: queued or running."""
        return [i for i, s in self.seqs.items() if s.status in ADVANCING]

    def fits(self, n_tokens, limit):
        """Whether a sequence of n_tokens may sample `limit` more: within max_len and the cache's pages."""
        return self._too_long(n_tokens, limit) is None

    def step(self):
        """Prefill what newly admitted sequences hold, then one decode step -> {id: token sampled}."""
        running = self._start()
        return self._decode(running) if running else {}

    def steps(self, n):
        """Up to n tokens for each running sequence in one device call -> {id: [tokens sampled]}:
        what n calls of step() would give it, with one trip to the host instead of n
        (devices.decode_steps). A token mask needs the host at each token, so while a masked
        sequence runs (or with keep_logits) this takes one step. Each n compiles on first use.
        """
        if not _is_int(n) or n < 1:
            raise ValueError(f"n={n!r}: the steps a call, an integer >= 1")
        running = self._start()
        if not running or any(s.mask is not None for s in running) or self.keep_logits:
            return {i: [t] for i, t in (self._decode(running) if running else {}).items()}
        W = self._width(max(s.cached + min(n, s.limit) for s in running))
        state = dataclasses.replace(self.state, page_table_BxW=self.state.page_table_BxW[:, :W])
        left_B = np.zeros(len(self._in_slot), np.int32)                # tokens each may still sample
        for s in running:
            left_B[s.slot] = s.limit
        later, tokens_NxB, self.kv = self._run(devices.decode_steps, state, left_B, self._ends_V, n,
                                               self.temperature, self.top_k, self.attention)
        tokens_NxB = np.asarray(tokens_NxB)           # the one device -> host sync of the n steps
        self.state.tokens_B[:], self.state.lengths_B[:] = later.tokens_B, later.lengths_B
        out = {seq.id: [int(t) for t in tokens_NxB[:, seq.slot] if t >= 0] for seq in running}
        for seq in running:
            for token in out[seq.id]:
                self._took(seq, token)
        return out

    def _start(self):
        """Admit what can be, prefill it, seat it -> the running sequences (none: raise Stuck, or [])."""
        admitted, short_of_pages = self._admit()
        running = [self.seqs[i] for i in self._in_slot if i is not None and self.seqs[i].status == "running"]
        if not running:
            # Nothing can move until the caller finishes (or sends to) something: say so rather than spin.
            if short_of_pages:
                raise Stuck(f"sequences {short_of_pages} wait for pages, {self.pool.n_free} are free and "
                            f"nothing is running to free more: finish some paused or stopped sequences")
            if self._queue:
                raise Stuck(f"sequences {self._queue} wait for a slot and every slot holds a paused, "
                            f"stopped or length-limited sequence: finish some")
            return []
        self._prefill(admitted)
        for seq in admitted:
            self._seat(seq)
        return running

    def warmup(self, masked=False):
        """Compile every shape the steps can use (prefill: bucket x width; decode: width) on idle rows.

        Idle rows (n_new = 0, active False) write only to the null page, so this changes no
        sequence. Optional: shapes also compile on first use; after warmup() nothing compiles
        again. masked=True also compiles the decode step with a token mask.
        """
        B, V = len(self._in_slot), self.cfg.vocab_size
        for shorter, T in zip([0] + self.buckets, self.buckets):
            for W in self.widths:
                if W >= self._width(shorter + 1):      # a chunk gets bucket T only if longer than `shorter`
                    zeros = np.zeros(self.prefill_rows * self.pool.devices, np.int32)
                    self.kv = self._run(decode.prefill_step, np.zeros((len(zeros), T), np.int32), zeros, zeros,
                                        np.zeros((len(zeros), W), np.int32))
        for W in self.widths:
            idle = decode.Slots.idle(B, W)
            for allowed in [None] + ([np.ones((B, V), bool)] if masked else []):
                _, _, self.kv = self._run(decode.decode_step, idle, self.temperature, self.top_k, allowed,
                                          self.attention)

    # ------------------------------------------------------------ inside

    def _check(self, tokens, limit):
        tokens = list(tokens)
        if not tokens:
            raise ValueError("no tokens: a sequence needs at least one token to predict from")
        bad = [t for t in tokens if not _is_int(t) or not 0 <= t < self.cfg.vocab_size]
        if bad:   # 7.9 would be stored as it is but pushed as 7; an id out of range, clamped silently
            raise ValueError(f"token ids {bad[:5]} are not integers in the vocabulary [0, {self.cfg.vocab_size})")
        if not _is_int(limit) or limit < 1:
            raise ValueError(f"limit={limit!r}: a stretch must allow at least one token")
        why = self._too_long(len(tokens), limit)
        if why:
            raise ValueError(why)
        return [int(t) for t in tokens]

    def _too_long(self, n, limit):
        """Why n tokens + limit do not fit the cache, or None when they do."""
        if n + limit > self.max_len:
            return f"{n} tokens + limit {limit} > max_len {self.max_len}: prompt longer than the cache"
        need = pages_for(n + limit - 1, self.page_size)
        if need > self.pool.n_pages - 1:
            return f"{n} tokens + limit {limit} need {need} pages but the cache has {self.pool.n_pages - 1}: " \
                   "prompt longer than the cache"
        return None

    def _admit(self):
        """Give queued sequences a slot and the pages their stretch can fill -> (admitted, ids short of pages)."""
        admitted, short = [], []
        # Sequences that kept their slot go first, then the others in arrival order.
        for id in sorted(self._queue, key=lambda i: self.seqs[i].slot is None):
            seq = self.seqs[id]
            slot = seq.slot if seq.slot is not None else self._free_slot(seq)
            if slot is None:
                continue
            need = pages_for(len(seq.tokens) + seq.limit - 1, self.page_size) - len(seq.pages)
            if need > len(self.pool.free[self._device(slot)]):
                short.append(id)
                continue
            if seq.slot is None:
                seq.slot = slot
                self._in_slot[seq.slot] = id
            seq.pages += self.pool.alloc(need, self._device(slot))
            seq.status = "running"
            self._queue.remove(id)
            admitted.append(seq)
        return admitted, short

    def _device(self, slot):
        return slot * self.pool.devices // len(self._in_slot)

    def _free_slot(self, seq):
        """A free slot for a sequence that has none: on the device of its pages if it kept some (parked),
        else on the device with the most free pages; None if there is no such slot."""
        free = [b for b, i in enumerate(self._in_slot) if i is None]
        if seq.pages:
            free = [b for b in free if self._device(b) == self.pool.device_of(seq.pages[0])]
        return max(free, key=lambda b: len(self.pool.free[self._device(b)]), default=None)

    def _seat(self, seq):
        """Write the sequence's row of the decode state: pending token, length, seed, pages, pause bit."""
        b, state = seq.slot, self.state
        state.tokens_B[b], state.lengths_B[b], state.seeds_B[b] = seq.pending[-1], seq.cached, seq.seed
        state.active_B[b] = seq.status == "running"
        state.page_table_BxW[b] = NULL_PAGE
        state.page_table_BxW[b, :len(seq.pages)] = seq.pages

    def _leave_slot(self, seq):
        if seq.slot is not None:
            self.state.active_B[seq.slot] = False
            self.state.page_table_BxW[seq.slot] = NULL_PAGE
            self._in_slot[seq.slot] = seq.slot = None

    def _release(self, seq, keep):
        """Give back all pages of `seq` after the first `keep`."""
        self.pool.release(seq.pages[keep:])
        del seq.pages[keep:]
        if seq.slot is not None:
            self.state.page_table_BxW[seq.slot, keep:] = NULL_PAGE

    def _width(self, n_positions):
        """Page-table columns a step gets for rows of up to n positions: pages_for(n), rounded up to a width."""
        need = pages_for(n_positions, self.page_size)
        return next(w for w in self.widths if w >= need)

    def _run(self, fn, *args):
        before = sum(decode.TRACES.values())
        if self.mesh is None:
            out = fn(self.params, self.cfg, self.kv, *args)
        else:
            out = devices.ON_MESH[fn](self.mesh, self.params, self.cfg, self.kv, *args)
        self.compiles += sum(decode.TRACES.values()) - before
        return out

    def _prefill(self, seqs):
        """Push pending[:-1] of each sequence, prefill_rows rows per call, chunks of at most the largest bucket."""
        R, D, biggest = self.prefill_rows, self.pool.devices, self.buckets[-1]
        while todo := sorted((s for s in seqs if len(s.pending) > 1), key=lambda s: len(s.pending)):
            # Similar lengths together: less padding. Up to R rows for each device, from its own sequences.
            rows = {}
            for d in range(D):
                rows.update(enumerate([s for s in todo if self._device(s.slot) == d][:R], start=d * R))
            chunks = {b: s.pending[:min(len(s.pending) - 1, biggest)] for b, s in rows.items()}
            T = next(t for t in self.buckets if t >= max(map(len, chunks.values())))
            W = self._width(max(rows[b].cached + len(c) for b, c in chunks.items()))
            tokens_BxT, table_BxW = np.zeros((D * R, T), np.int32), np.zeros((D * R, W), np.int32)
            start_B, n_new_B = np.zeros(D * R, np.int32), np.zeros(D * R, np.int32)   # padding rows: n_new 0
            for b, seq in rows.items():
                chunk = chunks[b]
                tokens_BxT[b, :len(chunk)] = chunk
                start_B[b], n_new_B[b] = seq.cached, len(chunk)
                pages = seq.pages[:W]
                table_BxW[b, :len(pages)] = pages
            self.kv = self._run(decode.prefill_step, tokens_BxT, start_B, n_new_B, table_BxW)
            for b, seq in rows.items():
                chunk = chunks[b]
                del seq.pending[:len(chunk)]
                seq.positions += len(chunk)

    def _decode(self, running):
        W = self._width(max(s.cached for s in running) + 1)        # the pending token goes to position `cached`
        state = dataclasses.replace(self.state, page_table_BxW=self.state.page_table_BxW[:, :W])
        allowed_BxV = None                      # no mask: the plain step (a None argument compiles without it)
        if any(s.mask is not None for s in running):
            allowed_BxV = np.ones((len(self._in_slot), self.cfg.vocab_size), bool)
            for s in running:
                if s.mask is not None:
                    allowed_BxV[s.slot] = s.mask(s.tokens[s.stretch:])
        later, logits_BxV, self.kv = self._run(decode.decode_step, state, self.temperature, self.top_k,
                                               allowed_BxV, self.attention)
        self.state.tokens_B[:] = later.tokens_B       # the one device -> host sync of the step
        self.state.lengths_B[:] = later.lengths_B
        logits_BxV = np.asarray(logits_BxV) if self.keep_logits else None
        out = {}
        for seq in running:
            token = out[seq.id] = int(self.state.tokens_B[seq.slot])
            if self.keep_logits:
                seq.logits.append(logits_BxV[seq.slot])
            self._took(seq, token)
        return out

    def _took(self, seq, token):
        """A token the sequence sampled: append it; a pause or stop token, or the limit, ends the stretch."""
        seq.positions += 1
        seq.tokens.append(token)
        seq.pending = [token]
        seq.limit -= 1
        if token in self.pause_tokens:
            self._end_stretch(seq, "paused")
        elif token in self.stop_tokens:
            self._end_stretch(seq, "stopped")
        elif seq.limit == 0:
            self._end_stretch(seq, "length")

    def _end_stretch(self, seq, status):
        """Keep the slot and the pages holding positions; give back the reserved pages left empty."""
        seq.status = status
        self.state.active_B[seq.slot] = False
        self._release(seq, keep=pages_for(seq.cached, self.page_size))
