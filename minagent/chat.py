"""Chat formats, and traces that record who wrote each part of a conversation.

A trace is a list of Segments: pieces of text, each written by the PROGRAM (the
prompt, each tool result, and the marker that gives the turn back) or by the
MODEL (its calls and its answer). The design documents' trace in the minagent
format:

    PROGRAM  <|user|>What is 4821 + 3907?<|assistant|>
    MODEL    <|call|>add 4821 3907<|result|>
    PROGRAM  8728<|assistant|>
    MODEL    8728<|end|>

No spaces are added around special tokens. (The documents print spaces between
them only so they are easier to read.) A space after `<|call|>` would be one
more token for the model to learn. It would also change how the text after it
is split: for a GPT-2-style BPE, "add" and " add" are different pieces.

Text from outside is never a control token. A Segment holds its text and the
markers the program placed in it as separate parts; `encode` turns a marker
into its special token and any text, whatever it spells, into ordinary pieces.
A question that spells "<|end|><|assistant|>" is sent as those characters, not
as a forged turn. Every path from text to the model goes through `encode`
(docs/engine.md, "Untrusted text").

`render` turns a trace into (tokens, authors). The trainer's loss covers exactly
the tokens whose author is MODEL. The model learns to write a call and to copy
a result, never to predict one. Each segment is encoded separately, as the agent
loop does (it appends a result's tokens to what the model wrote). Every segment
boundary is next to a special token, and specials are cut out before BPE. So this
gives the same tokens as encoding the whole text at once, and
tests/engine/test_chat.py checks that.
"""

import dataclasses
import re

import numpy as np

PROGRAM, MODEL = 0, 1   # authors of tokens; the loss mask is `authors == MODEL`


@dataclasses.dataclass(frozen=True)
class Marker:
    """A special token the program places, by name: Marker("<|assistant|>")."""
    name: str


@dataclasses.dataclass(frozen=True)
class Segment:
    """A piece of a conversation with one author: text (str) and Markers, in order.

    Segment(PROGRAM, "Hi <|end|>") is plain text, its "<|end|>" seven characters; markers
    come from prompt(), tool_round(), answer() or markup(), which the program writes."""
    author: int     # PROGRAM or MODEL
    parts: tuple    # str and Marker

    def __post_init__(self):
        if isinstance(self.parts, str):
            object.__setattr__(self, "parts", (self.parts,))

    @property
    def text(self):
        """The segment as one string, markers spelled out (to read or show; never to encode)."""
        return "".join(p.name if isinstance(p, Marker) else p for p in self.parts)


@dataclasses.dataclass(frozen=True)
class Message:
    """One entry of an episode's history, as the agent loop keeps it:

        first   the question (or a sub-agent's brief)        user    a later user turn
        model   what the model wrote, raw, markers included: "<|call|>add 4821 3907<|result|>"
        result  a tool result, right after the model message holding its call
    An application may add kinds of its own; render_message sends them as user turns.
    """
    kind: str
    text: str


@dataclasses.dataclass(frozen=True)
class ChatFormat:
    name: str
    user: str           # opens the prompt
    assistant: str      # gives the turn to the model: after the prompt, and after each tool result
    end: str            # the model ends its answer, and the episode, with it
    call: str = "<|call|>"      # the model opens a call...
    result: str = "<|result|>"  # ...and closes it; the program then writes the result
    system: str = "{user}{system}\n"  # opens the prompt instead of `user` if there is a system text
    specials: tuple = ()  # every special the format writes: a tokenizer must encode each as one id


# minagent's own format, for a tokenizer trained with tokenizer.MINAGENT_SPECIALS.
# It has no system role: a system text opens the user's message on a line of its own,
#   <|user|>You can call mul A B to multiply A by B.\nWhat is 12 times 34?<|assistant|>
MINAGENT = ChatFormat("minagent", user="<|user|>", assistant="<|assistant|>", end="<|end|>",
                      specials=("<|user|>", "<|assistant|>", "<|end|>", "<|call|>", "<|result|>"))

# ChatML, the format SmolLM2-Instruct was tuned on. Its tokenizer has <|im_start|> and <|im_end|>;
# add <|call|> and <|result|> with tokenizer.add_special_tokens(tok, CHATML.specials). The trace:
#   PROGRAM  <|im_start|>user\nWhat is 4821 + 3907?<|im_end|>\n<|im_start|>assistant\n
#   MODEL    <|call|>add 4821 3907<|result|>
#   PROGRAM  8728<|im_end|>\n<|im_start|>assistant\n
#   MODEL    8728<|im_end|>
# Choices: after a result the program closes the turn and opens a new assistant turn. The model
# then always writes right after "<|im_start|>assistant\n", the place it was tuned to speak from,
# and we add no role that it has never seen. <|im_end|> is SmolLM2's end of turn and its eos, so
# it also ends the answer. A system text gets its own block before the user turn, as in SmolLM2's
# template. That template inserts a default system text ("You are a helpful AI assistant named
# SmolLM, ...") when none is given; prompt() does not: pass it as `system` to match.
CHATML = ChatFormat("chatml", user="<|im_start|>user\n",
                    assistant="<|im_end|>\n<|im_start|>assistant\n", end="<|im_end|>",
                    system="<|im_start|>system\n{system}<|im_end|>\n{user}",
                    specials=("<|im_start|>", "<|im_end|>", "<|call|>", "<|result|>"))


def check_tokenizer(fmt, tok):
    """Raise if `tok` would split one of the format's special tokens into ordinary pieces."""
    missing = [s for s in fmt.specials if s not in tok.specials]
    if missing:
        raise ValueError(f"tokenizer lacks the {fmt.name} special tokens {missing}; "
                         f"add them with tokenizer.add_special_tokens(tok, {missing})")


def markup(fmt, written):
    """A string the program writes, its markers spelled out -> parts: the format's special
    tokens become Markers, the rest stays text. Never for text from outside.

        markup(CHATML, "<|im_end|>\n<|im_start|>assistant\n")
            -> (Marker("<|im_end|>"), "\n", Marker("<|im_start|>"), "assistant\n")
    """
    if not fmt.specials:
        return (written,) if written else ()
    pieces = re.split("(" + "|".join(map(re.escape, fmt.specials)) + ")", written)
    return tuple(Marker(p) if p in fmt.specials else p for p in pieces if p)


def encode(tok, segment):
    """The one place where a Segment becomes token ids: each Marker is its special token; each text
    is encoded as ordinary text, so no text, whoever wrote it, can become a control token."""
    ids = []
    for part in segment.parts:
        ids += [tok.special(part.name)] if isinstance(part, Marker) else tok.encode_ordinary(part)
    return ids


def prompt(fmt, question, system=None):
    """The program's opening:

        prompt(MINAGENT, "Say hello.") -> PROGRAM "<|user|>Say hello.<|assistant|>"

    The question and the system text are text: whatever they spell, they stay text."""
    if system is None:
        head = markup(fmt, fmt.user)
    else:
        before, after = fmt.system.replace("{user}", fmt.user).split("{system}")
        head = markup(fmt, before) + (system,) + markup(fmt, after)
    return Segment(PROGRAM, head + (question,) + markup(fmt, fmt.assistant))


def tool_round(fmt, call_text, result_text, author=MODEL):
    """One call and its result:

        [MODEL "<|call|>add 4821 3907<|result|>", PROGRAM "8728<|assistant|>"]

    author=PROGRAM marks a call that the mission generator wrote for the model: the
    malformed call of a "fix" mission. It is in the trace, so the model reads the
    mistake and its error, but it is not in the loss, so the model does not learn
    to make the mistake.
    """
    return [Segment(author, (Marker(fmt.call), call_text, Marker(fmt.result))),
            Segment(PROGRAM, (result_text,) + markup(fmt, fmt.assistant))]


def answer(fmt, text):
    """The model's last words: answer(MINAGENT, "8728") -> MODEL "8728<|end|>"."""
    return Segment(MODEL, (text, Marker(fmt.end)))


def render_message(m, fmt):
    """One history message -> the Segment sent for it in chat format `fmt`.

    A model message is what the model wrote, its markers included (the agent loop keeps the
    very ids it sampled; this is for traces built from text). A result is text, then the
    marker that gives the turn back, as in tool_round; any other message opens a user turn, as
    prompt() does. (With CHATML that follows the model's "<|im_end|>" without the "\\n" its
    template puts between turns.)
    """
    if m.kind == "model":
        return Segment(MODEL, markup(fmt, m.text))
    if m.kind == "result":
        return Segment(PROGRAM, (m.text,) + markup(fmt, fmt.assistant))
    return prompt(fmt, m.text)


def opening(fmt, start, system=None):
    """An episode's start -> (the history's first message, the Segment the episode opens with).

    A question (str) opens with prompt(fmt, question, system). A Segment (written by the
    program, system text included) is sent as it is; its first message is its text without the
    format's markers.
    """
    if isinstance(start, str):
        return Message("first", start), prompt(fmt, start, system=system)
    if system is not None:
        raise ValueError("a Segment prompt is sent as it is: write the system text into it")
    return Message("first", start.text.removeprefix(fmt.user).removesuffix(fmt.assistant)), start


def text(trace):
    """The whole conversation as one string."""
    return "".join(s.text for s in trace)


def rounds(trace, fmt):
    """The (call, result) pairs of a trace in order, e.g. [("add 4821 3907", "8728")]."""
    pairs = []
    for seg, nxt in zip(trace, trace[1:]):
        if seg.text.startswith(fmt.call) and seg.text.endswith(fmt.result):
            call = seg.text[len(fmt.call):-len(fmt.result)]
            pairs.append((call, nxt.text.removesuffix(fmt.assistant)))
    return pairs


def render(trace, tok):
    """trace -> (tokens_T int32, authors_T uint8): each segment encoded on its own, then joined."""
    ids = [encode(tok, s) for s in trace]
    tokens_T = np.array([t for seg in ids for t in seg], dtype=np.int32)
    authors_T = np.array([s.author for s, seg in zip(trace, ids) for _ in seg], dtype=np.uint8)
    return tokens_T, authors_T
