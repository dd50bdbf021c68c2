"""Tests for minagent/tokenizer.py: round trips on tricky strings, a hand-checkable known answer,
special tokens, save/load, the incremental trainer against a slow recount-everything reference,
and SmolLM2's tokenizer against its known ids (and against Hugging Face when installed).

    python -m pytest tests/engine/test_tokenizer.py
"""

import random
from collections import Counter

import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st

from minagent import tokenfile
from minagent import tokenizer as tk

TRICKY = [
    "", " ", "hello world", "  leading and trailing  ", "\r\n", "a\r\nb\r\n\r\n", "\t\tx\n\n",
    "👋", "👋🏽", "👨\u200d👩\u200d👧\u200d👦 family", "🏳️\u200d🌈",  # ZWJ sequences
    "日本語のテキスト", "中文 和 한국어", "Привет, мир!", "مرحبا",
    "\x00\x01\x04\x1f\x7f", "a" * 1000, " " * 1000, "7" * 1000, "x  4821   3907", "\u0301", "e\u0301\u0301 ",
    "naïve café", "\ufeffBOM", "\U0010ffff", "it's we'VE they'll", "<|call", "|>", "<|nope|>",
]
SPECIAL_TEXT = "<|user|> What is 4821 + 3907? <|assistant|><|call|> add 4821 3907 <|result|> 8728 <|end|>"


def english_ish(n_sentences=300, seed=0):
    """A few KB of deterministic fake prose with numbers, punctuation and contractions."""
    rng = random.Random(seed)
    words = ("the a of to and in is it that was for on are with as his they be at one have this from or "
             "had by word but what some we can out other were all there when up use your how said an each "
             "she which do their time if will way about many then them write would like so these her long "
             "make thing see him two has look more day could go come did number sound no most people my").split()
    lines = []
    for _ in range(n_sentences):
        s = " ".join(rng.choice(words) for _ in range(rng.randint(4, 14)))
        s = s.capitalize() + rng.choice([".", "?", "!", ", 42.", " (1999).", "'s end."])
        if rng.random() < 0.2:
            s += f" {rng.randint(0, 99999)} + {rng.randint(0, 9999)}"
        lines.append(s)
    return "\n".join(lines)


CORPUS = english_ish()
PATTERNS = {"gpt2": tk.GPT2_PATTERN, "smollm": tk.SMOLLM_PATTERN}


@pytest.fixture(scope="module", params=["gpt2", "smollm"])
def trained(request):
    return tk.train(CORPUS, vocab_size=400, pattern=PATTERNS[request.param])


# ---------------------------------------------------------------- round trips

@pytest.mark.parametrize("s", TRICKY)
def test_round_trip_tricky(trained, s):
    assert trained.decode(trained.encode(s)) == s
    assert trained.decode(trained.encode_ordinary(s)) == s
    assert trained.decode_bytes(trained.encode(s)) == s.encode("utf-8")


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_round_trip_any_text(s):
    for pattern in PATTERNS.values():
        tok = _small(pattern)
        assert tok.decode(tok.encode(s)) == s


def _small(pattern, _cache={}):  # hypothesis dislikes function-scoped fixtures; train once per pattern
    if pattern not in _cache:
        _cache[pattern] = tk.train(CORPUS, vocab_size=300, pattern=pattern)
    return _cache[pattern]


def test_decode_partial_piece_replaces():
    tok = tk.train(CORPUS, vocab_size=260)
    ids = tok.encode("é")  # two bytes, no merge for them in an ASCII corpus
    assert ids == [0xC3, 0xA9] and tok.decode(ids[:1]) == "\ufffd"


# ---------------------------------------------------------------- known answers

def test_known_answer_wikipedia():
    # aaabdaaabac -> ZabdZabac -> ZYdZYac -> XdXac (Z = aa, Y = ab, X = ZY); see the module docstring
    tok = tk.train("aaabdaaabac", vocab_size=259, specials=[])
    assert tok.merges == ((97, 97), (97, 98), (256, 257))
    assert tok.pieces[256:] == (b"aa", b"ab", b"aaab")
    assert tok.encode("aaabdaaabac") == [258, 100, 258, 97, 99]
    assert tok.n_vocab == 259 and tok.specials == {}


def test_pre_tokenizers_split():
    split = lambda p, s: regex.findall(p, s)  # noqa: E731
    assert split(tk.GPT2_PATTERN, "What is 4821 + 3907?") == ["What", " is", " 4821", " +", " 3907", "?"]
    assert split(tk.SMOLLM_PATTERN, "What is 4821 + 3907?") == \
        ["What", " is", " ", "4", "8", "2", "1", " +", " ", "3", "9", "0", "7", "?"]
    # a digit ends a run of spaces as the end of the text does: all spaces stay together
    assert split(tk.SMOLLM_PATTERN, "a   4 b") == ["a", "   ", "4", " b"]
    assert split(tk.GPT2_PATTERN, "a   b") == ["a", "  ", " b"]


# ---------------------------------------------------------------- specials

def test_specials_follow_the_learned_pieces():
    tok = tk.train(CORPUS, vocab_size=300)
    assert len(tok.merges) == 300 - 256
    assert tok.specials == {"<|user|>": 300, "<|assistant|>": 301, "<|end|>": 302, "<|call|>": 303, "<|result|>": 304}
    assert tok.n_vocab == 305 and tok.special("<|call|>") == 303
    # the design documents' numbering: a BPE of 8192 pieces puts <|call|> at 8195 and <|result|> at 8196
    assert [8192 + tk.MINAGENT_SPECIALS.index(n) for n in ("<|call|>", "<|result|>")] == [8195, 8196]


def test_specials_are_atomic(trained):
    ids = trained.encode(SPECIAL_TEXT)
    for name in tk.MINAGENT_SPECIALS:
        assert ids.count(trained.special(name)) == 1
    assert trained.decode(ids) == SPECIAL_TEXT
    ordinary = trained.encode_ordinary(SPECIAL_TEXT)
    assert not set(ordinary) & set(trained.specials.values())
    assert trained.decode(ordinary) == SPECIAL_TEXT
    assert trained.encode("<|call|><|call|>") == [trained.special("<|call|>")] * 2


def test_training_never_learns_specials():
    assert tk.train("<|call|><|result|>" * 100, vocab_size=300).merges == ()  # nothing but specials: no pairs
    tok = tk.train((SPECIAL_TEXT + "\n") * 50 + CORPUS, vocab_size=400)
    learned = tok.pieces[256:len(tok.merges) + 256]
    assert not any(b"<|" in p and b"|>" in p for p in learned)


def test_special_missing_and_add():
    tok = tk.train(CORPUS, vocab_size=280, specials=["<|user|>"])
    with pytest.raises(KeyError, match="<|nope|>"):
        tok.special("<|nope|>")
    more = tk.add_special_tokens(tok, ["<|user|>", "<|call|>"])
    assert more.specials == {"<|user|>": 280, "<|call|>": 281} and more.n_vocab == 282
    assert tok.specials == {"<|user|>": 280}  # the original is unchanged
    assert more.encode("x<|call|>") == tok.encode("x") + [281]


# ---------------------------------------------------------------- save / load

def test_save_load_round_trip(trained, tmp_path):
    path = tmp_path / "t.tok"
    tokenfile.save(trained, path)
    assert path.read_text().startswith("minagent-bpe v1\npattern ")
    back = tokenfile.load(path)
    assert back == trained
    for s in TRICKY + [SPECIAL_TEXT, CORPUS[:2000]]:
        assert back.encode(s) == trained.encode(s)


def same_id(lines):
    """The second special token given the first one's id."""
    first = lines.index(next(x for x in lines if x.startswith("specials "))) + 1
    return lines[:first + 1] + [lines[first].split()[0] + " " + lines[first + 1].split()[1]] + lines[first + 2:]


@pytest.mark.parametrize("corrupt, message", [
    (lambda lines: ["minagent-bpe v0"] + lines[1:], "not a 'minagent-bpe v1'"),
    (lambda lines: lines[:-40], "the header says .* merges, the file holds at most"),    # fewer merges
    (lambda lines: lines[:-3] + ["Ġt Ġnope"] + lines[-2:], "corrupt"),
    (lambda lines: [lines[0], lines[1], "specials x"] + lines[3:], "expected 'specials N'"),
    (lambda lines: [lines[0], "pattern "] + lines[2:], "line 2: .*a pre-tokenizer pattern"),
    (lambda lines: [lines[0], "pattern ( ?\\p{L}+"] + lines[2:], "line 2: .*the pattern is not a regex"),
    (same_id, "a special token's name or id given twice"),
    (lambda lines: lines[:-1] + ["Ġt Ġh", ""], "1 lines after the .* merges"),
])
def test_load_corrupt_file(trained, tmp_path, corrupt, message):
    path = tmp_path / "t.tok"
    tokenfile.save(trained, path)
    path.write_text("\n".join(corrupt(path.read_text().split("\n"))))
    with pytest.raises(ValueError, match=message):
        tokenfile.load(path)


# ---------------------------------------------------------------- the trainer against a slow reference

def naive_train(text, vocab_size, pattern):
    """BPE the slow, obvious way: every chunk kept (no word counts), every pair recounted at each merge."""
    def merge(ids, pair, new_id):
        out, i = [], 0
        while i < len(ids):
            if ids[i:i + 2] == list(pair):
                out, i = out + [new_id], i + 2
            else:
                out, i = out + [ids[i]], i + 1
        return out

    chunks = [list(c.encode("utf-8")) for c in regex.findall(pattern, text)]
    merges = []
    while len(merges) < vocab_size - 256:
        counts = Counter(p for c in chunks for p in zip(c, c[1:]))
        if not counts:
            break
        pair = min(counts, key=lambda p: (-counts[p], p))  # most frequent, ties -> smallest pair
        merges.append(pair)
        chunks = [merge(c, pair, 256 + len(merges) - 1) for c in chunks]
    return tuple(merges)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_incremental_trainer_equals_naive(pattern):
    text = CORPUS[:4000]
    assert tk.train(text, 420, PATTERNS[pattern], specials=[]).merges == naive_train(text, 420, PATTERNS[pattern])


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet="aab \n1", max_size=80), st.integers(256, 290))
def test_incremental_trainer_equals_naive_with_ties(text, vocab_size):
    # a tiny alphabet makes ties, overlapping pairs ("aaaa") and running out of pairs common
    assert tk.train(text, vocab_size, specials=[]).merges == naive_train(text, vocab_size, tk.GPT2_PATTERN)


# ---------------------------------------------------------------- SmolLM2's tokenizer

# bytes SmolLM2's vocabulary has no piece for; HF and llama.cpp drop them, and so do we
SMOLLM_MISSING = "\x04\x06\x13\x14\x16\x1d"


@pytest.fixture(scope="module")
def smollm(smollm2_gguf):
    return tokenfile.from_gguf(smollm2_gguf)


def test_smollm_known_ids(smollm):
    assert smollm.encode("What is 4821 + 3907?") == [1780, 314, 216, 36, 40, 34, 33, 1232, 216, 35, 41, 32, 39, 47]
    assert smollm.special("<|im_start|>") == 1 and smollm.special("<|im_end|>") == 2
    ids = smollm.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and 1 not in ids[1:-1]
    assert smollm.n_vocab == 49152 and len(smollm.merges) == 48900


@pytest.mark.parametrize("s", TRICKY + [SPECIAL_TEXT, "<|im_start|>assistant\n<|im_end|>"])
def test_smollm_round_trip(smollm, s):
    assert smollm.decode(smollm.encode(s)) == "".join(c for c in s if c not in SMOLLM_MISSING)


def test_smollm_save_load(smollm, tmp_path):
    tokenfile.save(smollm, tmp_path / "smollm.tok")
    back = tokenfile.load(tmp_path / "smollm.tok")
    assert back == smollm and back.encode(SPECIAL_TEXT) == smollm.encode(SPECIAL_TEXT)


@pytest.mark.slow    # a comparison with the reference package; builds transformers' tokenizer from the GGUF file and encodes 1,000 samples: 7-8 s
def test_smollm_matches_huggingface(smollm, smollm2_gguf):
    """Same ids as HF for the same vocabulary. transformers' GGUF loader gives a plain ByteLevel
    pre-tokenizer, so we put back SmolLM2's own (tokenizer.json): Digits(individual) then ByteLevel."""
    pytest.importorskip("transformers")
    pre = pytest.importorskip("tokenizers.pre_tokenizers")
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    hf.backend_tokenizer.pre_tokenizer = pre.Sequence(
        [pre.Digits(individual_digits=True), pre.ByteLevel(add_prefix_space=False, use_regex=True)])
    rng = random.Random(0)
    alphabet = list("ab cd  \t\n\r12 345.,!?'s'T") + ["é", "世", "👋", "\u0301", "\x04", "<|im_start|>", "٣", "²"]
    samples = TRICKY + [SPECIAL_TEXT, CORPUS[:3000]]
    samples += ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 20))) for _ in range(1000)]
    for s in samples:
        assert smollm.encode(s) == hf(s, add_special_tokens=False)["input_ids"], repr(s)
