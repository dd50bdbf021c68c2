"""Constrained decoding: a token mask under which the model can only write a call that gate.validate accepts.

The grammar is the call as data.gold_json writes it, one character at a time:

    {"tool": "refund", "args": {"order_id": "A1234", "amount": 240.5}}<end>
    ..........NNNNNN.........................OOOOO.............AAAAA..
    . literal text   N the tool's NAME   O an ORDER number   A an AMOUNT   (and T, free TEXT; D, a DAY)

`program(tool)` lists these pieces, derived from gate.TOOLS (the argument names
and their order) and the rules of gate._bad_arg (order_id, amount and day have
their own kinds, every other argument is free TEXT). A state is a small tuple

    (tool, piece index, sub-state)      e.g. ("refund", 5, (3, 1, True)) after '..."amount": 240.5'

where the sub-state is how far the current piece has got: chars matched of a
literal, the tool-name or day prefix, the length of a text, (integer digits, decimals
or -1 before the dot, a nonzero digit seen) of an amount. `step(state, ch)` is
the automaton's one move; it returns None when no valid call starts that way.
No state is a dead end: from every state `step` can reach, a call can be finished
(tests/test_constrain.py walks them all).

Stricter than validate, never looser: the canonical spacing only, printable
ASCII without quote or backslash in texts (1 to MAX_TEXT chars, the first not a
space, so that validate's value.strip() is non-empty), amounts 1-4 integer digits
without a leading zero and at most 2 decimals, not zero (so at most 9999.99,
where validate allows up to gate.MAX_AMOUNT = 10000), days in one spelling
each (DAYS: "next Monday", "March 3", "the 2nd of May"; validate takes any case).

Token level. There are a few thousand states (most of them inside a day) and 95 characters, so we tabulate
the automaton once (next_QxA) and a mask is a vectorised walk of every token's
characters through that table: `Constraint.allowed(state)` is the tokens whose
every char keeps the call viable (memoised per state), plus the end token once
the call is done. Special tokens, and tokens with a byte outside printable ASCII,
are never allowed. Shape letters (beside the legend of minagent/model.py): Q states of
the automaton, A characters of its alphabet, J characters of the longest token, X the
tokens that may be allowed at all.

    c = Constraint(tok, end_id=tok.special("<|im_end|>"))
    c([])                                # bool [V]: the tokens that may start the answer
    c(sampled)                           # ... that may follow the tokens sampled so far
    batch.add(prompt, limit, mask=c)     # the Batch asks it before each token (Batch.add's hook)
"""

import functools

import numpy as np

from minagent import chat
from minagent.batch import Batch, Status
from minagent.cache import pages_for
from minagent.tasks.shop import gate

OPEN = '{"tool": "'
NAME, TEXT, ORDER, AMOUNT, DAY = range(5)   # the pieces that are not literal text (a literal is a str)
KIND = {"order_id": ORDER, "amount": AMOUNT, "day": DAY}   # the others: free text, as in gate._bad_arg


def _ordinal(n):
    """1 -> "1st", 2 -> "2nd", 11 -> "11th", 22 -> "22nd" """
    return f"{n}{'th' if 10 <= n <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


# Every day the grammar may write: gate.DAY's forms, spelled one way (capitalised names, right ordinals).
# 859 of them: "Monday", "next Monday morning", "March 3", "the 14th", "the 2nd of May".
DAYS = frozenset([f"{when}{d}{part}" for when in ("", "next ", "this ") for d in gate.WEEKDAYS
                  for part in ("", *(" " + p for p in gate.PARTS_OF_DAY))]
                 + [f"{m} {n}" for m in gate.MONTHS for n in range(1, 32)]
                 + [f"the {_ordinal(n)}{of}" for n in range(1, 32) for of in ("", *(f" of {m}" for m in gate.MONTHS))])
DAY_PREFIXES = frozenset(d[:i] for d in DAYS for i in range(len(d) + 1))
MAX_TEXT = 60
ALPHABET = "".join(chr(c) for c in range(0x20, 0x7F))    # printable ASCII: every char the grammar can accept
TEXT_CHARS = frozenset(ALPHABET) - set('"\\')            # no escapes inside a JSON string: none needed
DIGITS = "0123456789"
START = (None, 0, 0)                         # no tool yet, piece 0 (the literal OPEN), 0 chars of it


@functools.cache
def program(tool):
    """The pieces of a call, in order. Before the name is complete only the first two are known:

    program(None)     -> ('{"tool": "', NAME)
    program("refund") -> ('{"tool": "', NAME, '", "args": {"order_id": "', ORDER, '", "amount": ', AMOUNT, '}}')
    """
    if tool is None:
        return (OPEN, NAME)
    pieces, text = [OPEN, NAME], '", "args": {'
    for i, name in enumerate(gate.TOOLS[tool]):
        kind = KIND.get(name, TEXT)
        quote = "" if kind == AMOUNT else '"'     # an amount is a JSON number, the rest are strings
        pieces += [text + (", " if i else "") + f'"{name}": ' + quote, kind]
        text = quote
    return tuple(pieces + [text + "}}"])


def _start(piece):
    return "" if piece in (NAME, DAY) else (0, -1, False) if piece == AMOUNT else 0


def _eat_amount(sub, ch):
    """A JSON number in (0, 9999.99]: 1-4 digits without a leading zero, then maybe "." and 1-2 digits.

    sub = (integer digits, decimals or -1 before the dot, a nonzero digit seen). "0.0" may only
    go on with 1-9: "0.00" could not end (zero is no amount), and no state may be a dead end.
    """
    n_int, n_frac, nonzero = sub
    if ch == ".":
        return (n_int, 0, nonzero) if n_int and n_frac == -1 else None
    if ch not in DIGITS:
        return None
    if n_frac == -1:
        if n_int == 0:
            return (1, -1, ch != "0")
        return (n_int + 1, -1, True) if nonzero and n_int < 4 else None     # "05" has a leading zero
    if n_frac == 2 or (n_frac == 1 and not nonzero and ch == "0"):
        return None
    return (n_int, n_frac + 1, nonzero or ch != "0")


def _eat(piece, sub, ch):
    """The piece's sub-state after ch, or None if ch cannot come next inside this piece."""
    if isinstance(piece, str):                   # a literal: exactly its next char
        return sub + 1 if sub < len(piece) and piece[sub] == ch else None
    if piece == NAME:                            # a prefix of a tool name
        return sub + ch if any(t.startswith(sub + ch) for t in gate.TOOLS) else None
    if piece == DAY:                             # a prefix of one of the DAYS
        return sub + ch if sub + ch in DAY_PREFIXES else None
    if piece == TEXT:                            # inside a JSON string: 1-60 chars, the first not a space
        return sub + 1 if ch in TEXT_CHARS and sub < MAX_TEXT and (sub or ch != " ") else None
    if piece == ORDER:                           # "A" and 4 digits, inside the quotes
        return sub + 1 if (ch == "A" if sub == 0 else sub < 5 and ch in DIGITS) else None
    return _eat_amount(sub, ch)


def _can_end(piece, sub):
    if isinstance(piece, str):
        return sub == len(piece)
    if piece == NAME:
        return sub in gate.TOOLS
    if piece == DAY:
        return sub in DAYS
    if piece == TEXT:
        return sub >= 1
    if piece == ORDER:
        return sub == 5
    n_int, n_frac, nonzero = sub
    return n_int >= 1 and n_frac != 0 and nonzero


def step(state, ch):
    """The state after writing ch, or None if no valid call starts with the text so far plus ch.

    The grammar is deterministic: a piece never accepts the char that starts the piece after it
    (a text cannot hold '"', an amount cannot hold ',' or '}'), so ch either continues the current
    piece or, if that piece can end, starts the next one.
    """
    tool, i, sub = state
    piece = program(tool)[i]
    new = _eat(piece, sub, ch)
    if new is not None:
        return (tool, i, new)
    if not _can_end(piece, sub):
        return None
    if piece == NAME:
        tool = sub                               # the name is complete: now the rest is known
    pieces = program(tool)
    if i + 1 == len(pieces):                     # the closing brace is written: nothing may follow
        return None
    new = _eat(pieces[i + 1], _start(pieces[i + 1]), ch)
    return None if new is None else (tool, i + 1, new)


def done(state):
    """True once the whole call is written (its last piece, '}}', is complete)."""
    tool, i, sub = state
    return tool is not None and i == len(program(tool)) - 1 and _can_end(program(tool)[i], sub)


def walk(text, state=START):
    """The state after writing `text` from `state`, or None if it leaves the grammar."""
    for ch in text:
        state = step(state, ch)
        if state is None:
            return None
    return state


def max_chars():
    """The longest call the grammar allows, in chars: a limit of max_chars() + 1 tokens always lets it finish."""
    longest = {NAME: max(map(len, gate.TOOLS)), TEXT: MAX_TEXT, ORDER: 5, AMOUNT: len("9999.99"),
               DAY: max(map(len, DAYS))}
    return max(sum(len(p) if isinstance(p, str) else longest[p] for p in program(t)) for t in gate.TOOLS)


@functools.cache
def tabulate():
    """Every state reachable from START, numbered breadth-first, and the table of moves.

    -> (states, next_QxA) with next_QxA[q, a] the number of the state after ALPHABET[a] from state q,
    or Q = len(states) for "dead". Row Q is dead (it stays dead) and column A = len(ALPHABET) is
    padding, which leaves every state where it is (tokens shorter than the longest one end with it).
    """
    states, number, rows = [START], {START: 0}, []
    for s in states:                             # `states` grows while we go through it
        row = []
        for ch in ALPHABET:
            t = step(s, ch)
            if t is not None and t not in number:
                number[t] = len(states)
                states.append(t)
            row.append(-1 if t is None else number[t])
        rows.append(row)
    Q, A = len(states), len(ALPHABET)
    next_QxA = np.full((Q + 1, A + 1), Q, np.int32)
    next_QxA[:Q, :A] = np.where(np.array(rows) < 0, Q, np.array(rows))
    next_QxA[:, A] = np.arange(Q + 1)
    return tuple(states), next_QxA


class Constraint:
    """The call grammar over a tokenizer's vocabulary, as a token-mask function for Batch.add.

    tok: a tokenizer.Tokenizer. end_id: the token that ends the answer (SmolLM2: <|im_end|>).
    n_vocab: the mask's length, the model's vocabulary (default tok.n_vocab; ids past the
    tokenizer's are never allowed). States are the tuples of `step`.
    """

    def __init__(self, tok, end_id, n_vocab=None):
        self.end_id, self.n_vocab = end_id, n_vocab or tok.n_vocab
        special = set(tok.specials.values())
        # id -> its text if every byte is printable ASCII, else None (never allowed)
        self.texts = [None if i in special or not p or any(b < 0x20 or b > 0x7E for b in p) else p.decode("ascii")
                      for i, p in enumerate(tok.pieces)]
        self.states, self.next_QxA = tabulate()
        self.number = {s: n for n, s in enumerate(self.states)}
        # The X usable tokens, longest first, as columns of char numbers: chars_JxX[j, x] is the j-th char
        # of token ids_X[x] (A = padding). At column j only the first n_at_J[j] tokens are still long enough.
        ids = sorted((i for i, t in enumerate(self.texts) if t), key=lambda i: -len(self.texts[i]))
        self.ids_X = np.array(ids, np.int64)
        J, A, column = len(self.texts[ids[0]]), len(ALPHABET), {ch: a for a, ch in enumerate(ALPHABET)}
        self.chars_JxX = np.full((J, len(ids)), A, np.int32)
        for x, i in enumerate(ids):
            self.chars_JxX[:len(self.texts[i]), x] = [column[ch] for ch in self.texts[i]]
        lengths_X = np.array([len(self.texts[i]) for i in ids])
        self.n_at_J = np.array([(lengths_X > j).sum() for j in range(J)])
        self._masks = {}                         # state number -> bool [n_vocab]

    def __call__(self, sampled):
        """bool [n_vocab]: the tokens that may follow `sampled`, the answer's tokens so far."""
        return self.allowed(self.state(sampled))

    def state(self, sampled):
        """The state after the tokens `sampled`; ValueError if the mask never allowed them."""
        state = START
        for token in sampled:
            text = self.texts[token] if token < len(self.texts) and token != self.end_id else None
            new = None if text is None else walk(text, state)
            if new is None:
                raise ValueError(f"token {token} ({text!r}) is not allowed in state {state}")
            state = new
        return state

    def allowed(self, state):
        """bool [n_vocab]: the tokens that may come next. Memoised per state."""
        n = self.number[state]
        if n not in self._masks:
            self._masks[n] = self._build(n)
        return self._masks[n]

    def _build(self, n):
        """Walk all usable tokens through the table at once, one char column at a time."""
        Q = len(self.states)
        at_X = np.full(len(self.ids_X), n, np.int32)
        for j, n_long in enumerate(self.n_at_J):
            at_X[:n_long] = self.next_QxA[at_X[:n_long], self.chars_JxX[j, :n_long]]
        mask_V = np.zeros(self.n_vocab, bool)
        mask_V[self.ids_X] = at_X != Q
        mask_V[self.end_id] = done(self.states[n])
        return mask_V


def answers(params, cfg, tok, prompts, end_id, constraint=None, *, slots=32, limit=None, temperature=0.0,
            seed=0, page_size=16, **batch_kw):
    """Decode one answer per prompt (a chat.Segment) through a Batch -> ([answer text, without the end
    token], [whether it stopped at the end token, rather than at the limit]).

    constraint=None: free decoding. With a Constraint every answer is a valid call, and the
    default limit (max_chars() + 1 tokens: every token writes at least one char) lets it finish.
    A sequence is finished as soon as it ends, so a queued prompt takes its slot and pages.
    batch_kw go to the Batch (runner=RunnerConfig(prefill_rows=..., buckets=...), ...).
    """
    if constraint is not None and constraint.end_id != end_id:
        raise ValueError(f"end_id {end_id} is not the constraint's end token {constraint.end_id}: "
                         "constrained answers could never stop")
    if constraint is not None and constraint.n_vocab != cfg.vocab_size:
        raise ValueError(f"the constraint masks {constraint.n_vocab} tokens, the model has {cfg.vocab_size}")
    limit = limit or max_chars() + 1
    ids = [chat.encode(tok, p) for p in prompts]
    max_len = max(map(len, ids)) + limit
    slots = min(slots, len(ids))
    batch = Batch(params, cfg, slots=slots, n_pages=slots * pages_for(max_len, page_size) + 1, page_size=page_size,
                  max_len=max_len, stop_tokens=(end_id,), temperature=temperature, seed=seed, **batch_kw)
    seqs = [batch.add(p, limit, mask=constraint) for p in ids]
    stopped = {}
    while batch.running():
        batch.step()
        for s in seqs:
            status = batch.seqs[s].status
            if s not in stopped and status in (Status.STOPPED, Status.LENGTH):
                stopped[s] = status is Status.STOPPED
                batch.finish(s)        # its tokens stay readable
    texts = [tok.decode([t for t in batch.seqs[s].tokens[len(p):] if t != end_id]) for s, p in zip(seqs, ids)]
    return texts, [stopped[s] for s in seqs]
