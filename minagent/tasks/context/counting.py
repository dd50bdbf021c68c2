"""Counting a message's tokens: exactly with a tokenizer, or estimated by script without one.

Context budgets need token counts. With the tokenizer at hand, count exactly
(`exact_counter`). Without it (a provider's model), estimate: characters / 4 is
an assumption about English, so the estimate counts by script instead, each
rate rounded the way that errs toward more tokens:

    estimate_tokens("Вера, 水車!") -> ceil(3 ASCII / 4) + 2 CJK / 1 + ceil(4 other / 2) = 5    (chars4: 3)

A message never changes once written, so each is counted once (`Counter`).
`utf8_bytes` is the one estimate that errs high for any byte-level tokenizer.
"""

import dataclasses
import functools
import math
import re
from collections import Counter as _Tally

import regex

from minagent import chat
from minagent.tokenizer import GPT2_PATTERN

class Counter:
    """count(message) -> tokens, remembered: a message never changes once written, so each
    is counted once, however many views it is in. Keyed by the message's value (kind, text):
    equal messages have equal counts."""

    def __init__(self, count_fn):
        self.count_fn = count_fn   # message -> int
        self.memo = {}

    def __call__(self, message):
        if message not in self.memo:
            self.memo[message] = self.count_fn(message)
        return self.memo[message]


def exact_counter(tok, fmt=None):
    """Exact counts with tokenizer `tok`: of the rendered segment when `fmt` is given, else of the text."""
    if fmt is None:
        return Counter(lambda m: len(tok.encode_ordinary(m.text)))
    return Counter(lambda m: len(chat.encode(tok, chat.render_message(m, fmt))))


@dataclasses.dataclass(frozen=True)
class Rates:
    """Characters per token, by script, each rounded the way that errs toward more tokens."""
    ascii: float   # plain ASCII: English, code, digits, spaces
    cjk: float     # Chinese, Japanese and Korean characters and their punctuation
    other: float   # everything else: Cyrillic, Greek, Arabic, accented letters, emoji, ...


# The design document's rates, read off a large multilingual tokenizer (a provider's). They are
# rates of a tokenizer with many pieces for each script, not of the scripts themselves: a small
# tokenizer with few non-English pieces spends more tokens there (README, "Counting tokens").
DOCUMENT_RATES = Rates(ascii=4, cjk=1, other=2)
# SmolLM2's, read off the samples in tests/data/scripts/ and rounded toward more tokens. Rates read
# from one text estimate another, they do not bound it; utf8_bytes is the bound.
SMOLLM2_RATES = Rates(ascii=4, cjk=0.5, other=1)

_CJK = re.compile("[\u1100-\u11ff"          # Hangul Jamo
                  "\u2e80-\u2fdf"           # CJK radicals, Kangxi radicals
                  "\u3000-\u303f"           # CJK symbols and punctuation: 、。「」
                  "\u3040-\u30ff"           # Hiragana, Katakana
                  "\u3100-\u31ff"           # Bopomofo, Hangul compatibility Jamo, Kanbun, CJK strokes
                  "\u3200-\u4dbf"           # enclosed CJK, CJK compatibility, CJK extension A
                  "\u4e00-\u9fff"           # CJK unified ideographs
                  "\ua960-\ua97f\uac00-\ud7ff"   # Hangul Jamo extended, Hangul syllables
                  "\uf900-\ufaff\ufe30-\ufe4f"   # CJK compatibility ideographs and forms
                  "\uff00-\uffef"           # halfwidth and fullwidth forms: ，！？
                  "\U00020000-\U0003ffff]+")   # CJK extensions B and later
_ASCII = re.compile("[\x00-\x7f]+")


def script_counts(text):
    """text -> (ASCII, CJK, other) characters: "Вера, 水車!" -> (3, 2, 4)."""
    n_ascii = sum(map(len, _ASCII.findall(text)))
    n_cjk = sum(map(len, _CJK.findall(text)))
    return n_ascii, n_cjk, len(text) - n_ascii - n_cjk


@functools.lru_cache(maxsize=4096)
def estimate_tokens(text, rates=DOCUMENT_RATES):
    """Tokens of `text` without a tokenizer, counted by script and made to err high.

    With the design document's rates: ceil(ASCII / 4) + CJK + ceil(other / 2).
    "Вера, 水車!" -> ceil(3/4) + 2 + ceil(4/2) = 5, where chars4 says 3.
    """
    n_ascii, n_cjk, n_other = script_counts(text)
    return (math.ceil(n_ascii / rates.ascii) + math.ceil(n_cjk / rates.cjk)
            + math.ceil(n_other / rates.other))


def utf8_bytes(text):
    """The bound for any byte-level tokenizer: each token holds at least one byte, so tokens <= bytes.
    The only estimate that errs high whatever the tokenizer learned (one trained on English only
    has no merges for Cyrillic or CJK and spends a token per byte there), and 4x too high on English."""
    return len(text.encode("utf-8"))


def chars4(text):
    """The old estimate, characters / 4: fair for English, an assumption about English."""
    return math.ceil(len(text) / 4)


def estimate_counter(rates=DOCUMENT_RATES):
    """Estimated counts, for when there is no tokenizer at hand (a provider's model)."""
    return Counter(lambda m: estimate_tokens(m.text, rates))


# ---------------------------------------------------------------- a corpus with every script

# Languages written without spaces between words: their words are chunks as they are; the words of
# every other language get a leading space, " word", as the pre-tokenizer cuts them from running text.
UNSPACED = ("zh", "ja", "th")


def wordfreq_chunks(langs=("en", "ru", "zh", "ja"), n_words=50_000, mass=10_000_000, pattern=GPT2_PATTERN):
    """A multilingual corpus without running text: each language's n_words most frequent words from
    the `wordfreq` package, counted in proportion to their frequency, every language the same `mass`.

    wordfreq folds case, so for spaced languages each lowercase word also comes capitalized, as in running
    text: " Word" at a tenth of " word" (a sentence's first word) and "Word" at a fiftieth (a
    paragraph's first word, with no space before it). Chinese and Japanese words come bare: the
    pre-tokenizer keeps a run of their characters in one chunk, and the merges learned on words
    apply inside it. A corpus like this has no punctuation or digit runs, so those stay bytes."""
    try:
        import wordfreq
    except ImportError as e:
        raise ImportError("wordfreq_chunks needs the wordfreq package: pip install -e '.[test]'") from e
    split, chunks = regex.compile(pattern), _Tally()

    def add(text, n):   # a word like "don't" is two chunks, "don" and "'t"
        for chunk in split.findall(text):
            chunks[chunk] += n

    for lang in langs:
        top = sorted(wordfreq.get_frequency_dict(lang, wordlist="large").items(), key=lambda kv: -kv[1])[:n_words]
        total = sum(f for _, f in top)
        for word, f in top:
            n = max(1, round(mass * f / total))
            if lang in UNSPACED:
                add(word, n)
                continue
            add(" " + word, n)
            if word[:1].islower():
                title = word[:1].upper() + word[1:]
                add(" " + title, max(1, round(n / 10)))
                add(title, max(1, round(n / 50)))
    return chunks
