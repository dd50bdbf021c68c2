"""Host-side state of up to B sequences decoding together, with pause and resume.

    batch = Batch(params, cfg, slots=8, pause_tokens=[RESULT], stop_tokens=[END])
    i = batch.add(prompt_tokens, limit=40)
    while batch.running():
        batch.step()                        # {seq_id: token} for every running sequence
        for j in paused ones: batch.resume(j, result_tokens + [ASSISTANT], limit=40)

Each sequence is a small state machine:

    queued --(slot and pages)--> running --pause token--> paused  --resume--> queued
                                         --stop token---> stopped --resume--> queued
                                         --limit--------> length  --resume--> queued
    paused / stopped / length --rewrite--> queued
    any --finish--> finished   (pages back to the pool, slot freed, tokens still readable)

A paused sequence keeps its slot and its pages but no longer goes through the
model: the decode step's pause mask gives it n_new = 0.

Pending tokens. Each sequence keeps `pending`, the tail of its tokens whose
K/V is not in the cache yet. A running sequence always has at least one: the
last token, which the next decode step pushes to sample the one after it. The
subtle case: a sampled `<|result|>` is pending when the sequence pauses, so on
resume it enters the cache together with the appended tokens:
pending = [<|result|>] + tool result + [<|assistant|>].

step() first prefills pending[:-1] of every running sequence (R rows at a
time, T from a few length buckets), then runs one decode step over all B
slots. Only new tokens ever go through the model. With cache=False a resume
instead drops the sequence's pages and re-prefills the whole episode, as an
engine without a KV cache must; the `positions` counters show the difference.

Pages: admission reserves pages for every position the stretch can write
(its length + limit - 1), and a stretch that ends gives back the pages it did
not fill. So a paused-and-resumed sequence holds exactly as many pages as the
same text given whole as a prompt.

Rewrite: a sequence's tokens are one *view* of its episode. When the view must
change other than at its end (context.fit replaced an old tool result by a
short note to stay within a budget), rewrite() swaps in the new token list.
K/V at a position depends only on the tokens up to it (attention is causal),
so the cache of the longest common prefix of the old and new tokens stays, and
only the rest is prefilled again: a prefix cache, as a provider keeps for a
request whose start is identical to the last one's. That is why context.fit
clears old results four at a time: the start of the view then stays the same
for several calls. The `reprefilled` counters count those positions.

park() gives back a waiting sequence's slot but keeps its pages, for one that
will wait long (an agent waiting for its sub-agent); the next resume or
rewrite queues it for a slot again, its cache intact.
"""

import dataclasses

import numpy as np

from minagent import decode
from minagent.cache import NULL_PAGE, OutOfPages, PagePool, init_cache, pages_for

WILL_ADVANCE = ("queued", "running")        # statuses in which a sequence advances without the caller
CAN_RESUME = ("paused", "stopped", "length")


@dataclasses.dataclass
class Sequence:
    id: int
    tokens: list                   # everything known: prompt + generated + appended
    pending: list                  # tail of `tokens` whose K/V is not in the cache yet
    limit: int                     # tokens it may still sample in this stretch
    seed: int                      # its sampling stream (sample() folds in the position)
    status: str = "queued"
    slot: int | None = None        # its row in the decode step, while it holds one
    pages: list = dataclasses.field(default_factory=list)
    positions: int = 0             # positions pushed through the model so far
    reprefilled: int = 0           # of those, positions queued again by rewrite()
    logits: list = dataclasses.field(default_factory=list)   # [V] per sampled token, if kept
    constraint: object = None      # a constrain.Constraint on what it may sample, or None
    state: object = None           # its constraint's state, advanced by every sampled token

    @property
    def cached(self):              # positions whose K/V is in the cache
        return len(self.tokens) - len(self.pending)


class Batch:
    """Up to `slots` sequences decoding together over one paged KV cache of `n_pages` x `page_size`.

    max_len bounds a sequence's tokens (prompt + generated + appended). Sampling: greedy if
    temperature == 0, else temperature and top_k (0: all tokens), one stream per sequence.
    cache=False re-reads a whole episode at every resume (for comparison). prefill_rows and
    buckets fix the prefill shapes (R rows x T tokens, T from buckets). keep_logits records
    each sampled token's logits (tests). A sequence added with a constraint samples only what its
    mask allows: the decode step then gets a [B, V] mask (all True in the other rows); with no
    constrained sequence running it gets none, and runs exactly as before.
    """

    def __init__(self, params, cfg, *, slots=8, n_pages=256, page_size=16, max_len=1024, stop_tokens=(),
                 pause_tokens=(), cache=True, temperature=0.0, top_k=0, seed=0, prefill_rows=4,
                 buckets=(16, 64, 256, 1024), keep_logits=False):
        self.params, self.cfg = decode.unstack_layers(params), cfg     # a list of layers: read in place
        self.n_slots, self.page_size, self.max_len = slots, page_size, max_len
        self.stop_tokens, self.pause_tokens = frozenset(stop_tokens), frozenset(pause_tokens)
        self.use_cache, self.seed = cache, seed
        self.prefill_rows = min(prefill_rows, slots)                # more rows than slots would all be padding
        self.temperature, self.top_k = float(temperature), int(top_k)
        self.buckets = sorted({min(b, max_len) for b in buckets})   # no chunk is longer than max_len
        self.keep_logits = keep_logits
        self.pool = PagePool(n_pages)
        self.kv = init_cache(cfg, n_pages, page_size)                # {"k", "v"}: [L, P, S, K, H]
        M = pages_for(max_len, page_size)
        self.page_table_BxM = np.zeros((slots, M), np.int32)
        # A step reads every page in its table's width, so it gets only as many columns as its longest
        # row needs, rounded up to a power of two: 1, 2, 4, ..., M. Reading all M pages of every row
        # would cost max_len keys per row per layer; this costs at most twice the longest row's length,
        # for at most log2(M) + 1 shapes per step kind.
        self.widths = sorted({min(2 ** i, M) for i in range(M.bit_length() + 1)})
        self.slot_seq = [None] * slots                               # slot -> sequence id
        self.seqs = {}                                               # id -> Sequence
        self.queue = []                                              # ids waiting for a slot or pages
        self.steps = 0
        self.compiles = 0                                            # traces of the jitted steps we caused

    # ------------------------------------------------------------ reading state

    def status(self, id):
        return self.seqs[id].status

    def is_running(self, id):
        """True while the sequence advances on its own: "queued" (waiting for a slot or pages) or "running"."""
        return self.seqs[id].status in WILL_ADVANCE

    def running(self):
        return [i for i, s in self.seqs.items() if s.status in WILL_ADVANCE]

    def tokens(self, id):
        return list(self.seqs[id].tokens)

    def pages(self, id):
        return list(self.seqs[id].pages)

    def logits(self, id):
        """[n sampled, V] logits from which each of its tokens was sampled (needs keep_logits=True)."""
        return np.stack(self.seqs[id].logits)

    @property
    def positions(self):
        return {i: s.positions for i, s in self.seqs.items()}

    @property
    def total_positions(self):
        return sum(s.positions for s in self.seqs.values())

    @property
    def reprefilled(self):
        return {i: s.reprefilled for i, s in self.seqs.items()}

    @property
    def total_reprefilled(self):
        return sum(s.reprefilled for s in self.seqs.values())

    def fits(self, n_tokens, limit):
        """Whether a sequence of n_tokens may sample `limit` more: within max_len and within the cache's pages."""
        return self._too_long(n_tokens, limit) is None

    def _too_long(self, n, limit):
        """Why n tokens + limit do not fit the cache, or None when they do."""
        if n + limit > self.max_len:
            return f"{n} tokens + limit {limit} > max_len {self.max_len}: prompt longer than the cache"
        need = pages_for(n + limit - 1, self.page_size)
        if need > self.pool.n_pages - 1:
            return f"{n} tokens + limit {limit} need {need} pages but the cache has {self.pool.n_pages - 1}: " \
                   "prompt longer than the cache"
        return None

    # ------------------------------------------------------------ the caller's moves

    def add(self, prompt_tokens, limit, *, seed=None, constraint=None):
        """A new sequence, queued; returns its id. `seed` picks its sampling stream (default: from its id).
        `constraint` (a constrain.Constraint) masks every token it samples from here on, starting at
        constraint.start(): its whole answer is constrained. resume() and rewrite() start it again,
        so each stretch is one constrained answer."""
        if constraint is not None and constraint.n_vocab != self.cfg.vocab_size:
            raise ValueError(f"the constraint masks {constraint.n_vocab} tokens, the model has {self.cfg.vocab_size}")
        prompt = self._check(list(prompt_tokens), 0, limit)
        if not prompt:
            raise ValueError("empty prompt: a sequence needs at least one token to predict from")
        id = len(self.seqs)
        seed = (self.seed * 1_000_003 + id) % 2**31 if seed is None else seed
        self.seqs[id] = Sequence(id, tokens=prompt, pending=list(prompt), limit=limit, seed=seed, constraint=constraint,
                                 state=None if constraint is None else constraint.start())
        self.queue.append(id)
        return id

    def resume(self, id, tokens, limit):
        """Append `tokens` to a paused, stopped or length-limited sequence and let it run `limit` more tokens."""
        seq = self.seqs[id]
        if seq.status not in CAN_RESUME:
            raise ValueError(f"sequence {id} is {seq.status}; only {'/'.join(CAN_RESUME)} sequences resume")
        tokens = self._check(list(tokens), len(seq.tokens), limit)
        seq.tokens += tokens
        seq.pending += tokens
        if not self.use_cache:          # no KV cache: forget everything and re-read the whole episode
            self._release(seq, keep=0)
            seq.pending = list(seq.tokens)
        self._restart(seq, limit)

    def rewrite(self, id, tokens, limit):
        """Replace the whole token list of a paused, stopped or length-limited sequence; -> positions to push.

        The cached K/V of the longest common prefix of its cached tokens and `tokens`
        stays (at most len(tokens) - 1 positions: the last token is always pending, for
        the decode step to sample from); the pages past it go back to the pool. A page
        holding kept positions and later ones stays, and its later positions are
        overwritten. With page_size 4, cached [u a b c | d e r1 r2 | r3]:

            rewrite(id, [u a b c | d e N], limit)   keeps 6 positions and 2 pages,
                                                    returns 1: N is pushed, then sampling goes on

        Without a cache (cache=False) everything is pushed again.
        """
        seq = self.seqs[id]
        if seq.status not in CAN_RESUME:
            raise ValueError(f"sequence {id} is {seq.status}; only {'/'.join(CAN_RESUME)} sequences are rewritten")
        tokens = self._check(list(tokens), 0, limit)
        if not tokens:
            raise ValueError("empty rewrite: a sequence needs at least one token to predict from")
        keep = 0
        if self.use_cache:
            for old, new in zip(seq.tokens[:min(seq.cached, len(tokens) - 1)], tokens):
                if old != new:
                    break
                keep += 1
        self._release(seq, keep=pages_for(keep, self.page_size))
        seq.tokens, seq.pending = tokens, tokens[keep:]
        seq.reprefilled += len(seq.pending)
        self._restart(seq, limit)
        return len(seq.pending)

    def _restart(self, seq, limit):
        """Queue a resumed or rewritten sequence for a new stretch; its constraint, if any, starts a new answer."""
        seq.limit, seq.status = limit, "queued"
        if seq.constraint is not None:
            seq.state = seq.constraint.start()
        self.queue.append(seq.id)

    def park(self, id):
        """Give a paused, stopped or length-limited sequence's slot back, keeping its pages (its cache).

        For a sequence that will wait long. A later resume() or rewrite() queues it for a
        slot again; it then gets whichever row is free, and its page table row is rebuilt.
        """
        seq = self.seqs[id]
        if seq.status not in CAN_RESUME:
            raise ValueError(f"sequence {id} is {seq.status}; only {'/'.join(CAN_RESUME)} sequences are parked")
        if seq.slot is not None:
            self.page_table_BxM[seq.slot] = NULL_PAGE
            self.slot_seq[seq.slot] = None
            seq.slot = None

    def finish(self, id):
        """Give the sequence's pages and slot back; its tokens stay readable."""
        seq = self.seqs[id]
        if id in self.queue:
            self.queue.remove(id)
        self._release(seq, keep=0)
        if seq.slot is not None:
            self.slot_seq[seq.slot] = None
            seq.slot = None
        seq.status = "finished"

    def warmup(self, constrained=False):
        """Compile every shape the steps can use (prefill: bucket x width; decode: width) on idle rows.

        Idle rows (n_new = 0) write only to the null page, so this changes no sequence. Optional: the
        shapes also compile on first use; after warmup() nothing compiles again. constrained=True also
        compiles the decode step with a token mask, which sequences added with a constraint use.
        """
        R, B = self.prefill_rows, self.n_slots
        for shorter, T in zip([0] + self.buckets, self.buckets):
            for W in self.widths:
                if W >= self._width(shorter + 1):      # a chunk gets bucket T only if longer than `shorter`
                    zeros_R = np.zeros(R, np.int32)
                    self.kv = self._run(decode.prefill_step, np.zeros((R, T), np.int32), zeros_R, zeros_R,
                                        np.zeros((R, W), np.int32))
        masks = [{}] + ([{"allowed_BxV": np.ones((B, self.cfg.vocab_size), bool)}] if constrained else [])
        for W in self.widths:
            for mask in masks:
                zeros_B = np.zeros(B, np.int32)
                _, _, self.kv = self._run(decode.decode_step, zeros_B, zeros_B, np.zeros(B, bool),
                                          np.zeros((B, W), np.int32), zeros_B,
                                          temperature=self.temperature, top_k=self.top_k, **mask)

    def step(self):
        """Prefill whatever is pending, then one decode step: one new token per running sequence."""
        short_of_pages = self._admit()
        running = [self.seqs[i] for i in self.slot_seq if i is not None and self.seqs[i].status == "running"]
        if not running:
            # Nothing can move until the caller finishes (or resumes) something: say so rather than spin.
            if short_of_pages:
                raise OutOfPages(f"sequences {short_of_pages} wait for pages, {self.pool.n_free} are free and "
                                 f"nothing is running to free more: finish some paused or stopped sequences")
            if self.queue:
                raise RuntimeError(f"sequences {self.queue} wait for a slot and every slot holds a paused, "
                                   f"stopped or length-limited sequence: finish some")
            return {}
        self._prefill(running)
        return self._decode(running)

    # ------------------------------------------------------------ inside a step

    def _check(self, tokens, n_before, limit):
        bad = [t for t in tokens if not 0 <= t < self.cfg.vocab_size]
        if bad:   # an out-of-range id would be clamped silently by the embedding lookup
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.cfg.vocab_size})")
        if limit < 1:
            raise ValueError(f"limit={limit}: a stretch must allow at least one token")
        why = self._too_long(n_before + len(tokens), limit)
        if why:
            raise ValueError(why)
        return tokens

    def _admit(self):
        """Give queued sequences a slot and the pages their stretch can fill; -> ids held back for pages."""
        short = []
        # Resumed sequences already hold a slot: serve them first, then the new ones in arrival order.
        for id in sorted(self.queue, key=lambda i: self.seqs[i].slot is None):
            seq = self.seqs[id]
            free_slots = [b for b, i in enumerate(self.slot_seq) if i is None]
            if seq.slot is None and not free_slots:
                continue
            need = pages_for(seq.cached + len(seq.pending) + seq.limit - 1, self.page_size) - len(seq.pages)
            if need > self.pool.n_free:
                short.append(id)
                continue
            if seq.slot is None:
                seq.slot = free_slots[0]
                self.slot_seq[seq.slot] = id
            seq.pages += self.pool.alloc(need)
            self.page_table_BxM[seq.slot, :len(seq.pages)] = seq.pages
            seq.status = "running"
            self.queue.remove(id)
        return short

    def _release(self, seq, keep):
        """Give back all pages of `seq` after the first `keep`."""
        self.pool.release(seq.pages[keep:])
        del seq.pages[keep:]
        if seq.slot is not None:
            self.page_table_BxM[seq.slot, keep:] = NULL_PAGE

    def _width(self, n_positions):
        """Page-table columns a step gets for rows of up to n positions: pages_for(n), rounded up to a width."""
        need = pages_for(n_positions, self.page_size)
        return next(w for w in self.widths if w >= need)

    def _run(self, fn, *args, **kwargs):
        before = decode.n_traces()
        out = fn(self.params, self.cfg, self.kv, *args, **kwargs)
        self.compiles += decode.n_traces() - before
        return out

    def _prefill(self, running):
        """Push pending[:-1] of every running sequence, R rows per call, chunks of at most the largest bucket."""
        R, biggest = self.prefill_rows, self.buckets[-1]
        while True:
            todo = sorted((s for s in running if len(s.pending) > 1), key=lambda s: len(s.pending))
            if not todo:
                return
            rows = todo[:R]            # similar lengths together: less padding
            chunks = [s.pending[:min(len(s.pending) - 1, biggest)] for s in rows]
            T = next(b for b in self.buckets if b >= max(map(len, chunks)))
            W = self._width(max(s.cached + len(c) for s, c in zip(rows, chunks)))
            tokens_RxT, table_RxW = np.zeros((R, T), np.int32), np.zeros((R, W), np.int32)
            start_R, n_new_R = np.zeros(R, np.int32), np.zeros(R, np.int32)   # padding rows: n_new 0
            for r, (seq, chunk) in enumerate(zip(rows, chunks)):
                tokens_RxT[r, :len(chunk)] = chunk
                start_R[r], n_new_R[r] = seq.cached, len(chunk)
                table_RxW[r] = self.page_table_BxM[seq.slot, :W]
            self.kv = self._run(decode.prefill_step, tokens_RxT, start_R, n_new_R, table_RxW)
            for seq, chunk in zip(rows, chunks):
                del seq.pending[:len(chunk)]
                seq.positions += len(chunk)

    def _decode(self, running):
        B = self.n_slots
        tokens_B, lengths_B = np.zeros(B, np.int32), np.zeros(B, np.int32)
        active_B, seeds_B = np.zeros(B, bool), np.zeros(B, np.int32)     # active_B: the pause mask
        for seq in running:
            (tokens_B[seq.slot],) = seq.pending
            lengths_B[seq.slot], active_B[seq.slot], seeds_B[seq.slot] = seq.cached, True, seq.seed
        W = self._width(int(lengths_B.max()) + 1)                       # the new token sits at `cached`
        # No constraint: the call (and so its compiled step) is the plain one; jit would retrace for
        # a keyword passed as None. A constraint: a [B, V] mask, all True in unconstrained rows.
        mask = {}
        if any(seq.constraint is not None for seq in running):
            mask["allowed_BxV"] = np.ones((B, self.cfg.vocab_size), bool)
            for seq in running:
                if seq.constraint is not None:
                    mask["allowed_BxV"][seq.slot] = seq.constraint.allowed(seq.state)
        next_B, logits_BxV, self.kv = self._run(decode.decode_step, tokens_B, lengths_B, active_B,
                                                self.page_table_BxM[:, :W], seeds_B,
                                                temperature=self.temperature, top_k=self.top_k, **mask)
        next_B = np.asarray(next_B)    # the one device -> host sync of the step
        logits_BxV = np.asarray(logits_BxV) if self.keep_logits else None
        self.steps += 1
        out = {}
        for seq in running:
            token = int(next_B[seq.slot])
            out[seq.id] = token
            seq.positions += 1
            seq.tokens.append(token)
            seq.pending = [token]
            seq.limit -= 1
            if seq.constraint is not None:
                seq.state = seq.constraint.advance(seq.state, token)
            if self.keep_logits:
                seq.logits.append(logits_BxV[seq.slot])
            if token in self.pause_tokens:
                self._end_stretch(seq, "paused")
            elif token in self.stop_tokens:
                self._end_stretch(seq, "stopped")
            elif seq.limit == 0:
                self._end_stretch(seq, "length")
        return out

    def _end_stretch(self, seq, status):
        """Keep the slot and the pages holding positions; give back the reserved pages left empty."""
        seq.status = status
        self._release(seq, keep=pages_for(seq.cached, self.page_size))
