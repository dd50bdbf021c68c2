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
    waiting    the model wrote <|result|>                     -> serve() the call; deliver() its result
    running    nothing to do: the batch step below advances it

then advances every running episode by one token with a single batch.step().
Budgets per episode: at most 8 calls, at most 40 tokens written in one stretch.

An episode keeps its history (chat.Messages): the question, what the model
wrote (raw, markers included) and each result. After a result the loop sends
view(history, count): the whole history by default, or whatever an application
makes of it within a budget (tasks/context fits long episodes; count(message)
is the number of tokens the message is sent as). Batch.send keeps the cache of
the part the new view shares with the old one. A layer on top of the loop
overrides serve() and end() (tasks/context/subagents.py: `delegate`).
See docs/DESIGN.md, "The agent loop".
"""

import dataclasses

import numpy as np

from minagent import chat
from minagent.batch import ADVANCING, Batch
from minagent.cache import pages_for
from minagent.chat import MODEL, PROGRAM, Message

MAX_CALLS = 8
MAX_STRETCH = 40


@dataclasses.dataclass
class Record:
    """One finished episode."""
    status: str            # "done" (wrote <|end|>) | "stretch" (a stretch ran out) | "calls" (over max_calls)
    #                        | "max_len" (the next view would not fit the cache) | "refused" (no view fits)
    answer: str            # what the model wrote after its last <|assistant|>, without <|end|>; or the refusal
    calls: list            # [(call text, result text)]
    tokens: np.ndarray     # [T] the last view sent, and what the model wrote after it
    authors: np.ndarray    # [T] chat.PROGRAM or chat.MODEL for each token
    positions: int         # positions this episode pushed through the model
    refills: int           # of those, the ones pushed again because a view changed (not only grew)
    history: tuple         # every chat.Message of the episode: nothing cleared, nothing left out
    subagents: list = dataclasses.field(default_factory=list)   # Records of episodes it started (a layer's)


@dataclasses.dataclass(eq=False)
class Episode:
    seq: int               # its sequence in the batch
    toolbox: object        # call text -> result text
    history: tuple         # chat.Messages
    authors: list          # of the sequence's tokens, up to what the model is writing now
    encoded: dict          # Message -> (token ids, author): how each message is sent
    calls: list = dataclasses.field(default_factory=list)
    call: str | None = None          # the call being served: the episode waits for its result
    record: Record | None = None     # once it has ended


class Refused(Exception):
    """Raised by a view function when no view of the history fits: the episode ends, refused."""


def whole(history, count):
    """The default view: the whole history."""
    return history


def new_batch(params, cfg, tok, fmt, *, slots=32, max_len=512, page_size=16, holders=None, **batch_kw):
    """A Batch for the loop: it pauses on fmt.result and stops on fmt.end.

    Its pool has room for `holders` sequences of max_len at once (default: one per slot), so none
    waits for pages while nothing runs to free them. batch_kw go to Batch (cache, temperature, ...).
    """
    n_pages = (holders or slots) * pages_for(max_len, page_size) + 1             # + the null page
    return Batch(params, cfg, slots=slots, n_pages=n_pages, page_size=page_size, max_len=max_len,
                 pause_tokens=[tok.special(fmt.result)], stop_tokens=[tok.special(fmt.end)], **batch_kw)


def opening(fmt, prompt, system=None):
    """A prompt -> (the history's first message, the Segment the episode opens with).

    A question (str) opens with chat.prompt(fmt, question, system). A Segment (written by the
    program, system text included) is sent as it is; its first message is its text without the
    format's markers.
    """
    if isinstance(prompt, str):
        return Message("first", prompt), chat.prompt(fmt, prompt, system=system)
    if system is not None:
        raise ValueError("a Segment prompt is sent as it is: write the system text into it")
    return Message("first", prompt.text.removeprefix(fmt.user).removesuffix(fmt.assistant)), prompt


class Loop:
    """Episodes in one batch. start() each, then run() until all have ended; each ends with a Record."""

    def __init__(self, batch, tok, fmt, *, view=whole, max_calls=MAX_CALLS, max_stretch=MAX_STRETCH):
        self.call_id, self.result_id, self.end_id = (tok.special(s) for s in (fmt.call, fmt.result, fmt.end))
        if batch.pause_tokens != {self.result_id} or self.end_id not in batch.stop_tokens:
            raise ValueError(f"the batch must pause on {fmt.result} and stop on {fmt.end}: build it with new_batch")
        if max_calls < 0 or max_stretch < 1:
            raise ValueError(f"max_calls={max_calls}, max_stretch={max_stretch}: need >= 0 and >= 1")
        self.batch, self.tok, self.fmt, self.view = batch, tok, fmt, view
        self.max_calls, self.max_stretch = max_calls, max_stretch
        self.live = []

    def start(self, prompt, toolbox, system=None):
        """A new episode, queued in the batch -> its Episode."""
        first, segment = opening(self.fmt, prompt, system)
        ids = self.tok.encode(segment.text)
        ep = Episode(self.batch.add(ids, self.max_stretch), toolbox, (first,), [PROGRAM] * len(ids),
                     {first: (ids, PROGRAM)})
        self.live.append(ep)
        return ep

    def run(self):
        """Advance every live episode until all have ended: the loop's state machine."""
        while self.live:
            for ep in list(self.live):
                status = self.batch.seqs[ep.seq].status
                if ep.call is not None or status in ADVANCING:     # waiting for a tool, or running
                    continue
                if status == "stopped":                            # finished: it wrote <|end|>
                    self.end(ep, "done", self.written(ep))
                elif status == "length":                           # finished: its stretch ran out
                    self.end(ep, "stretch")
                elif len(ep.calls) == self.max_calls:              # paused on a call over the budget
                    self.end(ep, "calls")
                else:                                              # paused on a call: serve it
                    ep.call = self.written(ep, after=self.call_id)
                    self.serve(ep, ep.call)
            if self.batch.running():
                self.batch.step()                                  # running: one token each

    def serve(self, ep, call):
        """Run the call with the episode's toolbox and deliver the result (a layer may do otherwise)."""
        self.deliver(ep, ep.toolbox(call))

    def deliver(self, ep, result):
        """The result of the episode's call: add it to the history, send the next view, resume."""
        ep.calls.append((ep.call, result))
        ep.call = None
        self.note_written(ep)
        ep.history += (Message("result", result),)
        try:
            view = self.view(ep.history, lambda m: len(self.encode(ep, m)[0]))
        except Refused as refusal:                                 # not retried: it would be refused again
            return self.end(ep, "refused", str(refusal))
        sent = [self.encode(ep, m) for m in view]
        ids = [t for tokens, _ in sent for t in tokens]
        if not self.batch.fits(len(ids), self.max_stretch):
            return self.end(ep, "max_len")
        self.batch.send(ep.seq, ids, self.max_stretch)             # keeps the cache of the unchanged start
        ep.authors = [author for tokens, author in sent for _ in tokens]

    def end(self, ep, status, answer=""):
        """Free the episode's sequence and keep its Record."""
        self.live.remove(ep)
        self.note_written(ep)
        self.batch.finish(ep.seq)
        seq = self.batch.seqs[ep.seq]
        ep.record = Record(status, answer, ep.calls, np.asarray(seq.tokens, np.int32),
                           np.asarray(ep.authors, np.uint8), seq.positions, seq.refilled, ep.history)

    # ------------------------------------------------------------ helpers

    def encode(self, ep, m):
        """How message m is sent -> (ids, author). The opening and the model's words keep the tokens they
        were, so a new view starts with exactly the tokens of the old one up to its first change."""
        if m not in ep.encoded:
            segment = chat.render_message(m, self.fmt)
            ep.encoded[m] = (self.tok.encode(segment.text), segment.author)
        return ep.encoded[m]

    def written(self, ep, after=None):
        """What the model wrote since the program last wrote, as text: from its last `after` token
        on if there is one (the call after <|call|>), without the <|result|> / <|end|> it ended on."""
        ids = self.batch.seqs[ep.seq].tokens[len(ep.authors):]
        if after in ids:
            ids = ids[len(ids) - ids[::-1].index(after):]
        return self.tok.decode([t for t in ids if t not in (self.result_id, self.end_id)]).strip()

    def note_written(self, ep):
        """Put the model's newest words into the history, raw, with the tokens they were."""
        ids = self.batch.seqs[ep.seq].tokens[len(ep.authors):]
        if ids:
            said = Message("model", self.tok.decode(ids))
            ep.encoded.setdefault(said, (ids, MODEL))
            ep.history += (said,)
            ep.authors += [MODEL] * len(ids)


def run(batch, tok, fmt, prompts, toolboxes, *, system=None, view=whole, max_calls=MAX_CALLS,
        max_stretch=MAX_STRETCH):
    """One episode per prompt, toolboxes[i] serving prompt i's calls -> [Record], in the prompts' order.

    A prompt is a question (str; it opens with `system` if given) or a chat.Segment the program
    writes. view(history, count) -> the messages to send after each result (see the module doc).
    """
    if len(prompts) != len(toolboxes):
        raise ValueError(f"{len(prompts)} prompts but {len(toolboxes)} toolboxes: one toolbox per episode")
    loop = Loop(batch, tok, fmt, view=view, max_calls=max_calls, max_stretch=max_stretch)
    episodes = [loop.start(prompt, box, system) for prompt, box in zip(prompts, toolboxes)]
    loop.run()
    return [ep.record for ep in episodes]
