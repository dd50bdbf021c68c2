"""Missions: seeded questions with gold tool-using traces, to train on and to evaluate.

    m = additions(1, seed=0)[0]
    m.question  -> "8335 + 4358 = ?"     (a test phrasing; the numbers are drawn from the seed)
    m.calls     -> ("add 8335 4358",)
    m.answer    -> "12693"
    m.trace     -> PROGRAM "<|user|>8335 + 4358 = ?<|assistant|>", MODEL "<|call|>add 8335 4358<|result|>",
                   PROGRAM "12693<|assistant|>", MODEL "12693<|end|>"
    m.direct    -> the same question answered without a tool: (prompt, answer)

Families (FAMILIES):
    add reverse sort age city     one call: "Add 17 and 250.", "How old is Paul?", ...
    together later sort_ages      chains of 2 to 4 calls: "How old are Paul and Anna together?" ->
                                  lookup Paul age, lookup Anna age, add 34 57
    retry                         the toolbox fails the first call (fail_first): busy error, same call again
    fix                           a malformed call ("add 4821 + 3907"), its error, then the corrected call
    direct                        a question that needs no tool ("Say hello."), answered at once

The gold traces' results come from really running a Toolbox(m.seed, m.fail_first).
In a fix mission the malformed call is written by the generator (author PROGRAM):
the model reads the mistake and its error, and learns only the correction.

Train and test phrasings come from disjoint pools of templates (TEMPLATES, and
DIRECT for fixed questions), as do the words to reverse. A model tested only on
the phrasings it trained on would look better than it is (design document 3:
94.7-100 % on seen phrasings). Numbers, words and names are drawn at random, and
`template_of` tells which pool a question came from.

The `mul` tool never appears in generated missions. `unseen_mul` builds questions
for it whose prompt describes the tool; they are for evaluation only.
"""

import dataclasses
import random
import re
import string

from minagent import chat, tools


@dataclasses.dataclass(frozen=True)
class Mission:
    family: str
    question: str
    answer: str         # short and copyable: for a lookup, exactly the tool's output ("34", "Lyon")
    seed: int           # the Toolbox seed, i.e. which people table this episode uses
    fail_first: bool
    calls: tuple        # the gold trace's calls in order (a fix mission's malformed call first)
    trace: tuple        # chat.Segments: the gold tool-using trace
    direct: tuple       # chat.Segments: the same question answered directly, (prompt, answer)


SINGLE = ("add", "reverse", "sort", "age", "city")
MULTI = ("together", "later", "sort_ages")
FAMILIES = SINGLE + MULTI + ("retry", "fix", "direct")

# Each template's fields, as regexes: template_of() matches questions back to templates.
_NUM, _NAME = r"-?[0-9]+", r"[A-Z][a-z]+"
FIELDS = {"a": _NUM, "b": _NUM, "n": _NUM, "nums": rf"{_NUM}(?: {_NUM})*", "word": r"[a-z]+",
          "name": _NAME, "name1": _NAME, "name2": _NAME, "name3": _NAME}

TEMPLATES = {
    "add": {
        "train": ("What is {a} + {b}?", "Add {a} and {b}.", "What is the sum of {a} and {b}?",
                  "Compute {a} plus {b}.", "How much is {a} + {b}?"),
        "test": ("What do you get if you add {a} to {b}?", "{a} + {b} = ?", "Please work out {a} plus {b}.",
                 "Find the total of {a} and {b}.", "What is {a} added to {b}?")},
    "reverse": {
        "train": ("Reverse the word {word}.", "What is {word} spelled backwards?", "Write {word} backwards.",
                  "Reverse {word}."),
        "test": ("Spell {word} in reverse.", "What do you get when you reverse {word}?",
                 "Turn the word {word} around.", "Read {word} from right to left.")},
    "sort": {
        "train": ("Sort {nums}.", "Sort these numbers: {nums}.", "Put {nums} in order.",
                  "Arrange {nums} from smallest to largest."),
        "test": ("Order {nums} from low to high.", "List {nums} in increasing order.", "Can you sort {nums}?",
                 "Rank {nums}, smallest first.")},
    "age": {
        "train": ("How old is {name}?", "What is {name}'s age?", "Tell me the age of {name}.", "What age is {name}?"),
        "test": ("How many years old is {name}?", "Do you know {name}'s age?", "Give me {name}'s age.",
                 "I wonder how old {name} is.")},
    "city": {
        "train": ("Where does {name} live?", "Which city does {name} live in?", "What is {name}'s city?",
                  "In which city is {name}?"),
        "test": ("Where is {name} living?", "Tell me where {name} lives.", "What city is {name} from?",
                 "Name the city of {name}.")},
    "together": {
        "train": ("How old are {name1} and {name2} together?", "What is the sum of the ages of {name1} and {name2}?",
                  "Add the ages of {name1} and {name2}.", "What do the ages of {name1} and {name2} add up to?"),
        "test": ("What is the combined age of {name1} and {name2}?", "Together, how old are {name1} and {name2}?",
                 "If you add up the ages of {name1} and {name2}, what do you get?",
                 "{name1} and {name2}: what is their total age?")},
    "later": {
        "train": ("How old will {name} be in {n} years?", "What age will {name} be {n} years from now?",
                  "In {n} years, how old will {name} be?", "Add {n} years to {name}'s age."),
        "test": ("How old is {name} going to be after {n} more years?", "What will {name}'s age be in {n} years?",
                 "Give {name}'s age {n} years from now.", "After {n} years, what age will {name} have?")},
    "sort_ages": {
        "train": ("Sort the ages of {name1}, {name2} and {name3}.",
                  "List the ages of {name1}, {name2} and {name3} from youngest to oldest.",
                  "Put the ages of {name1}, {name2} and {name3} in order.",
                  "What are the ages of {name1}, {name2} and {name3}, sorted?"),
        "test": ("Order the ages of {name1}, {name2} and {name3} from low to high.",
                 "Give the ages of {name1}, {name2} and {name3} in increasing order.",
                 "How old are {name1}, {name2} and {name3}, youngest first?",
                 "Rank {name1}, {name2} and {name3} by age and give the ages.")},
    "mul": {   # evaluation only: unseen_mul()
        "test": ("What is {a} times {b}?", "Multiply {a} by {b}.", "What is the product of {a} and {b}?")},
}

# Questions that need no tool, answered directly; fixed pairs, disjoint between splits.
DIRECT = {
    "train": (("What colour is the sky?", "Blue."), ("Say hello.", "Hello!"), ("What do bees make?", "Honey."),
              ("What is the opposite of hot?", "Cold."), ("Which animal says moo?", "A cow."),
              ("What colour is grass?", "Green."), ("Say goodbye.", "Goodbye!"),
              ("How many legs does a cat have?", "Four.")),
    "test": (("What colour is snow?", "White."), ("Say thank you.", "Thank you!"),
             ("What is the opposite of up?", "Down."), ("Which animal barks?", "A dog."),
             ("What do cows eat?", "Grass."), ("How many days are in a week?", "Seven.")),
}
TEMPLATES["direct"] = {split: tuple(q for q, _ in pairs) for split, pairs in DIRECT.items()}

WORDS = {   # to reverse; common words of 4 to 7 letters
    "train": ("butter", "garden", "window", "pencil", "rabbit", "basket", "candle", "dragon", "forest", "guitar",
              "hammer", "island", "jacket", "kitten", "lemon", "market", "table", "pocket", "river", "silver",
              "ticket", "winter", "bread", "cloud", "house", "apple", "music", "chair"),
    "test": ("yellow", "bottle", "cookie", "doctor", "engine", "flower", "ginger", "honey", "insect", "jungle",
             "ladder", "mirror", "parrot", "planet", "rocket", "tomato", "violin", "wallet", "monkey", "castle",
             "spider", "water", "stone", "light"),
}

MUL_SYSTEM = "You can call mul A B to multiply A by B."


def template_regex(template):
    """"How old is {name}?" -> a regex that matches exactly the questions the template can produce."""
    parts = []
    for literal, field, _, _ in string.Formatter().parse(template):
        parts.append(re.escape(literal))
        if field is not None:
            parts.append(f"(?:{FIELDS[field]})")
    return re.compile("".join(parts))


def template_of(question):
    """"How old is Paul?" -> ("age", "train", "How old is {name}?"); None if no template produces it."""
    for family, splits in TEMPLATES.items():
        for split, templates in splits.items():
            for t in templates:
                if template_regex(t).fullmatch(question):
                    return family, split, t
    return None


# ---------------------------------------------------------------- values of each family
# Each takes (rng, table, split) and returns (template fields, gold calls, answer).
# Answers are computed here with plain Python, independently of the tools.

def _number(rng, digits):
    """A random number of exactly `digits` digits (0-9 for one digit)."""
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10 ** digits - 1)


def _add(rng, table, split, digits=None):
    a, b = (_number(rng, d) for d in (digits or (rng.randint(1, 4), rng.randint(1, 4))))
    return {"a": a, "b": b}, [f"add {a} {b}"], str(a + b)


def _reverse(rng, table, split):
    word = rng.choice(WORDS[split])
    return {"word": word}, [f"reverse {word}"], word[::-1]


def _sort(rng, table, split):
    nums = [rng.randint(1, 99) for _ in range(rng.randint(3, 5))]
    return ({"nums": " ".join(map(str, nums))}, ["sort " + " ".join(map(str, nums))],
            " ".join(map(str, sorted(nums))))


def _age(rng, table, split):
    name, age, _ = rng.choice(table)
    return {"name": name}, [f"lookup {name} age"], str(age)


def _city(rng, table, split):
    name, _, city = rng.choice(table)
    return {"name": name}, [f"lookup {name} city"], city


def _together(rng, table, split):
    (n1, a1, _), (n2, a2, _) = rng.sample(table, 2)
    return {"name1": n1, "name2": n2}, [f"lookup {n1} age", f"lookup {n2} age", f"add {a1} {a2}"], str(a1 + a2)


def _later(rng, table, split):
    name, age, _ = rng.choice(table)
    n = rng.randint(1, 30)
    return {"name": name, "n": n}, [f"lookup {name} age", f"add {age} {n}"], str(age + n)


def _sort_ages(rng, table, split):
    people = rng.sample(table, 3)
    ages = [age for _, age, _ in people]
    calls = [f"lookup {name} age" for name, _, _ in people] + ["sort " + " ".join(map(str, ages))]
    return ({"name1": people[0][0], "name2": people[1][0], "name3": people[2][0]}, calls,
            " ".join(map(str, sorted(ages))))


def _mul(rng, table, split):
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return {"a": a, "b": b}, [f"mul {a} {b}"], str(a * b)


VALUES = {"add": _add, "reverse": _reverse, "sort": _sort, "age": _age, "city": _city,
          "together": _together, "later": _later, "sort_ages": _sort_ages, "mul": _mul}


def _malformed(call, rng):
    """A plausible mistake for a gold call: "add 4821 3907" -> "add 4821 + 3907" or "add 4821", ..."""
    name, *args = call.split()
    if name in ("add", "mul"):
        a, b = args
        return rng.choice([f"{name} {a}", f"{name} {a} + {b}", f"{name} {a}{b}", f"{name} {a} {b}?"])
    if name == "sort":
        return rng.choice([f"sort {', '.join(args)}", "sort", f"sort {' '.join(args)}."])
    if name == "reverse":
        return rng.choice([f"reverse the word {args[0]}", f"reverse {args[0]} backwards"])
    person, field = args      # lookup
    wrong_field = "years" if field == "age" else "town"
    return rng.choice([f"lookup {person}", f"{field} {person}", f"lookup {person} {wrong_field}"])


# ---------------------------------------------------------------- missions

def _mission(family, rng, split, fmt, values=None, system=None):
    """One mission. Everything random comes from `rng`; its first draw is the Toolbox seed."""
    seed = rng.getrandbits(32)
    base = rng.choice(SINGLE + MULTI) if family in ("retry", "fix") else family
    if base == "direct":
        question, answer = rng.choice(DIRECT[split])
        calls = []
    else:
        fields, calls, answer = (values or VALUES[base])(rng, tools.people_table(seed), split)
        question = rng.choice(TEMPLATES[base][split]).format(**fields)
    if family == "retry":
        calls = calls[:1] + calls                       # the first call is answered BUSY; the model repeats it
    mistakes = 1 if family == "fix" else 0
    if family == "fix":
        calls = [_malformed(calls[0], rng)] + calls     # the mistake, then the gold calls
    fail_first = family == "retry"
    box = tools.Toolbox(seed, fail_first=fail_first)
    opening = chat.prompt(fmt, question, system)
    trace = [opening]
    for i, call in enumerate(calls):
        trace += chat.tool_round(fmt, call, box(call), author=chat.PROGRAM if i < mistakes else chat.MODEL)
    trace.append(chat.answer(fmt, answer))
    return Mission(family, question, answer, seed, fail_first, tuple(calls), tuple(trace),
                   (opening, chat.answer(fmt, answer)))


def _rng(kind, split, seed, i):
    """Mission i's own generator: it depends on (kind, split, seed, i) only, not on n or other missions."""
    return random.Random(f"{kind}/{split}/{seed}/{i}")     # str seeds are hashed with sha512: stable across runs


def generate(n, seed, split="train", families=None, fmt=chat.MINAGENT, system=None):
    """n missions; mission i is of family families[i % len(families)].

    Repeat a family in `families` to weight it: families=("add", "add", "direct")
    makes two additions for each direct question. system: a system text for every prompt.
    """
    families = tuple(families or FAMILIES)
    unknown = set(families) - set(FAMILIES)
    if unknown:
        raise ValueError(f"unknown families {sorted(unknown)}; there are {FAMILIES}")
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', not {split!r}")
    return [_mission(families[i % len(families)], _rng("mission", split, seed, i), split, fmt, system=system)
            for i in range(n)]


def additions(n, seed, fmt=chat.MINAGENT, split="test"):
    """n additions of two 4-digit numbers: the design documents' 200-addition test."""
    four = lambda rng, table, split: _add(rng, table, split, digits=(4, 4))  # noqa: E731
    return [_mission("add", _rng("additions", split, seed, i), split, fmt, values=four) for i in range(n)]


def unseen_mul(n, seed, fmt=chat.MINAGENT, system=MUL_SYSTEM):
    """n multiplications of two 2-digit numbers, for the tool never shown in training.

    The prompt's system text (MUL_SYSTEM unless told) describes the tool, or not (a control);
    the gold trace calls `mul A B`. For evaluation only.
    """
    return [_mission("mul", _rng("mul", "test", seed, i), "test", fmt, system=system) for i in range(n)]
