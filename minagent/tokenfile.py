"""A tokenizer in a file: minagent's own text format (save, load), and SmolLM2's from its GGUF file.

    tokenfile.save(tok, "tok.txt"); tok = tokenfile.load("tok.txt")
    tok = tokenfile.from_gguf(weights.smollm2_path())
"""

import pathlib

import regex

from minagent import gguf
from minagent import tokenizer as tk

FORMAT = "minagent-bpe v1"


def save(tok, path):
    pathlib.Path(path).write_text(dumps(tok), encoding="utf-8")


def load(path):
    return loads(pathlib.Path(path).read_text(encoding="utf-8"), path)


def dumps(tok):
    """The file's text: header, pattern, specials, every piece in id order, merges in rank order.
    Pieces are written with GPT-2's byte -> char map, so " the" reads "Ġthe" and no piece holds a
    space."""
    s = [tk.to_str(p) for p in tok.pieces]
    lines = [FORMAT, f"pattern {tok.pattern}", f"specials {len(tok.specials)}"]
    lines += [f"{i} {name}" for name, i in tok.specials.items()]
    lines += [f"pieces {len(s)}", *s, f"merges {len(tok.merges)}"]
    lines += [f"{s[a]} {s[b]}" for a, b in tok.merges]
    return "\n".join(lines) + "\n"


def loads(text, path="<text>"):
    """Read what dumps() writes; a ValueError names the file, the line and what is wrong with it."""
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()                     # the newline that ends the last line
    at = 0

    def bad(why):
        return ValueError(f"{path}: line {at}: corrupt tokenizer file, {why}: "
                          f"{lines[at - 1][:60]!r}")

    def take(what):  # the next line
        nonlocal at
        if at >= len(lines):
            raise ValueError(f"{path}: ends early, expected {what} (truncated tokenizer file?)")
        at += 1
        return lines[at - 1]

    def section(name):  # a "name N" line; returns N
        key, _, n = take(f"'{name} N'").partition(" ")
        if key != name or not n.isdigit():
            raise bad(f"expected '{name} N'")
        if int(n) > len(lines) - at:
            raise bad(f"the header says {n} {name}, the file holds at most {len(lines) - at} "
                      f"more lines")
        return int(n)

    def piece(s):
        try:
            return tk.to_bytes(s)
        except KeyError:
            raise bad("a character outside GPT-2's byte map") from None

    if (header := take("a header")) != FORMAT:
        raise ValueError(f"{path}: not a {FORMAT!r} tokenizer file (first line {header[:60]!r})")
    key, _, pattern = take("'pattern REGEX'").partition(" ")
    if key != "pattern" or not pattern:
        raise bad("expected 'pattern REGEX', a pre-tokenizer pattern")
    try:
        regex.compile(pattern)
    except regex.error as e:
        raise bad(f"the pattern is not a regex ({e})") from None
    specials = {}
    for _ in range(section("specials")):
        i, _, name = take("a special").partition(" ")
        if not i.isdigit() or not name:
            raise bad("expected 'ID NAME'")
        if name in specials or int(i) in specials.values():
            raise bad("a special token's name or id given twice")
        specials[name] = int(i)
    pieces = tuple(piece(take("a piece")) for _ in range(section("pieces")))
    id_of = {p: i for i, p in enumerate(pieces) if i not in specials.values()}
    merges = []
    for _ in range(section("merges")):
        pair = [piece(s) for s in take("a merge").split(" ")]
        if len(pair) != 2 or not all(p in id_of for p in pair) or pair[0] + pair[1] not in id_of:
            raise bad("expected 'LEFT RIGHT', two pieces that merge into a third")
        merges.append((id_of[pair[0]], id_of[pair[1]]))
    if at < len(lines):
        raise ValueError(f"{path}: {len(lines) - at} lines after the {len(merges)} merges the "
                         f"header announced")
    if any(i >= len(pieces) for i in specials.values()):
        raise ValueError(f"{path}: a special token's id is past the {len(pieces)} pieces")
    return tk.Tokenizer(pieces, tuple(merges), specials, pattern)


def from_gguf(path):
    """SmolLM2's tokenizer from its GGUF file: the same pieces, ids, merges and specials as the
    original."""
    meta, _ = gguf.read(path)
    model, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
    if model != "gpt2" or pre != "smollm":
        raise ValueError(f"{path}: expected a byte-level BPE with the 'smollm' pre-tokenizer, got "
                         f"{model!r} / {pre!r}")
    names, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    specials = {s: i for i, (s, t) in enumerate(zip(names, types)) if t == 3}  # 3 = control token
    pieces = tuple(s.encode("utf-8") if t == 3 else tk.to_bytes(s) for s, t in zip(names, types))
    id_of = {s: i for i, s in enumerate(names)}
    merges = tuple(tuple(id_of[x] for x in m.split(" ")) for m in meta["tokenizer.ggml.merges"])
    return tk.Tokenizer(pieces, merges, specials, tk.SMOLLM_PATTERN)
