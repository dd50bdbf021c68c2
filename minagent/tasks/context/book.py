"""A seeded book to read chapter by chapter: long tool results for the context-window missions.

Each chapter is generated from small word lists, deterministically from (seed, n): the
same book every time, a different book for another seed, and no chapter to memorise.

    chapter(0, 3)   -> "Chapter 3. Later, the keeper drove to the garden. ... A red fox ran
                        across the kitchen. ..."
    mentions(0, "lighthouse", 1, 10) -> [1, 3, 6]: the gold answer of a mission
    toolbox(0)("read 3")             -> chapter(0, 3): the `read` tool, in a Toolbox of its own

A motif (MOTIFS) is a sentence that names it, dropped at a random place in some
chapters, each motif independently with probability MOTIF_P. Its word ("lighthouse",
"storm", "fox") appears in no other sentence, so a chapter mentions a motif exactly
when the word is in its text: tests/test_book.py checks `mentions` against the text.

With SENTENCES sentences a chapter is a few hundred characters per four sentences:
about 12 tokens a sentence for a BPE trained on the book, 150 for 12 sentences.
"""

import functools
import random

from minagent.tools import ToolError, Toolbox, number, tool

N_CHAPTERS = 40    # chapters 1 to 40
MAX_READ = 4000    # a chapter comes back whole: cutting it would hide its end, motif included
SENTENCES = 12     # sentences in a chapter, the motif sentences included
MOTIF_P = 0.3      # each motif is in a chapter with this probability

PEOPLE = ("the keeper", "the old sailor", "Marta", "the boy", "the baker", "the doctor", "Ivo", "the teacher")
VERBS = ("walked", "ran", "went", "hurried", "drove", "came back")
PLACES = ("the harbour", "the market", "the kitchen", "the church", "the station", "the garden", "the school",
          "the bridge", "the village", "the beach")
TIMES = ("In the morning", "At noon", "That evening", "Later", "After supper", "Before dawn", "On Sunday")
THINGS = ("the bread", "the letter", "the road", "the boat", "the house", "the rain", "the wind", "the clock")
STATES = ("warm", "old", "quiet", "wet", "grey", "late", "long", "cold")
PLAIN = (
    "{time}, {who} {verb} to {place}.",
    "{Who} thought about {thing} for a while.",
    "{Thing} was {state}, and {who} did not mind.",
    "Nobody at {place} said a word.",
    "{Who} and {who2} met near {place}.",
    "{Time} {thing} was {state} again.",
)
MOTIFS = {
    "lighthouse": ("Far out on the rocks stood a lighthouse.",
                   "{Who} saw the beam of a lighthouse across the water.",
                   "{Who} talked about a lighthouse that nobody had visited."),
    "storm": ("{Time} a storm came in from the sea.",
              "{Who} was afraid of the storm."),
    "fox": ("A red fox ran across {place}.",
            "{Who} saw a fox near {place}."),
}


def _fill(template, rng):
    """One sentence: each {field} drawn from its list; a capitalised field gives a capitalised value."""
    who, who2 = rng.sample(PEOPLE, 2)
    values = dict(who=who, who2=who2, verb=rng.choice(VERBS), place=rng.choice(PLACES),
                  time=rng.choice(TIMES), thing=rng.choice(THINGS), state=rng.choice(STATES))
    values.update({k.capitalize(): v[0].upper() + v[1:] for k, v in values.items()})
    return template.format(**values)


def _check(n):
    if not 1 <= n <= N_CHAPTERS:
        raise ValueError(f"no chapter {n}: the book has chapters 1 to {N_CHAPTERS}")


def motifs(seed, n):
    """The motifs chapter n mentions, in MOTIFS order: motifs(0, 3) -> ("lighthouse", "fox")."""
    _check(n)
    rng = random.Random(f"book/{seed}/{n}/motifs")      # str seeds hash with sha512: stable across runs
    return tuple(m for m in MOTIFS if rng.random() < MOTIF_P)


def chapter(seed, n, sentences=SENTENCES):
    """Chapter n of book `seed`: "Chapter n." then `sentences` sentences, the motif ones among them."""
    rng = random.Random(f"book/{seed}/{n}/text")
    special = [_fill(rng.choice(MOTIFS[m]), rng) for m in motifs(seed, n)]
    plain = [_fill(rng.choice(PLAIN), rng) for _ in range(max(0, sentences - len(special)))]
    for s in special:                                     # each at a random place, first to last
        plain.insert(rng.randint(0, len(plain)), s)
    return " ".join([f"Chapter {n}."] + plain)


def mentions(seed, motif, first, last):
    """The chapters from `first` to `last` (both included) that mention `motif`: the gold answer."""
    if motif not in MOTIFS:
        raise ValueError(f"unknown motif {motif!r}; there are {list(MOTIFS)}")
    return [n for n in range(first, last + 1) if motif in motifs(seed, n)]


@tool
def read(seed, sentences, args):
    """read(0, 12, "3") -> chapter 3 of book 0, whole; read(0, 12, "41") -> "error: no chapter 41: ..." """
    words = args.split()
    if len(words) != 1:
        raise ToolError("read takes a chapter number")
    try:
        return chapter(seed, number(words[0]), sentences)
    except ValueError as e:                 # "no chapter 41: the book has chapters 1 to 40"
        raise ToolError(str(e)) from None


def toolbox(seed, sentences=SENTENCES):
    """A Toolbox with one tool, `read N`: chapter N of book `seed`. Keeping long results within
    a budget is the view's job (fit.py), not the tool's."""
    return Toolbox(tools={"read": functools.partial(read, seed, sentences)}, max_result=MAX_READ)
