"""An episode's text with its authors told apart: what the demo and the experiments print.

    print(show(record.tokens, record.authors, tok))     # program text dim (or in [brackets]), the model's bold
"""

import itertools
import sys

from minagent import chat

_COLOUR = {chat.PROGRAM: "\x1b[2;36m", chat.MODEL: "\x1b[1;32m"}   # program: dim cyan; model: bold green
_RESET = "\x1b[0m"


def show(tokens, authors, tok, color=None):
    """The text with its authors told apart. Without colour, program text is in [brackets]:

        [<|user|>What is 4821 + 3907?<|assistant|>]<|call|>add 4821 3907<|result|>[8728<|assistant|>]8728<|end|>
    """
    if color is None:
        color = sys.stdout.isatty()
    out = []
    pairs = zip((int(t) for t in tokens), (int(a) for a in authors))
    for author, run in itertools.groupby(pairs, key=lambda p: p[1]):
        piece = tok.decode([t for t, _ in run])
        if color:
            out.append(_COLOUR.get(author, "") + piece + _RESET)
        else:
            out.append(f"[{piece}]" if author == chat.PROGRAM else piece)
    return "".join(out)
