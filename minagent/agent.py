"""The agent loop: many episodes advanced together in one batch.

An agent is a model in a loop. The model writes; when it writes
`<|call|> add 4821 3907 <|result|>` its sequence pauses (`<|result|>` is a
pause token of the batch), the loop runs the call, appends the result and
`<|assistant|>`, and resumes it. Only those appended tokens go through the
model: everything before is in the paged cache.

Each turn of the loop looks at every live episode once, a small state machine:

    finished   the model wrote <|end|>, or ran past a budget -> record
    waiting    the model wrote <|result|> -> run the call, send the result, resume
    delegated  it called `delegate BRIEF` -> a sub-agent runs; the episode waits, parked
    running    nothing to do: the batch step below advances it

then advances all running episodes by one token with a single `batch.step()`.

Budgets per episode (the design documents' numbers): at most 8 calls, at most
40 tokens written in one stretch between two results.

Context (SPEC, part 2). Each episode keeps its **history**, a tuple of
context.Message: the question, then what the model wrote (raw, markers
included) and each result. With a `budget`, what is sent after each result is
the view context.fit computes from the whole history. When that view changes
other than at its end (an old result cleared), the sequence is rewritten
(Batch.rewrite): the cache of the unchanged start is kept, the rest pushed
again. The history itself keeps everything, and goes into the Record.

Sub-agents (run(..., subagents=True)). `<|call|>delegate Read ch01 and summarise it<|result|>`
starts a sub-agent in the same batch: its only user message is the brief, its answer
comes back to the caller as the call's result. The caller waits parked: its
slot is free for the sub-agent, its pages keep its cache.
"""

import dataclasses

import numpy as np

from minagent import chat, context
from minagent.batch import Batch
from minagent.cache import pages_for
from minagent.context import Message
from minagent.tools import Toolbox, no_specials

MAX_CALLS = 8
MAX_STRETCH = 40
DELEGATE = "delegate"   # the call the loop serves itself: "delegate BRIEF"
MAX_DEPTH = 1           # with subagents=True: sub-agents of sub-agents: none
MAX_SUBAGENTS = 8       # per episode of `prompts`, its sub-agents' own included
FITTINGS = {"fit": context.fit, "old": context.old_trim}


@dataclasses.dataclass
class Record:
    """One finished episode."""
    status: str            # "done" (wrote <|end|>) | "stretch" (40 tokens without end) | "calls" (over 8 calls)
    #                        | "max_len" (the next view would not fit the cache) | "refused" (no view fits the budget)
    answer: str            # what the model wrote after its last <|assistant|>, without <|end|>; or the refusal
    calls: list            # [(call text, result text)]
    tokens: np.ndarray     # [T] the last view sent, and what the model wrote after it
    authors: np.ndarray    # [T] chat.PROGRAM or chat.MODEL for each token
    positions: int         # positions this episode pushed through the model
    history: tuple = ()    # every context.Message of the episode: nothing cleared, nothing left out
    refills: int = 0       # of the positions, those pushed by rewrites (a view that changed)
    view_steps: list = dataclasses.field(default_factory=list)   # context.fit's step after each result
    subagents: list = dataclasses.field(default_factory=list)    # Records of the sub-agents it started
    depth: int = 0         # 0 for an episode of `prompts`, 1 for a sub-agent, ...


@dataclasses.dataclass
class _Episode:
    seq: int
    toolbox: Toolbox
    authors: list          # of the sequence's tokens, up to what the model is writing now
    history: tuple         # of context.Message
    known: dict            # Message -> (tokens, author): how each message is sent
    depth: int = 0
    root: int = 0          # the episode of `prompts` it works for
    parent: int | None = None
    waiting: int | None = None     # the sub-agent it waits for
    call: str = ""                 # the call it waits on
    calls: list = dataclasses.field(default_factory=list)
    view_steps: list = dataclasses.field(default_factory=list)
    subagents: list = dataclasses.field(default_factory=list)


def opening(fmt, prompt, system=None):
    """A prompt -> (the history's first message, the Segment the episode opens with).

    A question (str) opens with chat.prompt(fmt, question, system). A Segment is sent as it
    is; its first message is its text without the format's markers: "<|user|>Hi<|assistant|>" -> "Hi".
    """
    if isinstance(prompt, str):
        return Message("first", prompt), chat.prompt(fmt, prompt, system=system)
    return Message("first", prompt.text.removeprefix(fmt.user).removesuffix(fmt.assistant)), prompt


def delegation(call, depth, started, max_depth=MAX_DEPTH, max_subagents=MAX_SUBAGENTS):
    """-> (brief, error): ("B", None) to start a sub-agent on brief B, (None, "error: ...") for a
    delegate call over a limit, (None, None) for any other call (the toolbox's)."""
    parts = call.split(None, 1)     # as Toolbox._run: "delegate\tRead ch01" -> ["delegate", "Read ch01"]
    if not parts or parts[0] != DELEGATE:
        return None, None
    brief = parts[1] if len(parts) == 2 else ""
    if depth >= max_depth:
        return None, f"error: a sub-agent at depth {depth} cannot delegate (max depth {max_depth})"
    if started >= max_subagents:
        return None, f"error: no more sub-agents, {max_subagents} already started"
    if not brief.strip():
        return None, "error: delegate takes a brief"
    return no_specials(brief.strip()), None


def subagent_result(record):
    """What the caller of `delegate` reads: the sub-agent's answer, its refusal, or an error."""
    if record.status in ("done", "refused"):
        return no_specials(record.answer)
    return f"error: the sub-agent stopped without an answer ({record.status})"


def run(params, cfg, tok, fmt, prompts, toolboxes, *, slots=32, max_calls=MAX_CALLS,
        max_stretch=MAX_STRETCH, cache=True, n_pages=None, page_size=16, max_len=512,
        temperature=0.0, seed=0, batch=None, system=None, budget=None, fitting="fit",
        subagents=False, max_depth=MAX_DEPTH, max_subagents=MAX_SUBAGENTS):
    """Run one episode per prompt -> (records, batch); records[i] is prompt i's, sub-agents' in its .subagents.

    A prompt is a question (str; it opens with `system`, e.g. context.INSTRUCTIONS) or a
    chat.Segment the program writes. toolboxes[i] serves the calls of episode i. With
    subagents=True the loop serves one more tool itself, `delegate BRIEF`: a sub-agent that
    opens with `system` and its brief, and uses its caller's toolbox (limits: max_depth,
    max_subagents); without, a delegate call goes to the toolbox like any other. With a `budget` (in
    tokens), the view sent after each result is FITTINGS[fitting](history, budget, count),
    where count(message) is exactly the number of tokens the message is sent as. Pass `batch`
    to reuse a warm Batch across runs; the default n_pages leaves room for parked callers.
    """
    call_id, result_id, end_id = tok.special(fmt.call), tok.special(fmt.result), tok.special(fmt.end)
    if fitting not in FITTINGS:
        raise ValueError(f"fitting={fitting!r}: expected one of {list(FITTINGS)}")
    fitter = FITTINGS[fitting]
    if batch is None:
        # The default pool: room for every sequence that can hold pages at once, each up to max_len, so
        # none waits for pages while nothing runs to free them. That is at most `slots` sequences in a slot,
        # plus the parked ones: a caller waiting for its sub-agent keeps its pages without a slot (and after
        # its resume, until it gets one back). The live episodes of one prompt form a chain (each waits for
        # one sub-agent at most), and each parked one started a sub-agent, at its own depth < max_depth:
        # at most min(max_depth, max_subagents) per prompt, and every prompt's can be parked at once (a
        # freed slot goes to the next queued episode, whoever's). slots=1, 2 prompts, 4 pages of max_len:
        # (1 + 2 * 1) * 4 + 1 (the null page) = 13 pages. Without sub-agents (the default): slots * 4 + 1.
        holders = slots + (len(prompts) * min(max_depth, max_subagents) if subagents else 0)
        n_pages = n_pages or holders * pages_for(max_len, page_size) + 1
        batch = Batch(params, cfg, slots=slots, n_pages=n_pages, page_size=page_size, max_len=max_len,
                      stop_tokens=(end_id,), pause_tokens=(result_id,), cache=cache,
                      temperature=temperature, seed=seed)
    live, records, started = {}, [None] * len(prompts), [0] * len(prompts)

    def opened(prompt):
        """-> (the history's first message, the tokens the episode opens with)."""
        first, segment = opening(fmt, prompt, system)
        return first, tok.encode(segment.text)

    def begin(key, first, ids, toolbox, **where):
        live[key] = _Episode(batch.add(ids, max_stretch), toolbox, [chat.PROGRAM] * len(ids), (first,),
                             {first: (ids, chat.PROGRAM)}, **where)

    def encoded(ep, m):
        """How message m is sent: the tokens written, for the opening and the model's words (so a
        new view starts with exactly the tokens of the old one up to its first change), else encoded."""
        if m not in ep.known:
            segment = context.render_message(m, fmt)
            ep.known[m] = (tok.encode(segment.text), segment.author)
        return ep.known[m]

    def written(ep, after=None):
        """What the model wrote since the program last wrote, as text: from its last `after` token
        on if there is one (the call after <|call|>), without the <|result|> / <|end|> it ended on."""
        ids = batch.tokens(ep.seq)[len(ep.authors):]
        if after in ids:
            ids = ids[len(ids) - ids[::-1].index(after):]
        return tok.decode([t for t in ids if t not in (result_id, end_id)]).strip()

    def note_written(ep):
        """Put the model's newest words into the history, raw, with the tokens they were."""
        ids = batch.tokens(ep.seq)[len(ep.authors):]
        if ids:
            said = Message("model", tok.decode(ids))
            ep.known.setdefault(said, (ids, chat.MODEL))
            ep.history += (said,)
            ep.authors += [chat.MODEL] * len(ids)

    def end(key, status, answer=""):
        ep = live.pop(key)
        note_written(ep)
        batch.finish(ep.seq)
        record = Record(status, answer, ep.calls, np.asarray(batch.tokens(ep.seq), np.int32),
                        np.asarray(ep.authors, np.uint8), batch.positions[ep.seq], ep.history,
                        batch.reprefilled[ep.seq], ep.view_steps, ep.subagents, ep.depth)
        if ep.parent is None:
            records[key] = record
        else:                                                       # the caller reads the outcome
            parent = live[ep.parent]
            parent.subagents.append(record)
            parent.waiting = None
            reply(ep.parent, parent, parent.call, subagent_result(record))

    def reply(key, ep, call, result):
        """Send the result of `call`: the next view of the history, within the budget if there is one."""
        ep.calls.append((call, result))
        note_written(ep)
        ep.history += (Message("result", result),)
        view = ep.history
        if budget is not None:
            fitted = fitter(ep.history, budget, lambda m: len(encoded(ep, m)[0]))
            ep.view_steps.append(fitted.step)
            if fitted.refused:                                      # not retried: it would be refused again
                return end(key, "refused", context.REFUSAL_MESSAGE)
            view = fitted.view
        sent = [encoded(ep, m) for m in view]
        ids = [t for tokens, _ in sent for t in tokens]
        if not batch.fits(len(ids), max_stretch):
            return end(key, "max_len")
        now = batch.tokens(ep.seq)
        if len(ids) > len(now) and ids[:len(now)] == now:          # the same view, one round longer
            batch.resume(ep.seq, ids[len(now):], max_stretch)
        else:                                                       # a changed view: keep the common start
            batch.rewrite(ep.seq, ids, max_stretch)                 # adds what it pushes again to reprefilled
        ep.authors = [author for tokens, author in sent for _ in tokens]

    def delegate(key, ep, call, brief):
        first, ids = opened(brief)
        if not batch.fits(len(ids), max_stretch):
            return reply(key, ep, call, "error: the brief is too long")
        started[ep.root] += 1
        sub = len(prompts) + sum(started) - 1                       # a key no other episode has
        begin(sub, first, ids, ep.toolbox, depth=ep.depth + 1, root=ep.root, parent=key)
        ep.waiting, ep.call = sub, call
        batch.park(ep.seq)                                          # its slot is free while it waits

    for i, (prompt, toolbox) in enumerate(zip(prompts, toolboxes)):
        begin(i, *opened(prompt), toolbox, root=i)
    while live:
        for key, ep in list(live.items()):
            if key not in live or ep.waiting is not None:          # ended meanwhile, or delegated
                continue
            state = batch.status(ep.seq)
            if state == "stopped":                                  # finished: wrote <|end|>
                end(key, "done", written(ep))
            elif state == "length":                                 # finished: stretch budget spent
                end(key, "stretch")
            elif state == "paused":                                 # waiting for a tool
                if len(ep.calls) == max_calls:
                    end(key, "calls")
                    continue
                call = written(ep, after=call_id)
                brief, error = (delegation(call, ep.depth, started[ep.root], max_depth, max_subagents)
                                if subagents else (None, None))
                if brief is None:
                    reply(key, ep, call, error or ep.toolbox(call))
                else:
                    delegate(key, ep, call, brief)
        if live:
            batch.step()                                            # running: one token each
    return records, batch


def every_record(records):
    """The records and, after each, its sub-agents' records, depth first."""
    for r in records:
        yield r
        yield from every_record(r.subagents)
