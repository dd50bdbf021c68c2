"""Byte-level BPE: train one on a corpus, or load SmolLM2's from its GGUF file (tokenfile.py
reads and writes tokenizer files, SmolLM2's included).

Text becomes ids in three steps:

  1. special tokens ("<|call|>") are cut out first; each is one id, never split, never merged;
  2. a regex pre-tokenizes the rest into chunks: "What is 4821" -> "What", " is", " 4821";
     merges never cross a chunk boundary, so " is" and " 4821" are learned separately;
  3. each chunk's utf-8 bytes (ids 0..255) are merged pairwise, the earliest-learned
     merge first, until no learned merge applies.

Training learns the merges: count adjacent pairs over the corpus, merge the most
frequent one into a new id, repeat. Worked example (minbpe's, from Wikipedia),
"aaabdaaabac", 3 merges:

    a a a b d a a a b a c      (a,a) x4 is the most frequent   -> 256 = "aa"
    256 a b d 256 a b a c      (256,a) x2 and (a,b) x2 tie      -> 257 = "ab"  (ties: smaller pair)
    256 257 d 256 257 a c      (256,257) x2                    -> 258 = "aaab"
    258 d 258 a c              encode("aaabdaaabac") == [258, 100, 258, 97, 99]

Deterministic tie-breaking: among pairs with the same count, the one with the
smallest (left id, right id) wins. Hugging Face `tokenizers` has the same rule, but numbers
the bytes differently, so on ties the two can learn the same merges in another order.
"""

import dataclasses
import functools
import heapq
import sys
import time
from collections import Counter, defaultdict

import numpy as np
import regex

# GPT-2's pre-tokenizer: contractions, letters with one optional leading space, digits, other
# symbols, and whitespace (a run of spaces leaves its last space to the next word).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# SmolLM2's ("smollm" in llama.cpp; HF: Sequence[Digits(individual_digits), ByteLevel]): every
# digit is its own chunk, then the GPT-2 regex runs on the text between digits. One regex does
# both: `\p{N}` comes first, ` ?\p{N}+` is gone, and a digit ends a run of spaces the way the end
# of the text does (`(?![^\s\p{N}])` instead of `(?!\S)`), so "a  4" -> "a", "  ", "4".
SMOLLM_PATTERN = (r"\p{N}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+"
                  r"|\s+(?![^\s\p{N}])|\s+")
MINAGENT_SPECIALS = ["<|user|>", "<|assistant|>", "<|end|>", "<|call|>", "<|result|>"]
# A str may hold lone surrogates (surrogateescape, JSON); UTF-8 may not.
LONE_SURROGATE = regex.compile("[\ud800-\udfff]")
REPLACEMENT = "\ufffd"


def well_formed(text):
    """text with each lone surrogate replaced by U+FFFD, so that it has a UTF-8 encoding to
    tokenize."""
    return LONE_SURROGATE.sub(REPLACEMENT, text) if LONE_SURROGATE.search(text) else text


@functools.lru_cache(maxsize=None)
def bytes_to_unicode():
    """GPT-2's map byte -> printable char, so that every piece is a readable string.

    Printable bytes map to themselves ("a" -> "a"); the others are shifted past 255:
    space -> "Ġ", newline -> "Ċ". GGUF and HF vocabularies store pieces this way
    ("Ġis" = b" is").
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return {b: chr(b) if b in keep else chr(next(shifted)) for b in range(256)}


def to_str(piece):
    return "".join(bytes_to_unicode()[b] for b in piece)


@functools.lru_cache(maxsize=None)
def _unicode_to_bytes():
    return {c: b for b, c in bytes_to_unicode().items()}


def to_bytes(s):
    return bytes(_unicode_to_bytes()[c] for c in s)  # KeyError for a char outside the map


def _merge(ids, pair, new_id):
    """Replace every occurrence of `pair` in `ids`, left to right:

        _merge([1, 2, 3, 1, 2], (1, 2), 9) -> [9, 3, 9]
    """
    out, i = [], 0
    while i < len(ids):
        if i + 1 < len(ids) and ids[i] == pair[0] and ids[i + 1] == pair[1]:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    pieces: tuple  # id -> the bytes it stands for; a special's piece is its utf-8 name
    merges: tuple  # rank -> (left id, right id); rank 0 was learned first and is applied first
    specials: dict  # name -> id, e.g. {"<|call|>": 8195}
    pattern: str  # the pre-tokenizer regex

    # Derived tables, built on first use (cached_property writes to __dict__, which a frozen
    # dataclass allows).
    @functools.cached_property
    def _ranks(self):
        """(left, right) -> (rank, id of the merged piece). A trained tokenizer's merge r makes
        id 256 + r; SmolLM2's ids are in another order, so we look the merged bytes up instead."""
        special_ids = set(self.specials.values())
        id_of = {p: i for i, p in enumerate(self.pieces) if i not in special_ids}
        return {(a, b): (r, id_of[self.pieces[a] + self.pieces[b]])
                for r, (a, b) in enumerate(self.merges)}

    @functools.cached_property
    def _byte_ids(self):
        """byte -> id of its one-byte piece. SmolLM2's vocabulary lacks 21 bytes: 13 never occur
        in utf-8, 2 only begin characters of unassigned planes 4-11, and 6 are control characters
        (bytes 4, 6, 19, 20, 22, 29). Like HF and llama.cpp, we drop them: those characters do
        not survive a round trip."""
        special_ids = set(self.specials.values())
        return {p[0]: i for i, p in enumerate(self.pieces) if len(p) == 1 and i not in special_ids}

    @functools.cached_property
    def _split(self):
        return regex.compile(self.pattern)

    @functools.cached_property
    def _special_split(self):
        # Longest first, so that a special that is a prefix of another cannot win; the group
        # keeps them in split().
        names = sorted(self.specials, key=len, reverse=True)
        return regex.compile("(" + "|".join(map(regex.escape, names)) + ")") if names else None

    @functools.cached_property
    def _cache(self):
        return {}  # chunk -> ids; prose repeats its words, so most chunks are BPE'd only once

    @property
    def n_vocab(self):
        return len(self.pieces)

    def piece(self, i):
        return self.pieces[i]

    def special(self, name):
        if name not in self.specials:
            raise KeyError(f"no special token {name!r} in this tokenizer; it has "
                           f"{sorted(self.specials)}")
        return self.specials[name]

    def _bpe(self, chunk):
        ids = [self._byte_ids[b] for b in chunk.encode("utf-8") if b in self._byte_ids]
        while len(ids) >= 2:
            # of the pairs present, the one learned first; (inf,) marks "no such merge"
            pair = min(zip(ids, ids[1:]), key=lambda p: self._ranks.get(p, (float("inf"),)))
            if pair not in self._ranks:
                break
            ids = _merge(ids, pair, self._ranks[pair][1])
        return ids

    def encode_ordinary(self, text):
        """text -> ids, with special-token names treated as plain text (lone surrogates as
        U+FFFD)."""
        text, (cache, ids) = well_formed(text), (self._cache, [])
        if len(cache) > 500_000:  # bound the memory on endless novel text
            cache.clear()
        for chunk in self._split.findall(text):
            if chunk not in cache:
                cache[chunk] = self._bpe(chunk)
            ids.extend(cache[chunk])
        return ids

    def encode(self, text):
        """text -> ids; each special-token name in the text becomes its one id."""
        if self._special_split is None:
            return self.encode_ordinary(text)
        ids = []
        for i, part in enumerate(self._special_split.split(text)):
            # split() with one group alternates: text, special, text, special, ..., text
            ids.extend([self.specials[part]] if i % 2 else self.encode_ordinary(part))
        return ids

    def decode_bytes(self, ids):
        ids = list(ids)
        bad = [i for i in ids if not isinstance(i, (int, np.integer)) or isinstance(i, bool) or
               not 0 <= i < len(self.pieces)]
        if bad:      # pieces[-1] would quietly be the last special token
            raise ValueError(f"token ids {bad[:5]} are not ids of this tokenizer "
                             f"[0, {len(self.pieces)})")
        return b"".join(self.pieces[i] for i in ids)

    def decode(self, ids):
        # a piece can end mid-character (one byte of "é"); only then do we need "replace"
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


def add_special_tokens(tok, names):
    """A new tokenizer with `names` appended after the last id; names already present keep their
    id."""
    pieces, specials = list(tok.pieces), dict(tok.specials)
    for name in names:
        if name not in specials:
            specials[name] = len(pieces)
            pieces.append(name.encode("utf-8"))
    return Tokenizer(tuple(pieces), tok.merges, specials, tok.pattern)


# ---------------------------------------------------------------- training

def _count_words(text, pattern, specials):
    """Chunks and how often each occurs: "the cat the" -> {"the": 1, " cat": 1, " the": 1}.
    Special-token names are cut out first: they are not text, and no merge may learn them."""
    parts = regex.split("|".join(regex.escape(s) for s in specials), text) if specials else [text]
    split = regex.compile(pattern)
    counter = Counter()
    for part in parts:
        counter.update(split.findall(part))
    return counter


def _learn_merges(words, counts, n_merges, progress=False):
    """The BPE loop, without recounting the corpus at each merge.

    pair_counts[(a, b)]  occurrences of the pair, each word weighted by its count
    where[(a, b)]        indices of the words holding the pair (may hold stale ones; we check)
    heap                 (-count, pair): pops the most frequent, ties -> the smallest pair.

    A merge only changes the words that hold the pair (`words` is rewritten in place), so only
    their pairs are recounted. Counts then only fall, except for pairs with the new id, which are
    pushed fresh. So a heap entry is an upper bound: a popped entry whose count is out of date is
    pushed back with the true count ("lazy invalidation"); one that is up to date is the true
    maximum.
    """
    pair_counts, where = defaultdict(int), defaultdict(set)
    for w, (word, n) in enumerate(zip(words, counts)):
        for pair in zip(word, word[1:]):
            pair_counts[pair] += n
            where[pair].add(w)
    heap = [(-c, pair) for pair, c in pair_counts.items()]
    heapq.heapify(heap)
    merges, t0 = [], time.time()
    while len(merges) < n_merges and heap:
        neg_count, pair = heapq.heappop(heap)
        if -neg_count != pair_counts[pair]:  # stale: the count fell since this entry was pushed
            if pair_counts[pair] > 0:
                heapq.heappush(heap, (-pair_counts[pair], pair))
            continue
        new_id = 256 + len(merges)
        merges.append(pair)
        fresh = set()  # pairs with new_id: new, so not in the heap yet
        for w in where.pop(pair):
            word, n = words[w], counts[w]
            new = _merge(word, pair, new_id)
            if len(new) == len(word):
                continue  # stale entry: an earlier merge already consumed the pair in this word
            for p in zip(word, word[1:]):
                pair_counts[p] -= n
            for p in zip(new, new[1:]):
                pair_counts[p] += n
                if new_id in p:
                    where[p].add(w)
                    fresh.add(p)
            words[w] = new
        del pair_counts[pair]
        for p in fresh:
            heapq.heappush(heap, (-pair_counts[p], p))
        if progress and len(merges) % 100 == 0:
            _progress("train bpe", len(merges), n_merges, t0)
    if progress:
        _progress("train bpe", len(merges), n_merges, t0, end="\n")
    return merges


def _progress(what, done, total, t0, end=""):
    """A one-line progress bar on stderr, redrawn in place by "\\r":

        train bpe [########    ]  3100/7936  4.2 s
    """
    bar = "#" * (20 * done // max(total, 1))
    print(f"\r{what} [{bar:<20}] {done:>6}/{total}  {time.time() - t0:.1f} s", end=end,
          file=sys.stderr, flush=True)


def train(text, vocab_size=8192, pattern=GPT2_PATTERN, specials=MINAGENT_SPECIALS, progress=False):
    """Learn vocab_size - 256 merges on `text`; the specials get the ids after: 8192, 8193, ...

    Stops early (fewer pieces) if the corpus runs out of pairs."""
    chunks = _count_words(well_formed(text), pattern, specials)
    return train_counts(chunks, vocab_size, pattern, specials, progress)


def train_counts(chunks, vocab_size=8192, pattern=GPT2_PATTERN, specials=MINAGENT_SPECIALS,
                 progress=False):
    """Learn the merges from chunks already split and counted: {" the": 537, " cat": 2, ...}.

    `train` counts a text's chunks and calls this; a corpus that comes as word frequencies
    instead of running text (tasks/context/counting.py's wordfreq_chunks) calls it directly.
    Each chunk should be one the pattern would cut: merges learned inside it are applied chunk
    by chunk when encoding."""
    if vocab_size < 256:
        raise ValueError(f"vocab_size counts the 256 byte pieces, so it must be >= 256, got "
                         f"{vocab_size}")
    words = [list(chunk.encode("utf-8")) for chunk in chunks]
    merges = _learn_merges(words, list(chunks.values()), vocab_size - 256, progress)
    pieces = [bytes([b]) for b in range(256)]
    for a, b in merges:
        pieces.append(pieces[a] + pieces[b])
    return add_special_tokens(Tokenizer(tuple(pieces), tuple(merges), {}, pattern), specials)
