"""The agent loop: many episodes advanced together in one batch.

An agent is a model in a loop. The model writes; when it writes
`<|call|>add 4821 3907<|result|>` its sequence pauses (`<|result|>` is a pause
token of the batch), the loop runs the call, appends the result and
`<|assistant|>`, and resumes it. Only those appended tokens go through the
model: everything before is in the paged cache.

    batch = agent.new_batch(params, cfg, tok, chat.MINAGENT, slots=32, max_len=512)
    records = agent.run(batch, tok, chat.MINAGENT, ["What is 4821 + 3907?"], [Toolbox(seed=0)])
    records[0].answer, records[0].calls     -> "8728", [("add 4821 3907", "8728")]

Each turn the loop looks once at every live episode, a small state machine:

    finished   the model wrote <|end|>, or ran past a budget  -> end(): record it
    waiting    the model wrote <|result|>                     -> serve() hands the call to a worker;
               once it answers (or times out)                 -> deliver() its result, resume
    running    nothing to do: the batch step below advances it

then advances every running episode by one token with a single batch.step()
(an episode alone in the loop: its whole stretch in one call, batch.steps).
A call runs beside the batch: while one episode waits for its tool, the others
go on. The loop's promises (each checked by tests/engine/test_loop_contract.py):
  - A tool that raises, hangs or answers something else than text gives its episode
    an `error: ...` result, and no other episode notices.
  - A call's time limit starts when a worker starts it, not while it waits for one;
    by default there is a worker for every slot, a worker stuck in a hung tool is
    replaced, and a hung tool does not keep the process alive once run() returns.
  - KeyboardInterrupt and SystemExit, raised by a tool or not, end the run: they are
    not turned into results, and the run frees every page it holds before they go on.
  - Each message keeps the ids it was sent or sampled as, whatever its text: two
    model turns with the same text and other ids stay apart.
  - Text is text: whatever a result, a prompt or a system text holds (special-token
    spellings, lone surrogates), it is sent as ordinary text and nothing raises.
  - A view that cannot be sent (Refused, or no message at all) ends that episode as
    "refused"; the others go on.
Budgets per episode: at most 8 calls, at most 40 tokens written in one stretch.

An episode keeps its history (chat.Messages): the question, what the model
wrote and each result. After a result the loop sends view(history, count): the
whole history, or what an application makes of it within a budget (count(m):
the tokens message m is sent as). Batch.send keeps the cache of the part the
new view shares with the old. A layer overrides serve() and end()
(tasks/context/subagents.py). See docs/engine.md, "The agent loop".
"""

import concurrent.futures
import dataclasses
import queue
import threading
import time

import numpy as np

from minagent import chat
from minagent.batch import ADVANCING, Batch, Status, Stuck, check_int
from minagent.cache import pages_for
from minagent.chat import MODEL, PROGRAM, Message

MAX_CALLS = 8
MAX_STRETCH = 40
WORKERS = None     # threads that run tool calls beside the batch (None: one per slot of the batch)
TIMEOUT = 60.0     # seconds a call may take before the episode reads "error: ... timed out"


@dataclasses.dataclass
class Record:
    """One finished episode."""
    status: str            # "done" (wrote <|end|>) | "stretch" (a stretch ran out)
    #                        | "calls" (over max_calls) | "max_len" (the next view would not fit
    #                        the cache) | "refused" (no view fits)
    answer: str            # what the model wrote after its last <|assistant|>, without <|end|>;
    #                        or the refusal
    calls: list            # [(call text, result text)]
    tokens: np.ndarray     # [T] the last view sent, and what the model wrote after it
    authors: np.ndarray    # [T] chat.PROGRAM or chat.MODEL for each token
    positions: int         # positions this episode pushed through the model
    refills: int           # of those, the ones pushed again because a view changed (not only grew)
    history: tuple         # every chat.Message of the episode: nothing cleared, nothing left out
    # Records of the episodes it started (a layer's)
    subagents: list = dataclasses.field(default_factory=list)


def tool_result(future, call, timeout):
    """What the model reads for a call that ran beside the batch: the tool's text, or an error
    it can read if the tool raised, answered something else than text, or is still running past
    its timeout. A KeyboardInterrupt or SystemExit the tool raised is raised again here: it is
    not a result."""
    name = (call.split() or ["tool"])[0][:16]
    if not future.done():
        return f"error: {name} timed out after {timeout:g} s"
    error = future.exception()
    if error is not None and not isinstance(error, Exception):
        raise error
    if error is not None:
        return f"error: {name} failed ({type(error).__name__})"
    result = future.result()
    if not isinstance(result, str):
        return f"error: {name} returned {type(result).__name__}, not text"
    return result


@dataclasses.dataclass(eq=False)
class Job:
    """One call given to the Workers: its Future, and when a worker started it (None while
    queued)."""
    fn: object
    arg: str
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    started: float | None = None


class Workers:
    """Threads that run tool calls beside the batch: submit(fn, arg) -> a Job.

    A job's clock starts when a worker takes it from the queue, so a call never times out while it
    waits for a worker. A worker whose call ran past its time is given up (abandon) and replaced
    at once: a hung tool holds one thread, never the pool. The threads are daemons, so a tool
    still hung when the program ends does not keep the process alive (a ThreadPoolExecutor's
    threads are joined at exit).
    """

    def __init__(self, n):
        self.queue, self.lock = queue.SimpleQueue(), threading.Lock()
        self.n, self.given_up = n, set()
        for _ in range(n):
            self._spawn()

    def _spawn(self):
        threading.Thread(target=self._work, daemon=True).start()

    def _work(self):
        while (job := self.queue.get()) is not None:
            job.started = time.monotonic()
            try:
                job.future.set_result(job.fn(job.arg))
            except BaseException as e:    # KeyboardInterrupt too: tool_result raises it in the loop
                job.future.set_exception(e)
            with self.lock:
                if job in self.given_up:  # replaced already: this thread leaves
                    self.given_up.discard(job)
                    return

    def submit(self, fn, arg):
        job = Job(fn, arg)
        self.queue.put(job)
        return job

    def abandon(self, job):
        """Give up a job past its time: its worker is replaced now, and leaves if the tool ever
        returns."""
        with self.lock:
            if not job.future.done() and job not in self.given_up:
                self.given_up.add(job)
                self._spawn()

    def close(self):
        """Let every idle worker leave (one that is stuck in a tool leaves when it returns, if
        ever)."""
        for _ in range(self.n):
            self.queue.put(None)


@dataclasses.dataclass(eq=False)
class Episode:
    seq: int               # its sequence in the batch
    toolbox: object        # call text -> result text
    history: tuple         # chat.Messages
    authors: list          # of the sequence's tokens, up to what the model is writing now
    encoded: dict          # id(Message) -> (Message, token ids, author): how each message is sent
    calls: list = dataclasses.field(default_factory=list)
    call: str | None = None          # the call being served: the episode waits for its result
    job: Job | None = None           # the call's Job, while a worker has it
    record: Record | None = None     # once it has ended


class Refused(Exception):
    """Raised by a view function when no view of the history fits: the episode ends, refused."""


def whole(history, count):
    """The default view: the whole history."""
    return history


def new_batch(params, cfg, tok, fmt, *, slots=32, max_len=512, page_size=16, holders=None,
              **batch_kw):
    """A Batch for the loop: it pauses on fmt.result and stops on fmt.end. Its pool has room for
    `holders` sequences of max_len at once (default: one per slot). batch_kw go to Batch
    (temperature, runner, ...). On a mesh of D devices each device holds the pages of its share
    of them, holders / D."""
    mesh = batch_kw["runner"].mesh if "runner" in batch_kw else None
    D = 1 if mesh is None else mesh.size
    # on each device: pages for its share of the holders, + its null page
    n_pages = -(-(holders or slots) // D) * pages_for(max_len, page_size) + 1
    return Batch(params, cfg, slots=slots, n_pages=n_pages, page_size=page_size,
                 max_len=max_len, pause_tokens=[tok.special(fmt.result)],
                 stop_tokens=[tok.special(fmt.end)], **batch_kw)


class Loop:
    """Episodes in one batch. start() each, then run() until all have ended; each ends with a
    Record. Each call runs in one of `workers` threads (None: one per slot), `timeout` seconds
    at most from when a worker starts it, while the batch steps the other episodes. With
    workers=0 the loop waits for each call, as if it ran inline (to compare)."""

    def __init__(self, batch, tok, fmt, *, view=whole, max_calls=MAX_CALLS, max_stretch=MAX_STRETCH,
                 workers=WORKERS, timeout=TIMEOUT):
        self.call_id, self.result_id, self.end_id = (
            tok.special(s) for s in (fmt.call, fmt.result, fmt.end))
        if batch.pause_tokens != {self.result_id} or self.end_id not in batch.stop_tokens:
            raise ValueError(f"the batch must pause on {fmt.result} and stop on {fmt.end}: build "
                             f"it with new_batch")
        workers = batch.slots if workers is None else workers
        for name, value, least in (("max_calls", max_calls, 0), ("max_stretch", max_stretch, 1),
                                   ("workers", workers, 0)):
            check_int(name, value, least)
        if not timeout > 0:
            raise ValueError(f"timeout={timeout!r}: seconds, > 0")
        self.batch, self.tok, self.fmt, self.view = batch, tok, fmt, view
        self.max_calls, self.max_stretch = max_calls, max_stretch
        self.workers, self.timeout = workers, timeout
        self.live, self.pool = [], None        # the Workers, while run() runs

    def start(self, prompt, toolbox, system=None):
        """A new episode, queued in the batch -> its Episode."""
        first, segment = chat.opening(self.fmt, prompt, system)
        ids = chat.encode(self.tok, segment)
        ep = Episode(self.batch.add(ids, self.max_stretch), toolbox, (first,), [PROGRAM] * len(ids),
                     {id(first): (first, ids, PROGRAM)})
        self.live.append(ep)
        return ep

    def run(self):
        """Advance every live episode until all have ended: the loop's state machine."""
        self.pool = Workers(max(self.workers, 1))
        try:
            while self.live:
                for ep in list(self.live):
                    status = self.batch.seqs[ep.seq].status
                    if ep.call is not None:                # waiting for a tool: has it answered?
                        if ep.job is not None and (ep.job.future.done() or self.late(ep.job)):
                            self.pool.abandon(ep.job)      # a no-op if it answered
                            self.deliver(ep, tool_result(ep.job.future, ep.call, self.timeout))
                    elif status in ADVANCING:              # running
                        continue
                    elif status is Status.STOPPED:         # finished: it wrote <|end|>
                        self.end(ep, "done", self.written(ep))
                    elif status is Status.LENGTH:          # finished: its stretch ran out
                        self.end(ep, "stretch")
                    elif len(ep.calls) == self.max_calls:  # paused on a call over the budget
                        self.end(ep, "calls")
                    else:                                  # paused on a call: serve it
                        ep.call = self.written(ep, after=self.call_id)
                        self.serve(ep, ep.call)
                if not self.step():                        # running: one token each
                    self.wait()                            # or nothing can run until a tool answers
        finally:        # normally none is live here; after an exception, free their pages
            for ep in self.live:
                self.batch.finish(ep.seq)
            self.live = []
            self.pool.close()

    def serve(self, ep, call):
        """Start the call in a worker; run() delivers its result. (A layer may serve a call
        otherwise, and deliver() its result itself.) With workers=0 the loop waits for it, as if
        run inline."""
        ep.job = self.pool.submit(ep.toolbox, call)
        if not self.workers:
            while not (ep.job.future.done() or self.late(ep.job)):
                concurrent.futures.wait([ep.job.future], timeout=self.timeout / 20)
            self.pool.abandon(ep.job)          # if it hung: the next call gets a fresh worker

    def late(self, job):
        """Whether the job has run past its time limit, counted from when a worker started it."""
        return job.started is not None and time.monotonic() > job.started + self.timeout

    def step(self):
        """One batch call -> False if no sequence took a token: none runs, or each slot holds an
        episode waiting for its tool while the queued ones wait for a slot.

        One token for each running episode; but an episode alone in the loop writes its whole
        stretch in one call (Batch.steps): no other episode can need the host before it pauses
        or stops, and a trip to the host between its tokens costs up to a quarter of the step
        (SmolLM2 int8, one sequence, 2 cores of an AMD EPYC Zen 4: 8.6-10.2 ms a token one step a
        call, 7.3-9.7 in calls of 16). The same tokens either way."""
        try:
            if len(self.live) == 1:
                return bool(self.batch.steps(self.max_stretch))
            return bool(self.batch.step())
        except Stuck:
            if not any(ep.job is not None for ep in self.live):     # no tool will ever free a slot
                raise
            return False

    def wait(self):
        """Sleep until the first tool in flight answers, or the first time limit passes. A queued
        job has no time limit yet: it starts as a worker frees, so the sleep is at most one
        timeout."""
        # every job in flight, with any that answered since run() looked
        jobs = [ep.job for ep in self.live if ep.job is not None]
        if jobs:
            ends = [job.started + self.timeout for job in jobs if job.started is not None]
            until = min(ends, default=time.monotonic() + self.timeout) - time.monotonic()
            concurrent.futures.wait([job.future for job in jobs], timeout=max(until, 0),
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    def deliver(self, ep, result):
        """The result of the episode's call: add it to the history, send the next view, resume."""
        ep.calls.append((ep.call, result))
        ep.call = ep.job = None
        self.note_written(ep)
        ep.history += (Message("result", result),)
        try:
            view = self.view(ep.history, lambda m: len(self.encode(ep, m)[0]))
        except Refused as refusal:                       # not retried: it would be refused again
            return self.end(ep, "refused", str(refusal))
        if not view:
            return self.end(ep, "refused", "the view holds no message")
        sent = [self.encode(ep, m) for m in view]
        ids = [t for tokens, _ in sent for t in tokens]
        if not self.batch.fits(len(ids), self.max_stretch):
            return self.end(ep, "max_len")
        self.batch.send(ep.seq, ids, self.max_stretch)   # keeps the cache of the unchanged start
        ep.authors = [author for tokens, author in sent for _ in tokens]

    def end(self, ep, status, answer=""):
        """Free the episode's sequence and keep its Record."""
        self.live.remove(ep)
        self.note_written(ep)
        self.batch.finish(ep.seq)
        seq = self.batch.seqs[ep.seq]
        ep.record = Record(status, answer, ep.calls, np.asarray(seq.tokens, np.int32),
                           np.asarray(ep.authors, np.uint8), seq.positions, seq.refilled,
                           ep.history)

    # ------------------------------------------------------------ helpers

    def encode(self, ep, m):
        """How message m is sent -> (ids, author). The opening and the model's words keep the
        tokens they were, so a new view starts with exactly the tokens of the old one up to its
        first change."""
        # By identity: two messages of the same text keep their own ids. The entry holds m, so
        # its id stays its own (no other object can be given it while m lives).
        if id(m) not in ep.encoded:
            segment = chat.render_message(m, self.fmt)
            ep.encoded[id(m)] = (m, chat.encode(self.tok, segment), segment.author)
        return ep.encoded[id(m)][1:]

    def written(self, ep, after=None):
        """What the model wrote since the program last wrote, as text: from its last `after`
        token on if there is one (the call after <|call|>), without the <|result|> / <|end|> it
        ended on."""
        ids = self.batch.seqs[ep.seq].tokens[len(ep.authors):]
        if after in ids:
            ids = ids[len(ids) - ids[::-1].index(after):]
        return self.tok.decode([t for t in ids if t not in (self.result_id, self.end_id)]).strip()

    def note_written(self, ep):
        """Put the model's newest words into the history, raw, with the tokens they were."""
        ids = self.batch.seqs[ep.seq].tokens[len(ep.authors):]
        if ids:
            said = Message("model", self.tok.decode(ids))
            ep.encoded[id(said)] = (said, ids, MODEL)
            ep.history += (said,)
            ep.authors += [MODEL] * len(ids)


def run(batch, tok, fmt, prompts, toolboxes, *, system=None, view=whole, max_calls=MAX_CALLS,
        max_stretch=MAX_STRETCH, workers=WORKERS, timeout=TIMEOUT):
    """One episode per prompt, toolboxes[i] serving prompt i's calls -> [Record], in the
    prompts' order.

    A prompt is a question (str; it opens with `system` if given) or a chat.Segment the
    program writes. A toolbox is any callable, call text -> result text; it runs in one of
    `workers` threads, `timeout` seconds at most (Loop). view(history, count) -> the messages
    to send after each result (see the module doc).
    """
    if len(prompts) != len(toolboxes):
        raise ValueError(f"{len(prompts)} prompts but {len(toolboxes)} toolboxes: one toolbox "
                         f"per episode")
    if not all(callable(box) for box in toolboxes):
        raise ValueError("every toolbox must be callable: call text -> result text")
    loop = Loop(batch, tok, fmt, view=view, max_calls=max_calls, max_stretch=max_stretch,
                workers=workers, timeout=timeout)
    episodes = [loop.start(prompt, box, system) for prompt, box in zip(prompts, toolboxes)]
    loop.run()
    return [ep.record for ep in episodes]
