"""The scheduler: up to B sequences decoding together, each pausing, resuming and finishing
on its own.

    batch = Batch(params, cfg, slots=8, pause_tokens=[RESULT], stop_tokens=[END])
    i = batch.add(prompt, limit=40)
    while batch.running():
        batch.step()                                  # one token for every running sequence
        if batch.seqs[i].status is Status.PAUSED:     # it wrote <|result|>: send the tool's result
            batch.send(i, batch.seqs[i].tokens + result + [ASSISTANT], limit=40)

Each sequence is a small state machine:

    QUEUED --(slot and pages)--> RUNNING --pause token--> PAUSED  --send--> QUEUED
                                         --stop token---> STOPPED --send--> QUEUED
                                         --limit--------> LENGTH  --send--> QUEUED
    PAUSED, STOPPED, LENGTH --park--> the same status, its slot given back, its pages kept
    any --finish--> FINISHED   (pages back to the pool, slot freed, tokens still readable)

A paused sequence keeps its slot and its pages but no longer goes through the
model: its pause-mask bit (Slots.active_B) is off. park() gives back a waiting
sequence's slot but keeps its pages, for one that will wait long; the next send()
queues it again, and it takes a free slot on the device that holds its pages.

Pending tokens. Each sequence keeps `pending`, the tail of its tokens whose K/V
is not in the cache yet. A running sequence always has at least one: the last
token, which the next decode step pushes to sample the one after it. The
subtle case: a sampled `<|result|>` is pending when the sequence pauses, so on
resume it enters the cache together with the appended tokens:
pending = [<|result|>] + tool result + [<|assistant|>].

send(id, tokens, limit) gives a waiting sequence its next token list. K/V at a
position depends only on the tokens up to it (attention is causal), so the
cache of the longest common prefix of the old and new tokens stays, and only
the rest is pushed: a prefix cache. A resume is the case where the new tokens
extend the old ones, and everything cached stays. With reuse_cache=False every
position is pushed again, as in an engine without a KV cache.

Pages: admission reserves pages for every position the stretch can write (its
length + limit - 1), and a stretch that ends gives back the pages it did not
fill. So a paused-and-resumed sequence holds exactly as many pages as the same
text given whole as a prompt. (docs/engine.md: "The pause mask", "Prefix reuse".)

A step is: admit what can be (`_admit`); prefill the pending tokens of each newly
admitted sequence that has more than one (`_prefill`: rows of T tokens, T from a
few length buckets) and sample its next token from the logits of its last; then
one decode step over the other running slots (`_decode`). A prefill of a few short
chunks (tool results, mostly) goes in the decode step's call, one pass over the
weights for both (RunnerConfig.prefill_beside). `_took` appends each token sampled.
The device work (shapes, the cache, the jitted steps) is the Runner's (runner.py).
"""

import dataclasses
import enum

import numpy as np

from minagent import decode
from minagent.cache import NULL_PAGE, PagePool, pages_for
from minagent.runner import Runner, RunnerConfig


class Status(enum.StrEnum):
    QUEUED = "queued"        # waiting for a slot, or for pages
    RUNNING = "running"      # in a slot, one token a step
    PAUSED = "paused"        # sampled a pause token
    STOPPED = "stopped"      # sampled a stop token
    LENGTH = "length"        # sampled as many tokens as its stretch allowed
    FINISHED = "finished"    # its pages and slot given back


ADVANCING = frozenset({Status.QUEUED, Status.RUNNING})               # advance without the caller
WAITING = frozenset({Status.PAUSED, Status.STOPPED, Status.LENGTH})  # send() starts a new stretch


class Stuck(RuntimeError):
    """Nothing can run until the caller finishes a sequence or sends it tokens (a slot or
    pages to free)."""


def is_int(x):
    """An integer, Python's or numpy's; not a bool (which Python counts as one)."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def check_int(name, value, least):
    """Raise ValueError unless value is an integer >= least."""
    if not is_int(value) or value < least:
        raise ValueError(f"{name}={value!r}: an integer >= {least}")


@dataclasses.dataclass
class Sequence:
    id: int
    tokens: list                   # everything known: prompt, sampled, sent
    pending: list                  # tail of `tokens` whose K/V is not in the cache yet
    limit: int                     # tokens it may still sample in this stretch
    seed: int                      # its sampling stream (sample() folds in the position)
    mask: object = None            # mask(tokens sampled in this stretch) -> bool [V] of allowed
    #                                tokens, or None
    status: Status = Status.QUEUED
    slot: int | None = None        # its row in the decode step, while it holds one
    pages: list = dataclasses.field(default_factory=list)
    stretch: int = 0               # index in `tokens` of the first token sampled in this stretch
    positions: int = 0             # positions pushed through the model so far
    refilled: int = 0              # of those, the ones pushed because send() changed more than
    #                                the end
    logits: list = dataclasses.field(default_factory=list)  # [V] per sampled token (keep_logits)

    @property
    def cached(self):              # positions whose K/V is in the cache
        return len(self.tokens) - len(self.pending)


class Batch:
    """Up to `slots` sequences decoding together over one paged KV cache of `n_pages` x `page_size`.

    max_len bounds a sequence's tokens (prompt + sampled + sent). Sampling: greedy if
    temperature == 0, else temperature and top_k (0: all tokens), one stream per sequence.
    reuse_cache=False pushes a sequence's whole token list again at every send (to compare).
    keep_logits records each sampled token's logits (tests). runner: how the steps run
    (runner.RunnerConfig: prefill shapes, attention, cache dtype, weights layout, a mesh of
    D devices, each with slots / D slots and its own n_pages pages).
    """

    def __init__(self, params, cfg, *, slots=8, n_pages=256, page_size=16, max_len=1024,
                 stop_tokens=(), pause_tokens=(), reuse_cache=True, temperature=0.0, top_k=0,
                 seed=0, keep_logits=False, runner=RunnerConfig()):
        for name, value, least in (("slots", slots, 1), ("n_pages", n_pages, 2),
                                   ("page_size", page_size, 1), ("max_len", max_len, 2)):
            check_int(name, value, least)
        decode.check_sampling(temperature, top_k)
        self.runner = Runner(params, cfg, runner, slots=slots, n_pages=n_pages, page_size=page_size,
                             max_len=max_len)
        self.cfg, self.slots, self.page_size, self.max_len = cfg, slots, page_size, max_len
        self.stop_tokens, self.pause_tokens = frozenset(stop_tokens), frozenset(pause_tokens)
        self.reuse_cache, self.seed, self.keep_logits = reuse_cache, seed, keep_logits
        self.temperature, self.top_k = float(temperature), int(top_k)
        self.pool = PagePool(n_pages, n_devices=self.runner.n_devices)
        # the decode step's input, kept on the host
        self.state = decode.Slots.idle(slots, pages_for(max_len, page_size))
        self.seqs = {}                              # id -> Sequence
        self._in_slot = [None] * slots              # slot -> sequence id
        self._queue = []                            # ids waiting for a slot or pages

    # ------------------------------------------------------------ the caller's moves

    def add(self, tokens, limit, *, seed=None, mask=None):
        """A new sequence, queued; -> its id. `seed` picks its sampling stream (default: from
        its id).

        mask(sampled) -> bool [V]: the tokens it may sample next, given those sampled so far in
        this stretch (a grammar's constraint, say); every stretch starts from an empty list.
        Every argument is checked before anything changes.
        """
        id = len(self.seqs)
        tokens = self._check(tokens, limit)
        seed = (self.seed * 1_000_003 + id) % 2**31 if seed is None else seed
        if not is_int(seed) or not 0 <= seed < 2**31:
            raise ValueError(f"seed={seed!r}: an integer in [0, 2**31), a sampling stream of the "
                             f"int32 step")
        if mask is not None and not callable(mask):
            raise ValueError(f"mask={mask!r}: None, or a function of the tokens sampled -> "
                             f"bool [V]")
        self.seqs[id] = Sequence(id, tokens, list(tokens), limit, int(seed), mask,
                                 stretch=len(tokens))
        self._queue.append(id)
        return id

    def send(self, id, tokens, limit):
        """A waiting sequence's new token list, and `limit` more tokens to sample -> positions
        to push.

        The cached K/V of the longest common prefix of its cached tokens and `tokens` stays (at
        most len(tokens) - 1 positions: the last token is always pending, for the next step to
        sample from, a prefill's or a decode step). With page_size 4, cached
        [u a b c | d e r1 r2 | r3]:

            send(id, [u a b c | d e r1 r2 | r3 <r> x <a>], ...)  keeps 9 positions: a resume
            send(id, [u a b c | d e N], ...)                     keeps 6, pushes N: a changed view

        Pages past the kept prefix go back to the pool; a page holding kept positions and
        later ones stays, and its later positions are overwritten.
        """
        seq = self.seqs[id]
        if seq.status not in WAITING:
            raise ValueError(f"sequence {id} is {seq.status}; only paused, stopped or length "
                             f"sequences are sent tokens")
        tokens = self._check(tokens, limit)
        shared = 0
        for old, new in zip(seq.tokens[:min(seq.cached, len(tokens) - 1)], tokens):
            if old != new:
                break
            shared += 1
        # Without reuse nothing is kept, but the pages are, as with it: the same pages hold the
        # same positions either way, so the two runs are scheduled alike and differ only in what
        # they push.
        keep = shared if self.reuse_cache else 0
        self._release(seq, keep=pages_for(shared, self.page_size))
        if tokens[:len(seq.tokens)] != seq.tokens:          # not only appended to: a changed view
            seq.refilled += len(tokens) - keep
        seq.tokens, seq.pending, seq.stretch = tokens, tokens[keep:], len(tokens)
        seq.limit, seq.status = limit, Status.QUEUED
        self._queue.append(id)
        return len(seq.pending)

    def park(self, id):
        """Give a waiting sequence's slot back, keeping its pages (its cache), for one that will
        wait long; send() queues it again."""
        seq = self.seqs[id]
        if seq.status not in WAITING:
            raise ValueError(f"sequence {id} is {seq.status}; only paused, stopped or length "
                             f"sequences are parked")
        self._leave_slot(seq)

    def finish(self, id):
        """Give the sequence's pages and slot back; its tokens stay readable."""
        seq = self.seqs[id]
        if id in self._queue:
            self._queue.remove(id)
        self._release(seq, keep=0)
        self._leave_slot(seq)
        seq.status = Status.FINISHED

    def running(self):
        """Ids of the sequences that advance without the caller: queued or running."""
        return [i for i, s in self.seqs.items() if s.status in ADVANCING]

    def fits(self, n_tokens, limit):
        """Whether a sequence of n_tokens may sample `limit` more: within max_len and the
        cache's pages."""
        return self._too_long(n_tokens, limit) is None

    def step(self):
        """Admit and prefill what can start, then one decode step -> {id: token sampled}.

        A sequence prefilled in this step samples its token from the prefill's logits and sits
        out the decode step: one token a sequence a step either way. (Its prefill may run in
        the decode step's call: RunnerConfig.prefill_beside.)"""
        running, first, beside = self._start(beside=True)
        out = self._decode(running, beside) if running else {}
        self._seat_all([*first, *(seq.id for seq in beside.values())])
        return {**first, **out}

    def steps(self, n):
        """Up to n tokens for each running sequence in one device call -> {id: [tokens sampled]}.

        Each sequence samples what n calls of step() would give it (its stretch may end sooner),
        with one trip to the host instead of n (decode.decode_steps). A token mask needs the host
        at each token, so while a masked sequence runs (or with keep_logits) this takes one
        step. Each n (and page-table width) compiles once, on first use.
        """
        if not is_int(n) or n < 1:
            raise ValueError(f"n={n!r}: the steps a call, an integer >= 1")
        running, first, _ = self._start()
        if not running or any(s.mask is not None for s in running) or self.keep_logits:
            out = self._decode(running, {}) if running else {}
            self._seat_all(first)
            return {i: [t] for i, t in {**first, **out}.items()}
        left_B = np.zeros(self.slots, np.int32)                  # tokens each may still sample
        for s in running:
            left_B[s.slot] = s.limit
        ends_V = np.zeros(self.cfg.vocab_size, bool)              # where a stretch ends
        ends_V[[t for t in self.stop_tokens | self.pause_tokens if 0 <= t < len(ends_V)]] = True
        later, tokens_NxB = self.runner.decode_n(self.state, left_B, ends_V, n, self.temperature,
                                                 self.top_k)
        self.state.tokens_B[:], self.state.lengths_B[:] = later.tokens_B, later.lengths_B
        out = {seq.id: [int(t) for t in tokens_NxB[:, seq.slot] if t >= 0] for seq in running}
        for seq in running:
            seq.positions += len(out[seq.id])          # each token sampled pushed the one before
            for token in out[seq.id]:
                self._took(seq, token)
        self._seat_all(first)
        return {**{i: [t] for i, t in first.items()}, **out}

    def warmup(self, masked=False, steps=()):
        """Compile every shape the steps can use now (Runner.warmup), so that nothing compiles
        later. Optional: shapes also compile on first use. masked=True: the step with a
        token mask too; steps: each n of steps(n) too, for one running sequence."""
        self.runner.warmup(self.temperature, self.top_k, masked, steps)

    @property
    def compiles(self):
        """How many times the jitted steps were traced (compiled) for this batch."""
        return self.runner.compiles

    # ------------------------------------------------------------ a step, in order

    def _start(self, beside=False):
        """Admit what can be, prefill it -> (the running sequences for the decode step, {id:
        first token} of those the prefill sampled, seated after the decode step, {row: sequence}
        of a prefill left to go beside the decode step); none running: raise Stuck, or ([], {},
        {}). beside: a prefill that fits may go in the decode step's call (Runner.fits_beside)."""
        admitted, short_of_pages = self._admit()
        running = [self.seqs[i] for i in self._in_slot
                   if i is not None and self.seqs[i].status is Status.RUNNING]
        if not running:
            # Nothing can move until the caller finishes (or sends to) something: say so rather
            # than spin.
            if short_of_pages:
                raise Stuck(f"sequences {short_of_pages} wait for pages, {self.pool.n_free} are "
                            f"free and nothing is running to free more: finish some paused or "
                            f"stopped sequences")
            if self._queue:
                raise Stuck(f"sequences {self._queue} wait for a slot and every slot holds a "
                            f"paused, stopped or length-limited sequence: finish some")
            return [], {}, {}
        decoding = any(len(s.pending) == 1 for s in running)
        first, later = self._prefill(admitted, beside and decoding)
        prefilled = first.keys() | {s.id for s in later.values()}
        for seq in admitted:
            if seq.id not in prefilled:
                self._seat(seq)
        return [s for s in running if s.id not in prefilled], first, later

    def _admit(self):
        """Give queued sequences a slot and the pages their stretch can fill -> (admitted, ids
        short of pages)."""
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
            seq.status = Status.RUNNING
            self._queue.remove(id)
            admitted.append(seq)
        return admitted, short

    def _prefill(self, seqs, beside=False):
        """Push the pending tokens of each sequence that has more than one, and sample its next
        token from the logits of the last -> ({id: token}, {}). As many rows a device a call as
        the Runner's prefill_size gives for what waits, chunks of at most the largest bucket, the
        shortest first (similar lengths together: less padding). beside: once what waits fits in
        the decode step's call (Runner.fits_beside), leave it for that call: -> ({id: token},
        {row: sequence}) for _decode.

        Sampling here saves a model call a stretch: pushing all but the last pending token and
        leaving that one to the decode step would make a prompt, or a tool's result, cost a
        prefill call and a decode call where one does. A single pending token goes to the
        decode step, where it shares the call with the other slots."""
        biggest = self.runner.buckets[-1]
        todo, first = [s for s in seqs if len(s.pending) > 1], {}
        while todo := sorted(todo, key=lambda s: len(s.pending)):
            if beside and self.runner.fits_beside([len(s.pending) for s in todo]):
                return first, dict(enumerate(todo))          # the last few: beside the decode step
            own = [[s for s in todo if self._device(s.slot) == d]
                   for d in range(self.runner.n_devices)]
            R = self.runner.prefill_size([[min(len(s.pending), biggest) for s in mine]
                                          for mine in own])
            rows = {}                   # prefill row -> sequence: device d's rows from its own
            for d, mine in enumerate(own):
                rows.update(enumerate(mine[:R], start=d * R))
            chunks = {b: s.pending[:biggest] for b, s in rows.items()}
            logits_RxV = self.runner.prefill({b: (chunks[b], s.cached, s.pages)
                                              for b, s in rows.items()}, R)
            for b, seq in rows.items():
                del seq.pending[:len(chunks[b])]
                seq.positions += len(chunks[b])
            done = {b: s for b, s in rows.items() if not s.pending}   # their last token pushed
            if done:
                first.update(self._sample_first(logits_RxV, done))
            todo = [s for s in todo if s.id not in first]
        return first, {}

    def _sample_first(self, logits_RxV, rows):
        """Each row's sequence samples its next token from the prefill's logits -> {id: token}."""
        n_rows = logits_RxV.shape[0]
        seeds_R, positions_R = np.zeros(n_rows, np.int32), np.zeros(n_rows, np.int32)
        allowed_RxV = None
        if any(s.mask is not None for s in rows.values()):
            allowed_RxV = np.ones((n_rows, self.cfg.vocab_size), bool)
        for b, seq in rows.items():
            seeds_R[b], positions_R[b] = seq.seed, len(seq.tokens)   # the sampled token's place
            if seq.mask is not None:
                allowed_RxV[b] = seq.mask(seq.tokens[seq.stretch:])
        tokens_R = self.runner.sample(logits_RxV, seeds_R, positions_R, self.temperature,
                                      self.top_k, allowed_RxV)
        logits_RxV = np.asarray(logits_RxV) if self.keep_logits else None
        out = {}
        for b, seq in rows.items():
            token = out[seq.id] = int(tokens_R[b])
            if self.keep_logits:
                seq.logits.append(logits_RxV[b])
            self._took(seq, token)
        return out

    def _seat_all(self, ids):
        for id in ids:
            self._seat(self.seqs[id])

    def _seat(self, seq):
        """Write the sequence's row of the decode state: pending token, length, seed, pages,
        pause bit."""
        b, state = seq.slot, self.state
        state.tokens_B[b], state.lengths_B[b] = seq.pending[-1], seq.cached
        state.seeds_B[b] = seq.seed
        state.active_B[b] = seq.status is Status.RUNNING
        state.page_table_BxW[b] = NULL_PAGE
        state.page_table_BxW[b, :len(seq.pages)] = seq.pages

    def _decode(self, running, beside):
        """One decode step for the running sequences, and the prefill `beside` it (_prefill) in
        the same call -> {id: token} of both."""
        allowed_BxV = None      # no mask: the plain step (a None argument compiles without it)
        if any(s.mask is not None for s in running):
            allowed_BxV = np.ones((self.slots, self.cfg.vocab_size), bool)
            for s in running:
                if s.mask is not None:
                    allowed_BxV[s.slot] = s.mask(s.tokens[s.stretch:])
        later, logits_RxV, rows_R, beside_RxV = self.runner.decode(
            self.state, self.temperature, self.top_k, allowed_BxV,
            {b: (s.pending, s.cached, s.pages) for b, s in beside.items()})
        self.state.tokens_B[:] = later.tokens_B
        self.state.lengths_B[:] = later.lengths_B
        if self.keep_logits:
            logits_RxV, row = np.asarray(logits_RxV), {slot: r for r, slot in enumerate(rows_R)}
        out = {}
        for seq in running:
            token = out[seq.id] = int(self.state.tokens_B[seq.slot])
            if self.keep_logits:
                seq.logits.append(logits_RxV[row[seq.slot]])
            seq.positions += 1                             # its pending token, pushed
            self._took(seq, token)
        for seq in beside.values():                        # every pending token, pushed
            seq.positions += len(seq.pending)
            seq.pending = []
        if beside:
            out.update(self._sample_first(beside_RxV, beside))
        return out

    def _took(self, seq, token):
        """A token the sequence sampled: append it; a pause or stop token, or the limit, ends
        the stretch."""
        seq.tokens.append(token)
        seq.pending = [token]
        seq.limit -= 1
        if token in self.pause_tokens:
            self._end_stretch(seq, Status.PAUSED)
        elif token in self.stop_tokens:
            self._end_stretch(seq, Status.STOPPED)
        elif seq.limit == 0:
            self._end_stretch(seq, Status.LENGTH)

    def _end_stretch(self, seq, status):
        """Keep the slot and the pages holding positions; give back the reserved pages that
        were left empty."""
        seq.status = status
        self.state.active_B[seq.slot] = False
        self._release(seq, keep=pages_for(seq.cached, self.page_size))

    # ------------------------------------------------------------ slots, pages, checks

    def _device(self, slot):
        return slot * self.runner.n_devices // self.slots

    def _free_slot(self, seq):
        """A free slot for a sequence that has none: on the device of its pages if it kept some
        (parked), else on the device with the most free pages; None if there is no such slot."""
        free = [b for b, i in enumerate(self._in_slot) if i is None]
        if seq.pages:
            free = [b for b in free if self._device(b) == self.pool.device_of(seq.pages[0])]
        return max(free, key=lambda b: len(self.pool.free[self._device(b)]), default=None)

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

    def _check(self, tokens, limit):
        tokens = list(tokens)
        if not tokens:
            raise ValueError("no tokens: a sequence needs at least one token to predict from")
        bad = [t for t in tokens if not is_int(t) or not 0 <= t < self.cfg.vocab_size]
        # 7.9 would be stored as it is but pushed as 7; an id out of range, clamped silently
        if bad:
            raise ValueError(f"token ids {bad[:5]} are not integers in the vocabulary "
                             f"[0, {self.cfg.vocab_size})")
        if not is_int(limit) or limit < 1:
            raise ValueError(f"limit={limit!r}: a stretch must allow at least one token")
        why = self._too_long(len(tokens), limit)
        if why:
            raise ValueError(why)
        return [int(t) for t in tokens]

    def _too_long(self, n, limit):
        """Why n tokens + limit do not fit the cache, or None when they do."""
        if n + limit > self.max_len:
            return (f"{n} tokens + limit {limit} > max_len {self.max_len}: prompt longer than "
                    f"the cache")
        need = pages_for(n + limit - 1, self.page_size)
        if need > self.pool.n_pages - 1:
            return (f"{n} tokens + limit {limit} need {need} pages but the cache has "
                    f"{self.pool.n_pages - 1}: prompt longer than the cache")
        return None
