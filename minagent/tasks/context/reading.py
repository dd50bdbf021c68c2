"""Long missions: read chapters A to B of a book, one `read` call each, and say which mention a motif.

One mission is one long turn, longer than the budget: the context-window case of a sub-agent
reading many chapters (docs/applications.md, "Context"). Its gold episode, as chat.Messages (book.py):

    first   Which of chapters 12 to 15 mention a lighthouse?
    model   <|call|>read 12<|result|>
    result  Chapter 12. Later, the keeper drove to the garden. ...
    model   chapter 12 of 15: no. so far: none<|call|>read 13<|result|>
    result  Chapter 13. ... Far out on the rocks stood a lighthouse. ...
    model   chapter 13 of 15: yes. so far: 13<|call|>read 14<|result|>
    result  Chapter 14. ...
    model   chapter 14 of 15: no. so far: 13<|call|>read 15<|result|>
    result  Chapter 15. ... a lighthouse ...
    model   chapter 15 of 15: yes. answer: 13 15<|end|>

The notes are the model's memory. fit.fit clears old results (step 1) and, when even
that is not enough, drops old rounds (step 3); it never changes a model message, and the
newest round, the newest note with its call and the chapter it read, is always sent. Each
note carries the whole list so far, so that round is all the model needs: the next note
adds the chapter just read if it mentions the motif, the next call reads one chapter more.
A note also names the last chapter ("of 15"), so that the decision to stop compares two
numbers side by side in the note being written: after "chapter 15 of 15" comes "answer:",
the list, and the end. (`answer_of` reads the list back.) `reader` is that rule written as
a program: it looks at nothing but the view, and tests/test_reading.py checks that over
fitted views it writes the gold episode exactly.

Training examples are the views the model would really see (`examples`): for each model
message, the view `fit` makes of the history before it, rendered, with that message as the
only supervised text. Old notes in a view were written from another view, so they are read,
not learned: after a cleared result the model must not learn to write "yes". A view that
only grew since the last message (nothing cleared or dropped in between) is the same
example as the next one, so the two are merged: one row, both messages supervised.
"""

import dataclasses
import random
import re

from minagent import chat
from minagent.chat import Message
from minagent.tasks.context import book, counting, fit

MOTIF_WORDS = {"lighthouse": "a lighthouse", "storm": "a storm", "fox": "a fox"}
QUESTION = "Which of chapters {first} to {last} mention {what}?"
_QUESTION = re.compile(r"Which of chapters (\d+) to (\d+) mention an? (\w+)\?")
_NOTE = re.compile(r"so far: ([0-9 ]+|none)")
_ANSWER = re.compile(r"answer: (.*)$")
_READ = re.compile(r"read (\d+)")


@dataclasses.dataclass(frozen=True)
class Reading:
    question: str
    first: int          # chapters first..last, both read
    last: int
    motif: str
    seed: int           # the book's seed: read with book.toolbox(seed, sentences)
    sentences: int
    answer: str         # "13 15", or "none"
    history: tuple      # chat.Messages: the gold episode, whole


def listed(chapters):
    """[13, 15] -> "13 15", [] -> "none": how notes and answers write a list of chapters."""
    return " ".join(map(str, chapters)) or "none"


def note(n, last, found):
    """What the model writes after reading chapter n of first..last, with `found` the chapters so far:

        note(14, 15, [13]) -> "chapter 14 of 15: no. so far: 13"
        note(15, 15, [13, 15]) -> "chapter 15 of 15: yes. answer: 13 15"

    A chapter number is always written after a space, as in "read 14" and in the question,
    so that a tokenizer that has " 14" as one piece sees the same piece everywhere.
    """
    return (f"chapter {n} of {last}: {'yes' if n in found else 'no'}. "
            f"{'answer' if n == last else 'so far'}: {listed(found)}")


def answer_of(text):
    """The list in a last note: "chapter 15 of 15: yes. answer: 13 15" -> "13 15" (else the text itself)."""
    m = _ANSWER.search(text)
    return m.group(1).strip() if m else text


def call(fmt, n):
    return f"{fmt.call}read {n}{fmt.result}"


def mission(seed, first, last, motif="lighthouse", sentences=book.SENTENCES, fmt=chat.MINAGENT):
    """One mission's gold episode."""
    question = QUESTION.format(first=first, last=last, what=MOTIF_WORDS[motif])
    gold = book.mentions(seed, motif, first, last)
    history = [Message("first", question),
               Message("model", call(fmt, first))]
    for n in range(first, last + 1):
        history.append(Message("result", book.chapter(seed, n, sentences)))
        found = [k for k in gold if k <= n]
        history.append(Message("model", note(n, last, found) + (call(fmt, n + 1) if n < last else fmt.end)))
    return Reading(question, first, last, motif, seed, sentences, listed(gold), tuple(history))


def generate(n, seed, lengths=(3, 12), motifs=("lighthouse",), sentences=book.SENTENCES, fmt=chat.MINAGENT,
             within=book.N_CHAPTERS):
    """n missions of lengths[0] to lengths[1] chapters each: a random stretch of chapters 1..within
    of a random book. (A smaller `within` means fewer chapter numbers for a small model to tell apart.)"""
    if not 1 <= lengths[0] <= lengths[1] <= within <= book.N_CHAPTERS:
        raise ValueError(f"lengths={lengths}, within={within}: need 1 <= shortest <= longest <= within "
                         f"<= {book.N_CHAPTERS} (the book's chapters)")
    out = []
    for i in range(n):
        rng = random.Random(f"reading/{seed}/{i}")          # mission i depends on (seed, i) only
        length = rng.randint(*lengths)
        first = rng.randint(1, within - length + 1)
        out.append(mission(rng.getrandbits(32), first, first + length - 1, rng.choice(motifs), sentences, fmt))
    return out


# ---------------------------------------------------------------- a reader that sees only the view

def reader(view, fmt=chat.MINAGENT):
    """The next model message from a view alone: the rule the model must learn, as a program.

    The question (the first message, always sent) gives the chapters and the motif; the
    newest round gives the chapter just read, its text and the newest note. If the newest
    result were cleared this would answer wrongly: fit.fit never clears it.
    """
    first, last, motif = _QUESTION.search(view[0].text).groups()
    first, last = int(first), int(last)
    if len(view) == 1:
        return call(fmt, first)
    asked, chapter = view[-2].text, view[-1].text
    n = int(_READ.search(asked.split(fmt.call)[-1]).group(1))
    so_far = _NOTE.search(asked)
    found = [int(k) for k in so_far.group(1).split() if k != "none"] if so_far else []
    found += [n] if motif in chapter else []
    return note(n, last, found) + (fmt.end if n >= last else call(fmt, n + 1))


def scripted(r, budget, count, fitting=fit.fit, toolbox=None, fmt=chat.MINAGENT, max_calls=100):
    """Mission `r` played at the level of histories: `reader` as the model, `fitting` between calls.

    fitting(history, budget, count) -> fit.Fit (fit.fit, or fit.old_trim); budget None
    sends the whole history every time. -> dict: status "done", "refused" or "calls" (max_calls
    spent), the answer, the history, and per request the view's tokens and the Fit's step.
    """
    box = toolbox or book.toolbox(r.seed, r.sentences)
    history, sent, steps = list(r.history[:1]), [], []
    while True:
        f = fitting(tuple(history), budget, count) if budget is not None else None
        if f is not None and f.refused:
            return dict(status="refused", answer=fit.REFUSAL_MESSAGE, history=tuple(history), sent=sent,
                        steps=steps, refused_at=f.tokens)
        view = f.view if f is not None else tuple(history)
        sent.append(f.tokens if f is not None else sum(map(count, view)))
        steps.append(f.step if f is not None else 0)
        message = reader(view, fmt)
        history.append(Message("model", message))
        if message.endswith(fmt.end):
            return dict(status="done", answer=answer_of(message[:-len(fmt.end)]), history=tuple(history), sent=sent,
                        steps=steps)
        if box.calls == max_calls:
            return dict(status="calls", answer="", history=tuple(history), sent=sent, steps=steps)
        history.append(Message("result", box(message.split(fmt.call)[-1][:-len(fmt.result)])))


# ---------------------------------------------------------------- training examples

def views(history, budget, count, fitting=fit.fit):
    """[(view, i)] for each model message history[i]: the view sent before the model wrote it."""
    out = []
    for i, m in enumerate(history):
        if m.kind == "model":
            f = fitting(history[:i], budget, count)
            if f.refused:
                raise ValueError(f"budget {budget} is too small: message {i} would be refused")
            out.append((f.view, i))
    return out


def examples(r, tok, budget, fmt=chat.MINAGENT, count=None, fitting=fit.fit):
    """Mission r's training examples: [(tokens_T, authors_T)], the views of `views`, merged.

    Each example is a view followed by the message written after it, which alone is MODEL;
    when the next view starts with that whole example, the two become one (both messages
    supervised). count defaults to counting.exact_counter(tok, fmt), as the agent counts.
    """
    count = count or counting.exact_counter(tok, fmt)
    rows = []                                                       # [(messages, indices supervised)]
    for view, i in views(r.history, budget, count, fitting):
        if rows and view[:len(rows[-1][0])] == rows[-1][0]:        # the last example, grown: extend it
            _, supervised = rows.pop()
            rows.append((view + (r.history[i],), supervised + (len(view),)))
        else:
            rows.append((view + (r.history[i],), (len(view),)))
    out = []
    for messages, supervised in rows:
        segments = [dataclasses.replace(chat.render_message(m, fmt),
                                        author=chat.MODEL if j in supervised else chat.PROGRAM)
                    for j, m in enumerate(messages)]
        out.append(chat.render(segments, tok))
    return out
