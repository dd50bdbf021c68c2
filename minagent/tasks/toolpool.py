"""A pool of tools that describe themselves, and episodes whose tool lists vary: to teach a model to read.

A model trained on episodes that always list the same four tools learns "arithmetic means add",
not "read the list" (experiment 08, first run: `add 84 45` for "Multiply 84 by 45.", 200 of 200).
Here every episode lists its own tools, drawn at random from a pool, in random order, and half of
them under made-up names, so that the description is the only way to know which call to write:

    You can call these tools:
    dulo WORD: spells a word in lower case.
    add A B: adds two numbers.
    kesa N: gives the square of a number.
    user: What is 12 squared?          -> <|call|>kesa 12<|result|> 144 -> 144
    user: Make QUIET lower case.       -> <|call|>dulo QUIET<|result|> quiet -> quiet
    user: Multiply 4 by 9.             -> I have no tool for that.   (no listed tool fits)

Tools (PoolTool): a Tool record (tools.Tool: name, args, description, function), its kind, and
the phrasings of its questions, split into training and test ones. Two groups:
    TRAIN      about thirty tools of seven kinds, each seen in training
    HELD_OUT   nine tools of the same kinds (and mul) that no training episode lists, under any name
Made-up names come from two disjoint pools (NAMES["train"], NAMES["test"]): a test can show a
trained tool under a name no training episode used.

An episode is a calculator Mission (minagent.tasks.calculator.missions): the same gold trace,
and `tools` (the Tool records its system text lists and its toolbox serves: one list for both).
"""

import dataclasses
import datetime
import math
import random
import string

from minagent import chat, tools
from minagent.tasks.calculator import missions
from minagent.tools import Tool, ToolError, tool

NO_TOOL = "I have no tool for that."        # the answer when no listed tool fits the question
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December")
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


# ---------------------------------------------------------------- the tools' functions
# Each takes the argument text and returns the result text; a bad argument raises ToolError.

def _args(text, n, what):
    words = text.split()
    if len(words) != n:
        raise ToolError(f"takes {what}")
    return words


def _numbers(text, n=None):
    words = text.split()
    if not words or (n is not None and len(words) != n):
        raise ToolError(f"takes {n or 'some'} number{'s' if n != 1 else ''}")
    return [tools.number(w) for w in words]


def _word(text):
    (word,) = _args(text, 1, "one word")
    return word


def _date(text):
    (word,) = _args(text, 1, "a date YYYY-MM-DD")
    try:
        return datetime.date.fromisoformat(word)
    except ValueError:
        raise ToolError(f"not a date: {word[:16]}") from None


def _table(kind, seed=1234):
    """A fixed table name -> value for the lookup tools (the same every episode)."""
    rng = random.Random(f"{kind}/{seed}")
    if kind == "email":
        return {n: f"{n.lower()}{rng.randint(1, 99)}@mail.com" for n in tools.NAMES}
    if kind == "birthday":
        return {n: f"{rng.choice(MONTHS)} {rng.randint(1, 28)}" for n in tools.NAMES}
    if kind == "office":
        return {n: f"room {rng.randint(100, 499)}" for n in tools.NAMES}
    return {n: "555-" + "".join(rng.choices(string.digits, k=4)) for n in tools.NAMES}     # phone


def _lookup_in(table):
    def fn(text):
        (name,) = _args(text, 1, "a name")
        for key, value in table.items():
            if key.lower() == name.lower():
                return value
        raise ToolError(f"unknown person {name[:16]}")
    return fn


def _convert(factor):
    return lambda text: str(_numbers(text, 1)[0] * factor)


def _count_letter(text):
    word, letter = _args(text, 2, "a word and a letter")
    return str(word.lower().count(letter.lower()))


def _exact_divide(text):
    a, b = _numbers(text, 2)
    if b == 0:
        raise ToolError("division by zero")
    return str(a // b)


def _mod(text):
    a, b = _numbers(text, 2)
    if b == 0:
        raise ToolError("division by zero")
    return str(a % b)


def _gcd(text):
    a, b = _numbers(text, 2)
    return str(math.gcd(a, b))


def _repeat(text):
    word, n = _args(text, 2, "a word and a count")
    n = tools.number(n)
    if not 1 <= n <= 5:
        raise ToolError("count from 1 to 5")
    return " ".join([word] * n)


def _add_days(text):
    d, n = _args(text, 2, "a date and a number of days")
    return (_date(d) + datetime.timedelta(days=tools.number(n))).isoformat()


def _next_day(text):
    day = _word(text).capitalize()
    if day not in DAYS:
        raise ToolError(f"not a weekday: {day[:16]}")
    return DAYS[(DAYS.index(day) + 1) % 7]


def _month_name(text):
    (n,) = _numbers(text, 1)
    if not 1 <= n <= 12:
        raise ToolError("month from 1 to 12")
    return MONTHS[n - 1]


def _average(text):
    a, b = _numbers(text, 2)
    return str((a + b) // 2) if (a + b) % 2 == 0 else str((a + b) / 2)


def _letter_at(text):
    word, n = _args(text, 2, "a word and a position")
    n = tools.number(n)
    if not 1 <= n <= len(word):
        raise ToolError(f"no letter {n} in {word[:16]}")
    return word[n - 1]


def _take(text):
    word, n = _args(text, 2, "a word and a count")
    return word[:max(tools.number(n), 0)]


def _median(text):
    nums = sorted(_numbers(text))
    if len(nums) % 2 == 0:
        raise ToolError("takes an odd count of numbers")
    return str(nums[len(nums) // 2])


def _prev_day(text):
    day = _word(text).capitalize()
    if day not in DAYS:
        raise ToolError(f"not a weekday: {day[:16]}")
    return DAYS[(DAYS.index(day) - 1) % 7]


def _month_number(text):
    name = _word(text).capitalize()
    if name not in MONTHS:
        raise ToolError(f"not a month: {name[:16]}")
    return str(MONTHS.index(name) + 1)


def _days_in_month(text):
    (n,) = _numbers(text, 1)
    if not 1 <= n <= 12:
        raise ToolError("month from 1 to 12")
    return str((31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)[n - 1])


CAPITALS = {"France": "Paris", "Spain": "Madrid", "Italy": "Rome", "Norway": "Oslo", "Japan": "Tokyo",
            "Egypt": "Cairo", "Peru": "Lima", "Greece": "Athens", "Ireland": "Dublin", "Austria": "Vienna",
            "Portugal": "Lisbon", "Germany": "Berlin", "Kenya": "Nairobi", "Chile": "Santiago"}


# ---------------------------------------------------------------- questions' values
# Each takes an rng and returns (template fields, the call's argument text).

def _num(lo, hi):
    return lambda rng: (lambda a: ({"a": a}, str(a)))(rng.randint(lo, hi))


def _two(lo, hi, lo2=None, hi2=None):
    def draw(rng):
        a, b = rng.randint(lo, hi), rng.randint(lo2 or lo, hi2 or hi)
        return {"a": a, "b": b}, f"{a} {b}"
    return draw


def _divisible(rng):
    b = rng.randint(2, 12)
    a = b * rng.randint(2, 40)
    return {"a": a, "b": b}, f"{a} {b}"


def _even(rng):
    a = 2 * rng.randint(2, 500)
    return {"a": a}, str(a)


def _celsius(rng):
    a = 5 * rng.randint(-8, 20)
    return {"a": a}, str(a)


def _words(pool):
    def draw(rng):
        w = rng.choice(pool)
        return {"w": w}, w
    return draw


def _upper_words(rng):
    w = rng.choice(WORDS).upper()
    return {"w": w}, w


def _word_letter(rng):
    w = rng.choice(WORDS)
    letter = rng.choice(w)
    return {"w": w, "l": letter}, f"{w} {letter}"


def _word_count(rng):
    w, n = rng.choice(WORDS), rng.randint(2, 4)
    return {"w": w, "n": n}, f"{w} {n}"


def _two_words(rng):
    a, b = rng.sample(WORDS, 2)
    return {"w": a, "v": b}, f"{a} {b}"


def _list(rng):
    nums = [rng.randint(1, 99) for _ in range(rng.randint(3, 5))]
    return {"nums": " ".join(map(str, nums))}, " ".join(map(str, nums))


def _name(rng):
    n = rng.choice(tools.NAMES)
    return {"name": n}, n


def _date_field(rng):
    d = datetime.date(rng.randint(1990, 2030), 1, 1) + datetime.timedelta(days=rng.randint(0, 364))
    return {"d": d.isoformat()}, d.isoformat()


def _date_days(rng):
    fields, d = _date_field(rng)
    n = rng.randint(1, 60)
    return {**fields, "n": n}, f"{d} {n}"


def _weekday(rng):
    d = rng.choice(DAYS)
    return {"day": d}, d


def _odd_list(rng):
    nums = [rng.randint(1, 99) for _ in range(rng.choice((3, 5)))]
    return {"nums": " ".join(map(str, nums))}, " ".join(map(str, nums))


def _word_position(rng):
    w = rng.choice(WORDS)
    n = rng.randint(1, len(w))
    return {"w": w, "n": n, "nth": _nth(n)}, f"{w} {n}"


def _nth(n):
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _percent(rng):
    p, a = rng.choice((10, 20, 25, 50, 75)), 100 * rng.randint(1, 40)
    return {"p": p, "a": a}, f"{p} {a}"


def _month(rng):
    m = rng.choice(MONTHS)
    return {"m": m}, m


def _country(rng):
    c = rng.choice(sorted(CAPITALS))
    return {"c": c}, c


WORDS = ("garden", "window", "pencil", "rabbit", "basket", "candle", "dragon", "forest", "guitar", "hammer",
         "island", "jacket", "kitten", "lemon", "market", "pocket", "river", "silver", "ticket", "winter",
         "bread", "cloud", "house", "apple", "music", "chair", "yellow", "bottle", "flower", "planet")


@dataclasses.dataclass(frozen=True)
class PoolTool:
    """A tool of the pool: the Tool record, its kind, how to draw a question, and its phrasings."""
    tool: Tool
    kind: str
    draw: object        # rng -> (template fields, argument text)
    train: tuple        # phrasings used in training (a held-out tool's are never used)
    test: tuple         # phrasings used only in tests


def _p(name, args, description, fn, kind, draw, train, test):
    return PoolTool(Tool(name, args, description, tool(fn)), kind, draw, tuple(train), tuple(test))


TRAIN = (
    # arithmetic
    _p("add", "A B", "adds two numbers.", lambda t: str(sum(_numbers(t, 2))), "arithmetic", _two(1, 9999),
       ("What is {a} + {b}?", "Add {a} and {b}.", "What is the sum of {a} and {b}?", "What is {a} plus {b}?"),
       ("Find the total of {a} and {b}.",)),
    _p("subtract", "A B", "subtracts B from A.", lambda t: (lambda a, b: str(a - b))(*_numbers(t, 2)),
       "arithmetic", _two(100, 999, 1, 99),
       ("What is {a} minus {b}?", "Subtract {b} from {a}.", "What is {a} - {b}?"), ("Take {b} away from {a}.",)),
    _p("square", "N", "gives the square of a number.", lambda t: str(_numbers(t, 1)[0] ** 2), "arithmetic",
       _num(2, 99), ("What is {a} squared?", "Square {a}.", "What do you get when you square {a}?"),
       ("What is the square of {a}?",)),
    _p("cube", "N", "gives the cube of a number.", lambda t: str(_numbers(t, 1)[0] ** 3), "arithmetic",
       _num(2, 30), ("What is {a} cubed?", "Cube {a}.", "What is the cube of {a}?"), ("Raise {a} to its cube.",)),
    _p("double", "N", "multiplies a number by two.", lambda t: str(2 * _numbers(t, 1)[0]), "arithmetic",
       _num(2, 999), ("Double {a}.", "What is twice {a}?", "What is double {a}?"), ("What is {a} doubled?",)),
    # (not "What is three times {a}?": with triple absent, that phrasing taught "What is N times M?"
    # -> no tool, and mul's "What is {a} times {b}?" went unanswered with mul listed; LOG, 2026-12-02)
    _p("triple", "N", "multiplies a number by three.", lambda t: str(3 * _numbers(t, 1)[0]), "arithmetic",
       _num(2, 999), ("Triple {a}.", "What is thrice {a}?", "What is {a} tripled?"),
       ("What do you get when you triple {a}?",)),
    _p("half", "N", "divides a number by two.", lambda t: str(_numbers(t, 1)[0] // 2), "arithmetic", _even,
       ("Halve {a}.", "What is half of {a}?", "What is {a} halved?"), ("Divide {a} by two.",)),
    _p("divide", "A B", "divides A by B.", _exact_divide, "arithmetic", _divisible,
       ("What is {a} divided by {b}?", "Divide {a} by {b}.", "What is {a} / {b}?"),
       ("How many times does {b} go into {a}?",)),
    _p("power", "A B", "raises A to the power B.", lambda t: (lambda a, b: str(a ** min(b, 9)))(*_numbers(t, 2)),
       "arithmetic", _two(2, 9, 4, 6),
       ("What is {a} to the power {b}?", "Raise {a} to the power {b}.", "What is {a} to the {b}th power?"),
       ("What is {a} raised to the power of {b}?",)),
    _p("increment", "N", "adds one to a number.", lambda t: str(_numbers(t, 1)[0] + 1), "arithmetic",
       _num(1, 9999), ("What number comes after {a}?", "Add one to {a}.", "What is one more than {a}?"),
       ("Increase {a} by one.",)),
    _p("average", "A B", "gives the average of two numbers.", _average, "arithmetic", _two(1, 999),
       ("What is the average of {a} and {b}?", "Average {a} and {b}.", "What is the mean of {a} and {b}?"),
       ("Find the midpoint of {a} and {b}.",)),
    _p("distance", "A B", "gives how far apart two numbers are.",
       lambda t: (lambda a, b: str(abs(a - b)))(*_numbers(t, 2)), "arithmetic", _two(1, 999),
       ("How far apart are {a} and {b}?", "What is the gap between {a} and {b}?",
        "What is the distance between {a} and {b}?"), ("How much lies between {a} and {b}?",)),
    _p("percent", "P N", "gives P percent of N.", lambda t: (lambda p, a: str(p * a // 100))(*_numbers(t, 2)),
       "arithmetic", _percent, ("What is {p} percent of {a}?", "What is {p}% of {a}?", "Take {p} percent of {a}."),
       ("How much is {p} percent of {a}?",)),
    # strings
    _p("reverse", "WORD", "spells a word backwards.", lambda t: _word(t)[::-1], "string", _words(WORDS),
       ("Reverse the word {w}.", "Write {w} backwards.", "What is {w} spelled backwards?"),
       ("Spell {w} in reverse.",)),
    _p("lower", "WORD", "writes a word in lower case.", lambda t: _word(t).lower(), "string", _upper_words,
       ("Write {w} in lower case.", "Make {w} lower case.", "Give {w} in small letters."),
       ("Turn {w} into small letters.",)),
    _p("length", "WORD", "counts the letters of a word.", lambda t: str(len(_word(t))), "string",
       _words(WORDS), ("How many letters are in {w}?", "How long is the word {w}?", "How many letters does {w} have?"),
       ("Count the letters of {w}.",)),
    _p("first", "WORD", "gives the first letter of a word.", lambda t: _word(t)[0], "string", _words(WORDS),
       ("What is the first letter of {w}?", "Which letter does {w} start with?", "How does {w} begin?"),
       ("Give the first letter of {w}.",)),
    _p("last", "WORD", "gives the last letter of a word.", lambda t: _word(t)[-1], "string", _words(WORDS),
       ("What is the last letter of {w}?", "Which letter does {w} end with?", "How does {w} end?"),
       ("Give the final letter of {w}.",)),
    _p("letter_at", "WORD N", "gives letter number N of WORD.", _letter_at, "string", _word_position,
       ("What is letter {n} of {w}?", "What is the {nth} letter of {w}?", "Which letter is at position {n} in {w}?"),
       ("Give me letter number {n} of the word {w}.",)),
    _p("take", "WORD N", "gives the first N letters of WORD.", _take, "string", _word_position,
       ("What are the first {n} letters of {w}?", "Give the first {n} letters of {w}.",
        "Cut {w} to its first {n} letters."), ("Keep only the first {n} letters of {w}.",)),
    _p("capitalize", "WORD", "writes a word with a capital first letter.", lambda t: _word(t).capitalize(),
       "string", _words(WORDS), ("Capitalize {w}.", "Write {w} with a capital letter.", "Start {w} with a capital."),
       ("Give {w} a capital first letter.",)),
    _p("join", "A B", "joins two words into one.", lambda t: "".join(_args(t, 2, "two words")), "string",
       _two_words, ("Join {w} and {v}.", "Glue {w} and {v} together.", "Write {w} and {v} as one word."),
       ("Put {w} and {v} together as one word.",)),
    _p("sort_letters", "WORD", "puts the letters of a word in alphabetical order.",
       lambda t: "".join(sorted(_word(t))), "string", _words(WORDS),
       ("Sort the letters of {w}.", "Put the letters of {w} in alphabetical order.", "Order the letters in {w}."),
       ("Arrange the letters of {w} from a to z.",)),
    # counting
    _p("count_letter", "WORD L", "counts how many times letter L appears in WORD.", _count_letter, "counting",
       _word_letter, ("How many times does {l} appear in {w}?", "Count the letter {l} in {w}.",
                      "How many {l}s are in {w}?"), ("How often is the letter {l} in {w}?",)),
    _p("count", "N1 N2 ...", "counts how many numbers there are.", lambda t: str(len(_numbers(t))), "counting",
       _list, ("How many numbers are in {nums}?", "Count the numbers {nums}.", "How many values are in the list {nums}?"),
       ("How many values: {nums}?",)),
    _p("count_even", "N1 N2 ...", "counts the even numbers in a list.",
       lambda t: str(sum(x % 2 == 0 for x in _numbers(t))), "counting", _list,
       ("How many even numbers are in {nums}?", "Count the even numbers in {nums}.",
        "How many of {nums} are even?"), ("Of {nums}, how many are even?",)),
    _p("digits", "N", "counts the digits of a number.", lambda t: str(len(str(abs(_numbers(t, 1)[0])))),
       "counting", _num(1, 99999999), ("How many digits does {a} have?", "Count the digits of {a}.",
                                        "How many digits are in {a}?"), ("How long is the number {a} in digits?",)),
    # lists
    _p("sort", "N1 N2 ...", "puts numbers in increasing order.",
       lambda t: " ".join(map(str, sorted(_numbers(t)))), "list", _list,
       ("Sort {nums}.", "Put {nums} in order.", "Order {nums} from small to large."),
       ("List {nums} in increasing order.",)),
    _p("minimum", "N1 N2 ...", "gives the smallest of some numbers.", lambda t: str(min(_numbers(t))), "list",
       _list, ("What is the smallest of {nums}?", "Which is the lowest of {nums}?", "Find the least of {nums}."),
       ("Find the minimum of {nums}.",)),
    _p("total", "N1 N2 ...", "adds up a list of numbers.", lambda t: str(sum(_numbers(t))), "list", _list,
       ("What do {nums} add up to?", "Sum up {nums}.", "Add up the list {nums}."), ("Give the total of {nums}.",)),
    _p("median", "N1 N2 ...", "gives the middle value of some numbers.", _median, "list", _odd_list,
       ("What is the median of {nums}?", "Find the middle value of {nums}.", "Which number of {nums} is the median?"),
       ("Give the median of {nums}.",)),
    _p("backwards", "N1 N2 ...", "writes a list of numbers in reverse order.",
       lambda t: " ".join(map(str, _numbers(t)[::-1])), "list", _list,
       ("Write {nums} in reverse order.", "Reverse the list {nums}.", "Turn the list {nums} around."),
       ("List {nums} from last to first.",)),
    # lookups
    _p("email", "NAME", "reads a person's email address.", _lookup_in(_table("email")), "lookup", _name,
       ("What is {name}'s email?", "Give me the email address of {name}.", "Which email does {name} use?"),
       ("How can I email {name}?",)),
    _p("birthday", "NAME", "reads a person's birthday.", _lookup_in(_table("birthday")), "lookup", _name,
       ("When is {name}'s birthday?", "What is the birthday of {name}?", "On which day was {name} born?"),
       ("When does {name} celebrate their birthday?",)),
    _p("office", "NAME", "reads which room a person works in.", _lookup_in(_table("office")), "lookup", _name,
       ("Which room does {name} work in?", "Where is {name}'s office?", "What is {name}'s office room?"),
       ("In which room can I find {name}?",)),
    _p("capital", "COUNTRY", "gives the capital city of a country.", _lookup_in(CAPITALS), "lookup", _country,
       ("What is the capital of {c}?", "Which city is the capital of {c}?", "Name the capital of {c}."),
       ("What city is {c}'s capital?",)),
    # conversions
    _p("km_to_m", "N", "converts kilometres to metres.", _convert(1000), "conversion", _num(1, 99),
       ("How many metres are {a} km?", "Convert {a} kilometres to metres.", "What is {a} kilometres in metres?"),
       ("What is {a} km in metres?",)),
    _p("min_to_s", "N", "converts minutes to seconds.", _convert(60), "conversion", _num(1, 120),
       ("How many seconds are in {a} minutes?", "Convert {a} minutes to seconds.", "What is {a} min in seconds?"),
       ("What is {a} minutes in seconds?",)),
    _p("hours_to_min", "N", "converts hours to minutes.", _convert(60), "conversion", _num(1, 48),
       ("How many minutes are in {a} hours?", "Convert {a} hours to minutes.", "What is {a} h in minutes?"),
       ("What is {a} hours in minutes?",)),
    _p("weeks_to_days", "N", "converts weeks to days.", _convert(7), "conversion", _num(1, 52),
       ("How many days are in {a} weeks?", "Convert {a} weeks to days.", "How many days do {a} weeks last?"),
       ("What is {a} weeks in days?",)),
    _p("years_to_months", "N", "converts years to months.", _convert(12), "conversion", _num(1, 80),
       ("How many months are in {a} years?", "Convert {a} years to months.", "How many months do {a} years last?"),
       ("What is {a} years in months?",)),
    _p("m_to_cm", "N", "converts metres to centimetres.", _convert(100), "conversion", _num(1, 99),
       ("How many centimetres are {a} metres?", "Convert {a} m to cm.", "What is {a} metres in centimetres?"),
       ("What is {a} metres in cm?",)),
    _p("kg_to_g", "N", "converts kilograms to grams.", _convert(1000), "conversion", _num(1, 99),
       ("How many grams are {a} kg?", "Convert {a} kilograms to grams.", "What do {a} kilograms weigh in grams?"),
       ("What is {a} kg in grams?",)),
    _p("ft_to_in", "N", "converts feet to inches.", _convert(12), "conversion", _num(1, 99),
       ("How many inches are {a} feet?", "Convert {a} feet to inches.", "What is {a} ft in inches?"),
       ("What is {a} feet in inches?",)),
    _p("dozens", "N", "converts dozens to single items.", _convert(12), "conversion", _num(1, 50),
       ("How many eggs are in {a} dozen?", "How many items make {a} dozen?", "Convert {a} dozen to items."),
       ("How many is {a} dozen?",)),
    _p("c_to_f", "C", "converts degrees Celsius to Fahrenheit.",
       lambda t: str(_numbers(t, 1)[0] * 9 // 5 + 32), "conversion", _celsius,
       ("What is {a} degrees Celsius in Fahrenheit?", "Convert {a} C to Fahrenheit.",
        "How many Fahrenheit is {a} Celsius?"), ("How warm is {a} Celsius in Fahrenheit?",)),
    # dates
    _p("weekday", "YYYY-MM-DD", "tells the day of the week of a date.", lambda t: DAYS[_date(t).weekday()],
       "date", _date_field, ("What day of the week was {d}?", "Which weekday is {d}?", "What weekday falls on {d}?"),
       ("On what day of the week is {d}?",)),
    _p("month_name", "N", "gives the name of month number N.", _month_name, "date", _num(1, 12),
       ("What is the name of month {a}?", "Which month is month number {a}?", "What is month {a} called?"),
       ("Name month {a}.",)),
    _p("month_number", "MONTH", "gives the number of a month (1 to 12).", _month_number, "date", _month,
       ("Which number is the month of {m}?", "What is the number of {m}?", "Give the month number of {m}."),
       ("What number does {m} have among the months?",)),
    _p("days_in_month", "N", "tells how many days month N has (not in a leap year).", _days_in_month, "date",
       _num(1, 12), ("How many days does month {a} have?", "How long is month {a} in days?",
                     "How many days are in month number {a}?"), ("Count the days of month {a}.",)),
    _p("next_day", "DAY", "gives the day after a day of the week.", _next_day, "date", _weekday,
       ("What day comes after {day}?", "Which day follows {day}?", "What is tomorrow if today is {day}?"),
       ("What is the day after {day}?",)),
    _p("prev_day", "DAY", "gives the day before a day of the week.", _prev_day, "date", _weekday,
       ("What day comes before {day}?", "Which day precedes {day}?", "What was yesterday if today is {day}?"),
       ("What is the day before {day}?",)),
    _p("add_days", "YYYY-MM-DD N", "gives the date N days after a date.", _add_days, "date", _date_days,
       ("What date is {n} days after {d}?", "Add {n} days to {d}.", "Which date is {n} days past {d}?"),
       ("Which date falls {n} days after {d}?",)),
    _p("year", "YYYY-MM-DD", "gives the year of a date.", lambda t: str(_date(t).year), "date", _date_field,
       ("In which year is {d}?", "What year does {d} fall in?", "Which year is the date {d} in?"),
       ("Give the year of {d}.",)),
)

# Tools that could also answer another tool's question with one call ("What is 7 plus 1?": add 7 1),
# or by a few calls of their own (a list's total, two numbers at a time with add). An episode whose
# answer is "no tool" never lists them: that answer would be wrong. (Before total named add here, a
# total's question answered "no tool" beside add taught "a total is not an addition": "Find the total
# of A and B." went unanswered with add listed, 24 of 100 times; experiments/LOG.md, 2026-12-03.)
ALSO_FITS = {"add": ("total",), "total": ("add",), "increment": ("add",), "double": ("add",),
             "square": ("power",), "cube": ("power",), "half": ("divide", "percent"),
             "subtract": ("distance",), "distance": ("subtract",), "first": ("take", "letter_at"),
             "last": ("letter_at",), "letter_at": ("first", "last", "take")}

# Never in training, under any name: mul, and nine tools of the trained kinds.
HELD_OUT = (
    _p("mul", "A B", "multiplies A by B.", lambda t: (lambda a, b: str(a * b))(*_numbers(t, 2)), "arithmetic",
       _two(10, 99), (), ("What is {a} times {b}?", "Multiply {a} by {b}.", "What is the product of {a} and {b}?")),
    _p("mod", "A B", "gives the remainder of A divided by B.", _mod, "arithmetic", _two(20, 999, 2, 19), (),
       ("What is the remainder when {a} is divided by {b}?", "What is {a} modulo {b}?")),
    _p("gcd", "A B", "gives the greatest common divisor of A and B.", _gcd, "arithmetic", _two(10, 200), (),
       ("What is the greatest common divisor of {a} and {b}?", "Find the gcd of {a} and {b}.")),
    _p("upper", "WORD", "writes a word in capital letters.", lambda t: _word(t).upper(), "string", _words(WORDS),
       (), ("Write {w} in capital letters.", "Make {w} upper case.")),
    _p("repeat", "WORD N", "writes WORD N times.", _repeat, "string", _word_count, (),
       ("Write {w} {n} times.", "Repeat the word {w} {n} times.")),
    _p("vowels", "WORD", "counts the vowels in a word.", lambda t: str(sum(c in "aeiou" for c in _word(t).lower())),
       "counting", _words(WORDS), (), ("How many vowels are in {w}?", "Count the vowels of {w}.")),
    _p("maximum", "N1 N2 ...", "gives the largest of some numbers.", lambda t: str(max(_numbers(t))), "list",
       _list, (), ("What is the largest of {nums}?", "Which is the highest of {nums}?")),
    _p("phone", "NAME", "reads a person's phone number.", _lookup_in(_table("phone")), "lookup", _name, (),
       ("What is {name}'s phone number?", "How can I call {name} on the phone?")),
    _p("days_to_hours", "N", "converts days to hours.", _convert(24), "conversion", _num(1, 60), (),
       ("How many hours are in {a} days?", "Convert {a} days to hours.")),
    _p("day_of_year", "YYYY-MM-DD", "tells which day of its year a date is (1 to 366).",
       lambda t: str(_date(t).timetuple().tm_yday), "date", _date_field, (),
       ("Which day of the year is {d}?", "What is the day number of {d} in its year?")),
)

BY_NAME = {p.tool.name: p for p in TRAIN + HELD_OUT}
CALCULATOR = {"add", "reverse", "sort"}     # trained tools the calculator missions share by name with TRAIN


def _made_up(consonants, vowels, n, seed):
    """n distinct pronounceable two-syllable names ("dulo", "kesa") from these letters."""
    rng, names = random.Random(seed), []
    while len(names) < n:
        name = "".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(2))
        if name not in names and name not in BY_NAME:
            names.append(name)
    return tuple(names)


# Disjoint by construction: the test names use consonants no training name has.
NAMES = {"train": _made_up("bdgklmnprst", "aeiou", 150, 0), "test": _made_up("fvzxjwhc", "aeiouy", 80, 1)}


# ---------------------------------------------------------------- episodes

@dataclasses.dataclass(frozen=True)
class Episode:
    """A Mission (its question, gold trace and answer) with the tools its system text lists."""
    mission: missions.Mission
    tools: tuple          # the Tool records its system text lists and its toolbox serves, as shown
    target: str           # the name of the tool the question is for: as listed, or its own if not listed

    def toolbox(self):
        return tools.Toolbox(tools=self.tools)

    @property
    def listed(self):
        return {t.name for t in self.tools}


# Ways to ask in training, around a tool's own phrasing: the words around a question are no reason
# to answer it otherwise. (Tests use the bare phrasing.)
FRAMES = ("{q}", "{q}", "{q}", "Please help: {q}", "Hi! {q}", "{q} Thanks.", "Quick question. {q}",
          "Can you tell me this? {q}", "I need an answer. {q}")


def question(pt, rng, split):
    """(question text, gold call's argument text) for pool tool pt, in a phrasing of split."""
    fields, args = pt.draw(rng)
    q = rng.choice(pt.train if split == "train" else pt.test).format(**fields)
    return (rng.choice(FRAMES).format(q=q) if split == "train" else q), args


def episode(rng, target, q, args, listed, fmt, *, rename=0.5, names="train", rename_target=None, mistake=None):
    """One episode: question q for Tool `target` (gold call: its name, then `args`), the system text
    listing the Tools `listed` in the order given, each renamed with probability `rename` to a
    made-up name of NAMES[names] (the target: always if rename_target is True, never if False).
    If the target is not listed the gold answer is NO_TOOL, without a call.

    mistake: a function (shown tools, the gold call) -> a call that answers an error, or None. The
    trace then starts with that call, written for the model but not learned (chat.tool_round's
    author=PROGRAM), and its error: the model learns to read an error and make the right call."""
    shown = []
    for t in listed:
        odds = rename if t is not target or rename_target is None else float(rename_target)
        name = rng.choice(NAMES[names]) if rng.random() < odds else t.name
        while name in [s.name for s in shown]:
            name = rng.choice(NAMES[names])
        shown.append(t.renamed(name))
    trace = [chat.prompt(fmt, q, tools.describe(shown))]
    if target in listed:
        name = shown[listed.index(target)].name
        call, box = f"{name} {args}", tools.Toolbox(tools=shown)
        wrong = mistake(shown, call) if mistake else None
        if wrong is not None:
            trace += chat.tool_round(fmt, wrong, box(wrong), author=chat.PROGRAM)
        result = box(call)
        trace += chat.tool_round(fmt, call, result)
        calls, answer = ((wrong,) if wrong else ()) + (call,), result
    else:
        name, calls, answer = target.name, (), NO_TOOL
    trace.append(chat.answer(fmt, answer))
    m = missions.Mission(f"tool:{target.name}", q, answer, 0, False, calls, tuple(trace),
                         (trace[0], chat.answer(fmt, answer)))
    return Episode(m, tuple(shown), name)


def a_mistake(rng):
    """-> mistake(shown, gold call): the same arguments given to another listed tool that refuses
    them, or else the right tool with its last argument left out; None if neither answers an error."""
    def mistake(shown, call):
        name, _, args = call.partition(" ")
        box = tools.Toolbox(tools=shown)
        wrong = [f"{t.name} {args}" for t in shown if t.name != name]
        if len(args.split()) > 1:
            wrong.append(f"{name} {args.rsplit(' ', 1)[0]}")
        wrong = [w for w in wrong if box(w).startswith("error")]
        return rng.choice(wrong) if wrong else None
    return mistake


def draw_listed(rng, pool, k, must=None, never=()):
    """k Tools: `must` (if given) and others of pool (PoolTools) but none of `never`, in random order."""
    others = [pt.tool for pt in pool if pt.tool is not must and pt.tool not in never]
    chosen = rng.sample(others, k - (must is not None)) + ([must] if must is not None else [])
    rng.shuffle(chosen)
    return chosen


def training_set(n, seed, fmt, *, absent=0.1, rename=0.7, mistakes=0.1, twins=True):
    """n training episodes over TRAIN: a tool's question with that tool among the 2 to 6 listed, or
    (a fraction `absent`) not listed, nor any tool that could also answer it (ALSO_FITS), answered
    NO_TOOL. A fraction `mistakes` of the others start with a wrong call and its error. Each tool is
    shown under a made-up name with probability `rename`. No HELD_OUT tool appears, under any name.

    twins: each NO_TOOL episode is followed by its twin, the same question with the same list but
    one tool swapped for the one that fits (same names, same order), answered by calling it. The
    pair differs only in the list, so the list is the only reason to answer "I have no tool for
    that.": without twins a model learned to refuse by the question's words ("What is A times B?"
    refused with mul listed; experiments/LOG.md, 2026-12-02)."""
    out = []
    for i in range(n):
        if len(out) >= n:
            break
        rng = random.Random(f"pool/train/{seed}/{i}")
        pt = rng.choice(TRAIN)
        q, args = question(pt, rng, "train")
        k = rng.randint(2, 6)
        if rng.random() < absent:
            never = (pt.tool,) + tuple(BY_NAME[n].tool for n in ALSO_FITS.get(pt.tool.name, ()))
            listed = draw_listed(rng, TRAIN, k, never=never)
            # one stream of made-up names for both: the twin shows the others under the same names
            naming = f"pool/train/{seed}/{i}/names"
            out.append(episode(random.Random(naming), pt.tool, q, args, listed, fmt, rename=rename))
            if twins and len(out) < n:
                twin = list(listed)
                twin[rng.randrange(k)] = pt.tool
                out.append(episode(random.Random(naming), pt.tool, q, args, twin, fmt, rename=rename))
            continue
        listed = draw_listed(rng, TRAIN, k, must=pt.tool)
        mistake = a_mistake(rng) if rng.random() < mistakes else None
        out.append(episode(rng, pt.tool, q, args, listed, fmt, rename=rename, mistake=mistake))
    return out


def test_set(target, n, seed, fmt, *, described=True, rename_target=False, draw=None):
    """n test episodes for `target` (a PoolTool, or a Tool with draw(rng) -> (question, args)): listed
    among 2 to 6 TRAIN tools shown under test names half the time (described), or not listed."""
    tool_ = target.tool if isinstance(target, PoolTool) else target
    out = []
    for i in range(n):
        rng = random.Random(f"pool/test/{tool_.name}/{described}/{seed}/{i}")
        q, args = question(target, rng, "test") if draw is None else draw(rng)
        k = rng.randint(2, 6)
        listed = draw_listed(rng, TRAIN, k, must=tool_ if described else None, never=(tool_,))
        out.append(episode(rng, tool_, q, args, listed, fmt, names="test", rename_target=rename_target))
    return out
