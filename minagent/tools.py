"""The agent's tools: pure `str -> str` functions, and a Toolbox that runs one episode's calls.

A call is the text the model writes between `<|call|>` and `<|result|>`: a tool
name, then its arguments, separated by whitespace.

    add 4821 3907     -> 8728
    reverse butter    -> rettub
    sort 81 5 23      -> 5 23 81
    lookup Paul age   -> 34          (in this episode's table of sixteen people)
    mul 12 34         -> 408         (never in training data: the unseen tool)

A malformed call does not crash the episode: the tool answers a short error the
model reads like any other result, and may correct itself from.

    add 4821          -> error: add takes two numbers
    add 4x 3          -> error: not a number: 4x
    lookup Zed age    -> error: unknown person Zed
    foo 1             -> error: unknown tool foo

Each tool takes the argument text (everything after the name) and returns a string.
Inside a tool a malformed argument raises ToolError; the `@tool` decorator turns
it into that `error: ...` string, so callers of a tool never see an exception.
An application brings tools of its own to a Toolbox (tasks/context: `read`).

A tool can also describe itself: a `Tool` record holds its name, a usage line, one
sentence of description and its function. `describe(tools)` renders the system text
that lists them, and `Toolbox(tools=[...])` serves the same records, so what the
model reads and what the toolbox runs come from one list and cannot disagree:

    describe(calculator_tools(0)[:2])
        -> "You can call these tools:\nadd A B: adds two numbers.\n"
           "reverse WORD: spells a word backwards."
"""

import dataclasses
import functools
import random
import re

MAX_RESULT = 64    # a result is at most this many characters (by default): one call must not
#                    flood the context
MAX_DIGITS = 20    # a longer number is refused: "add" of two such numbers still fits in MAX_RESULT
MAX_SORT = 16      # sort at most this many numbers
BUSY = "error: tool busy, try again"   # what fail_first answers to the first call of an episode

# Pools for the lookup table. Names are short, common and distinct; each one is a
# word or two for a BPE, so the model can copy it from the question into a call.
NAMES = ("Paul", "Anna", "John", "Mary", "Tom", "Lucy", "Mark", "Emma", "Jack", "Sara",
         "Leo", "Nina", "Sam", "Eva", "Max", "Ruth", "Adam", "Rosa", "Hugo", "Iris",
         "Ben", "Clara", "Dan", "Ella", "Felix", "Grace", "Henry", "Ivy", "Karl", "Laura",
         "Omar", "Olga", "Peter", "Rita", "Simon", "Tina", "Victor", "Vera", "Zoe", "Alice")
CITIES = ("Lyon", "Paris", "Rome", "Oslo", "Berlin", "Madrid", "Vienna", "Prague",
          "Lisbon", "Dublin", "London", "Tokyo", "Cairo", "Lima", "Delhi", "Seoul",
          "Sydney", "Boston", "Milan", "Athens")
AGES = (18, 90)    # inclusive
N_PEOPLE = 16


class ToolError(Exception):
    """A malformed call. Its message, after "error: ", is what the model reads."""


def tool(fn):
    """Make `fn` answer "error: <message>" instead of raising ToolError."""
    @functools.wraps(fn)
    def wrapped(*args):
        try:
            return fn(*args)
        except ToolError as e:
            return f"error: {e}"
    return wrapped


def _shown(word, n=16):
    """A user-supplied word as it appears inside an error message: cut, so the error stays short."""
    return word if len(word) <= n else word[:n] + "..."


def number(word):
    """"4821" -> 4821. Only plain ASCII decimals (int() would also accept "٤", "1_000" and
    " 7")."""
    if not re.fullmatch(r"-?[0-9]+", word):
        raise ToolError(f"not a number: {_shown(word)}")
    if len(word.lstrip("-")) > MAX_DIGITS:
        raise ToolError(f"number too long: {_shown(word)}")
    return int(word)


def _two_numbers(name, args):
    words = args.split()
    if len(words) != 2:
        raise ToolError(f"{name} takes two numbers")
    return number(words[0]), number(words[1])


@tool
def add(args):
    """add("4821 3907") -> "8728" """
    a, b = _two_numbers("add", args)
    return str(a + b)


@tool
def mul(args):
    """mul("12 34") -> "408" """
    a, b = _two_numbers("mul", args)
    return str(a * b)


@tool
def reverse(args):
    """reverse("butter") -> "rettub" """
    words = args.split()
    if len(words) != 1:
        raise ToolError("reverse takes one word")
    return words[0][::-1]


@tool
def sort(args):
    """sort("81 5 23") -> "5 23 81" (as numbers, not as strings: 5 comes before 23)"""
    words = args.split()
    if not words:
        raise ToolError("sort takes numbers")
    if len(words) > MAX_SORT:
        raise ToolError(f"sort takes at most {MAX_SORT} numbers")
    return " ".join(str(x) for x in sorted(number(w) for w in words))


def people_table(seed):
    """Sixteen (name, age, city) rows, drawn afresh for each episode so that no table can be
    memorised.

    people_table(0)[:2] -> (("Felix", 35, "Oslo"), ("Henry", 50, "Boston"))
    The same seed always gives the same table; names are distinct, ages and cities may repeat.
    """
    rng = random.Random(seed)
    names = rng.sample(NAMES, N_PEOPLE)
    return tuple((name, rng.randint(*AGES), rng.choice(CITIES)) for name in names)


@tool
def lookup(table, args):
    """lookup(table, "Paul age") -> "34", lookup(table, "Paul city") -> "Lyon".

    Names and fields are matched ignoring case ("paul AGE" works too): the model
    should not fail on a capital letter, only on a wrong fact.
    """
    words = args.split()
    if len(words) != 2 or words[1].lower() not in ("age", "city"):
        raise ToolError("lookup takes a name and age or city")
    name, field = words[0], words[1].lower()
    for person, age, city in table:
        if person.lower() == name.lower():
            return str(age) if field == "age" else city
    raise ToolError(f"unknown person {_shown(name)}")


@dataclasses.dataclass(frozen=True)
class Tool:
    """A tool that describes itself: what the model reads about it, and what runs when it is called.

        Tool("add", "A B", "adds two numbers.", add).line()   -> "add A B: adds two numbers."

    args: how its arguments are written after the name ("" for none); description: one sentence.
    The name is the first word of a call; renamed(name) is the same tool under another name.
    """
    name: str
    args: str
    description: str
    fn: object          # argument text -> result text

    def __post_init__(self):
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.name):
            raise ValueError(f"tool name {self.name!r}: one word of letters, digits and _")

    def line(self):
        """Its line in the system text: usage, then the description."""
        return f"{self.name} {self.args}".rstrip() + f": {self.description}"

    def renamed(self, name):
        return dataclasses.replace(self, name=name)


TOOLS_HEADER = "You can call these tools:"


def describe(tools):
    """The system text that lists `tools` (Tool records), one line each, in the order given."""
    return "\n".join([TOOLS_HEADER] + [t.line() for t in tools])


def calculator_tools(seed):
    """The tools of the first design document as Tool records, with the people table of `seed`."""
    return (Tool("add", "A B", "adds two numbers.", add),
            Tool("reverse", "WORD", "spells a word backwards.", reverse),
            Tool("sort", "N1 N2 ...", "puts numbers in increasing order.", sort),
            Tool("lookup", "NAME age|city", "reads a person's age or city.",
                 functools.partial(lookup, people_table(seed))),
            Tool("mul", "A B", "multiplies A by B.", mul))


def calculator(seed):
    """The tools of the first design document, with the people table of `seed`: name -> function."""
    return {t.name: t.fn for t in calculator_tools(seed)}


class Toolbox:
    """The tools of one episode, its call counter, and an optional transient failure.

        box = Toolbox(seed=7)       # the calculator's tools, people table 7
        box("add 4821 3907")        -> "8728"
        box("  lookup Paul age ")   -> "34" (say), or "error: unknown person Paul" if Paul is
                                       not in table 7
        box.calls, box.log          -> 2, [("add 4821 3907", "8728"), ...]

    tools: name -> function, or Tool records (default calculator(seed); () for none at all,
    which makes every call an error: the control that must answer without tools). Calling a
    Toolbox never raises, whatever the text (a KeyboardInterrupt or SystemExit in a tool is
    logged and goes on), and its answer is at most max_result characters.
    (An answer that spells "<|end|>" is harmless: chat.encode sends every result as text.)

    fail_first=True: the first call of the episode answers BUSY, whatever it is; the
    next calls work normally. This measures whether the model tries again.
    """

    def __init__(self, seed=0, *, tools=None, fail_first=False, max_result=MAX_RESULT):
        if tools is None:
            tools = calculator(seed)
        elif not isinstance(tools, dict):
            tools = [(t.name, t.fn) if isinstance(t, Tool) else t for t in tools]
        self.tools = dict(tools)
        self.fail_first, self.max_result = fail_first, max_result
        self.log = []       # [(call text, result)] in order, one for each call

    @property
    def calls(self):
        """Calls made so far: the log's length, so that the count and the log always agree."""
        return len(self.log)

    def __call__(self, call_text):
        try:
            result = BUSY if self.fail_first and not self.log else self._run(call_text)
        except BaseException as e:  # KeyboardInterrupt, SystemExit: logged, then raised on
            self.log.append((call_text, f"error: interrupted ({type(e).__name__})"))
            raise
        if len(result) > self.max_result:
            result = result[:self.max_result - 3] + "..."
        self.log.append((call_text, result))
        return result

    def _run(self, call_text):
        parts = call_text.split(None, 1)        # "add 4821 3907" -> ["add", "4821 3907"]
        if not parts:
            return "error: empty call"
        name, args = parts[0], parts[1] if len(parts) == 2 else ""
        if name not in self.tools:
            return f"error: unknown tool {_shown(name)}"
        try:
            result = self.tools[name](args)
        except Exception as e:      # a bug in a tool: still an answer the model (and we) can read
            return f"error: {name} failed ({type(e).__name__})"
        kind = type(result).__name__
        return result if isinstance(result, str) else f"error: {name} returned {kind}, not text"
