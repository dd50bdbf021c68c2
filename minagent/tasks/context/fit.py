"""Keeping a long agent turn inside the context window: the view of a history sent within a budget.

An episode's **history** is every message so far, a tuple of immutable chat.Messages:

    first   the first user message, or a sub-agent's brief
    user    a later user turn
    model   what the model wrote, raw: a call with its markers "<|call|>cat ch01.txt<|result|>",
            or an answer with its end marker "Done.<|end|>"
    result  a tool result, always right after the "model" message that holds its call

A call and its result form a **round**; a user message and everything after it, up to
the next user message, form a **turn**. A sub-agent has one turn: its brief, then
rounds. What is sent to the model is a **view** computed from the history by `fit`.
The history itself is never changed: it keeps everything, and the next view is
computed from all of it again.

`fit` tries three steps, each only if the one before was not enough (docs/applications.md, "Context"):

  1. clear the oldest tool results, four at a time: each becomes CLEARED_NOTE;
  2. keep whole user turns: the first message, TRIMMED_NOTE, the newest turns that fit;
  3. keep whole tool rounds: the first message, TRIMMED_NOTE, the newest rounds that fit
     (in a later turn, also the user message that opened it: the request being worked on).

Steps 2 and 3 work on the history as step 1 left it, with every clearable result
cleared. A round is never split: a view holds a call and its result, or neither.
If even the newest round does not fit, the request is refused (step -1) and the
person reads REFUSAL_MESSAGE.

Worked example, budget 100, a note counted as 5 tokens. The history is a first
message (10 tokens) and six rounds of a call (2) and a result (20): 142 tokens.
A quarter of the budget is 25, so only the newest result stays whole (a second
one would make 40). Results r1..r5 may be cleared; each clearing saves 20 - 5 = 15.
Clearing one at a time, three would do (142 - 45 = 97). Clearing four at a time,
fit clears r1..r4: 82 tokens, and the next few calls can reuse the same prefix.
"""

import dataclasses

from minagent import agent, chat
from minagent.chat import Message

KINDS = ("first", "user", "model", "result")   # in a history; a view may also hold a "note"


@dataclasses.dataclass(frozen=True)
class Fit:
    view: tuple        # the Messages to send; () when refused
    step: int          # 0 sent as is, 1 cleared, 2 whole turns, 3 whole rounds, REFUSED (-1)
    cleared: tuple     # indices in the history of results sent as CLEARED_NOTE
    dropped: tuple     # indices in the history of messages left out of the view
    tokens: int        # the view's tokens; when refused, the fewest that step 3 could reach

    @property
    def refused(self):
        return self.step == REFUSED


REFUSED = -1
CLEARED_NOTE = ("[result cleared to keep the conversation within the model's context; "
                "run the tool again if you need it]")
TRIMMED_NOTE = ("[earlier conversation was left out to keep it within the model's context; "
                "the first message and the newest part are shown]")
# What the person reads when even step 3 fails. It is their work to do (start a new chat),
# not an outage, and retrying the same request would get the same answer.
REFUSAL_MESSAGE = ("This conversation got too long for the model to read at once. "
                   "Start a new chat for the next step; everything built so far stays.")
CLEARED = Message("result", CLEARED_NOTE)
NOTE = Message("note", TRIMMED_NOTE)
GROUP = 4          # results are cleared this many at a time
SMALL_FACTOR = 2   # a result of at most this many times the note's tokens is never cleared
KEEP_SHARE = 4     # the newest results that fit in budget / KEEP_SHARE stay whole

# Part of the agent's instructions. Without it the agent cannot know that old results will
# be cleared for it: a sub-agent asked to read 40 long chapters stopped after 2 "to save
# space", at 100,000 tokens of a 400,000 budget (docs/applications.md, "Context").
INSTRUCTIONS = ("When the conversation grows beyond what the model can read at once, the oldest tool "
                "results are cleared and the newest stay whole. So do not stop a long task to save "
                "space: keep going, and run the tool again (re-read the file) if you need a result "
                "that was cleared.")


def check(history):
    """Raise ValueError unless `history` is a well-formed history (see the module docstring)."""
    if not history or history[0].kind != "first":
        raise ValueError("a history starts with one 'first' message")
    for i, m in enumerate(history[1:], 1):
        if m.kind not in KINDS[1:]:
            raise ValueError(f"message {i}: kind {m.kind!r} is not one of {KINDS[1:]}")
        if m.kind == "result" and history[i - 1].kind != "model":
            raise ValueError(f"message {i}: a result must follow the model message holding its call")


def _suffix_sums(messages, count):
    """[a, b, c] -> [a+b+c, b+c, c, 0]: the tokens of messages[i:] for every i."""
    sums = [0] * (len(messages) + 1)
    for i in range(len(messages) - 1, -1, -1):
        sums[i] = sums[i + 1] + count(messages[i])
    return sums


def clearable(history, budget, count):
    """Indices of the results step 1 may clear, oldest first.

    How many results stay whole is decided by size, not by count: the newest results
    whose tokens together fit in a quarter of the budget, and always at least the
    newest one. (A fixed number, say six, suits short command outputs; with long
    file reads it would leave most of the budget to old results.) A result at most
    SMALL_FACTOR times the note's size is left alone: clearing it would save little
    and still change the start of the request.
    """
    results = [i for i, m in enumerate(history) if m.kind == "result"]
    whole, used = 0, 0
    for i in reversed(results):
        used += count(history[i])
        if whole and used > budget / KEEP_SHARE:
            break
        whole += 1
    small = SMALL_FACTOR * count(CLEARED)
    return [i for i in results[:len(results) - whole] if count(history[i]) > small]


def group_sizes(n, group=GROUP):
    """How many of n clearable results step 1 tries to clear, in order: 10 -> [4, 8, 10], 3 -> [3].

    The rule: the oldest min(4j, n) for the smallest j that makes the view fit (4 is `group`). So the
    number cleared is a multiple of four, unless all n are cleared. Clearing one more
    result at every call would change the start of every request, and a prefix cache
    (the provider reusing the work on a start identical to the last request's) would
    never help. In groups of four, the cleared part stays the same for several calls.
    """
    if group < 1:
        raise ValueError(f"group={group}: results are cleared at least one at a time")
    return list(range(group, n, group)) + ([n] if n else [])


def _cleared(history, cleared):
    """The history with the results at the indices in `cleared` replaced by the note."""
    return tuple(CLEARED if i in cleared else m for i, m in enumerate(history))


def _fit(history, step, cleared, count, start=0, keep=()):
    """A Fit: with start 0, the whole history; else history[0], the note, the messages at the
    indices in `keep`, then history[start:]. The results in `cleared` are sent as the note."""
    shown = _cleared(history, cleared)
    if start == 0:
        view, dropped = shown, ()
    else:
        view = (history[0], NOTE) + tuple(shown[i] for i in keep) + shown[start:]
        dropped = tuple(i for i in range(1, start) if i not in keep)
    cleared = tuple(i for i in sorted(cleared) if not (0 < i < start and i not in keep))
    return Fit(view, step, cleared, dropped, sum(count(m) for m in view))


def fit(history, budget, count, group=GROUP):
    """The view of `history` to send within `budget` tokens -> Fit. Pure: `history` is not changed.

    count(message) -> its tokens (memoise it: see counting.Counter). A view's tokens are the
    sum of its messages' counts, so count each message as it will be rendered.
    group: results are cleared this many at a time (1 to compare: experiments/06_context.py).
    """
    check(history)
    total = sum(count(m) for m in history)
    if total <= budget:
        return Fit(tuple(history), 0, (), (), total)

    # Step 1: clear the oldest results, four at a time.
    can = clearable(history, budget, count)
    saved = [count(history[i]) - count(CLEARED) for i in can]
    for n in group_sizes(len(can), group):
        if total - sum(saved[:n]) <= budget:
            return _fit(history, 1, set(can[:n]), count)
    cleared = set(can)   # steps 2 and 3 work on top of all of step 1's clearing

    # Step 2: the first message, the note, and the newest whole user turns that fit.
    after = _suffix_sums(_cleared(history, cleared), count)
    fixed = count(history[0]) + count(NOTE)
    users = [i for i, m in enumerate(history) if m.kind == "user"]
    turns = [u for u in reversed(users) if fixed + after[u] <= budget]   # newest first; sizes grow
    if turns:
        return _fit(history, 2, cleared, count, start=turns[-1])

    # Step 3: the first message, the note, the newest user message (the request now being
    # worked on, if it is not the first message itself), and the newest whole rounds of
    # its turn that fit, plus any trailing model message (the newest words are always sent).
    u = users[-1] if users else 0
    keep = (u,) if u else ()
    fixed += sum(count(history[i]) for i in keep)
    starts = [i for i in range(u + 1, len(history)) if history[i].kind == "model"]   # a round or a lone model message
    rounds = [i for i in starts if i + 1 < len(history) and history[i + 1].kind == "result"]
    newest = rounds[-1] if rounds else (starts[-1] if starts else len(history))
    fits = [i for i in reversed(starts) if i <= newest and fixed + after[i] <= budget]
    if fits:
        return _fit(history, 3, cleared, count, start=fits[-1], keep=keep)
    return Fit((), REFUSED, (), (), fixed + after[newest])


def old_trim(history, budget, count):
    """The old behaviour, for comparison: cut only where a user message starts.

    The first message, the note, and the newest whole user turns that fit. A
    sub-agent's history has one turn, its brief: nowhere to cut, so once it is
    over budget every request is refused (8 sub-agents out of 8 in the design document's test).
    """
    check(history)
    total = sum(count(m) for m in history)
    if total <= budget:
        return Fit(tuple(history), 0, (), (), total)
    after = _suffix_sums(history, count)
    fixed = count(history[0]) + count(NOTE)
    users = [i for i, m in enumerate(history) if m.kind == "user"]
    turns = [u for u in reversed(users) if fixed + after[u] <= budget]
    if turns:
        return _fit(history, 2, set(), count, start=turns[-1])
    return Fit((), REFUSED, (), (), fixed + after[users[-1]] if users else total)


# ---------------------------------------------------------------- in the agent loop

def fitted_view(history, count, budget, fitting=fit):
    """The view agent.run sends, within `budget`: pass view=functools.partial(fitted_view, budget=B).

    Raises agent.Refused with REFUSAL_MESSAGE when no view fits: the episode ends and the person
    reads it (the request is not retried: it would be refused again).
    """
    f = fitting(history, budget, count)
    if f.refused:
        raise agent.Refused(REFUSAL_MESSAGE)
    return f.view


def render_view(view, fmt):
    """A view -> a trace (list of chat.Segment), ready for chat.render."""
    return [chat.render_message(m, fmt) for m in view]
