"""Chat formats and authored traces: the loss covers exactly the tokens the model should learn.

Run: python -m pytest tests/engine/test_chat.py -q

Tokenizers are trained in-process (vocab 400) on rendered missions plus a little
English, one with minagent's specials and one with ChatML's.
"""

import re

import numpy as np
import pytest

from minagent import chat
from minagent.tasks.calculator import missions
from minagent.tasks.show import show
from minagent import tokenizer as tk
from minagent.chat import CHATML, MINAGENT, MODEL, PROGRAM
from minagent.tools import Toolbox

ENGLISH = ("The quick brown fox jumps over the lazy dog. A model in a loop writes token by token, "
           "and a program watches. When the model writes a call, the program runs it and hands control back. ")

# The design documents' trace, exactly, in both formats.
DOC_TEXT = {
    "minagent": "<|user|>What is 4821 + 3907?<|assistant|><|call|>add 4821 3907<|result|>8728<|assistant|>8728<|end|>",
    "chatml": ("<|im_start|>user\nWhat is 4821 + 3907?<|im_end|>\n<|im_start|>assistant\n<|call|>add 4821 3907"
               "<|result|>8728<|im_end|>\n<|im_start|>assistant\n8728<|im_end|>"),
}
CHATML_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|call|>", "<|result|>"]


def _train(fmt, specials):
    corpus = "\n".join(chat.text(m.trace) for m in missions.generate(300, seed=0, fmt=fmt))
    return tk.train(ENGLISH * 20 + corpus, vocab_size=400, pattern=tk.GPT2_PATTERN, specials=specials)


@pytest.fixture(scope="module")
def toks():
    return {"minagent": (MINAGENT, _train(MINAGENT, tk.MINAGENT_SPECIALS)),
            "chatml": (CHATML, _train(CHATML, CHATML_SPECIALS))}


def _doc_trace(fmt):
    box = Toolbox(0)
    return [chat.prompt(fmt, "What is 4821 + 3907?"), *chat.tool_round(fmt, "add 4821 3907", box("add 4821 3907")),
            chat.answer(fmt, "8728")]


@pytest.mark.parametrize("name", ["minagent", "chatml"])
def test_doc_trace_renders_back_to_the_exact_text(toks, name):
    fmt, tok = toks[name]
    trace = _doc_trace(fmt)
    assert chat.text(trace) == DOC_TEXT[name]
    assert [s.author for s in trace] == [PROGRAM, MODEL, PROGRAM, MODEL]
    tokens_T, authors_T = chat.render(trace, tok)
    assert tokens_T.dtype == np.int32 and authors_T.dtype == np.uint8 and tokens_T.shape == authors_T.shape
    assert tok.decode(tokens_T.tolist()) == DOC_TEXT[name]
    # the program's parts: prompt, the tool's result and the hand-back
    program = tokens_T[authors_T == PROGRAM].tolist()
    assert program == tok.encode(chat.prompt(fmt, "What is 4821 + 3907?").text) + tok.encode("8728" + fmt.assistant)
    assert tok.decode(tokens_T[authors_T == MODEL].tolist()) == f"{fmt.call}add 4821 3907{fmt.result}8728{fmt.end}"


@pytest.mark.parametrize("name", ["minagent", "chatml"])
def test_model_tokens_of_a_generated_addition_are_call_result_answer_end(toks, name):
    """The design documents' test: the learned tokens are exactly <|call|>, the call, <|result|>, the answer
    and <|end|>; the tool's result is in the trace, authored by the program, so it is not in the loss."""
    fmt, tok = toks[name]
    call_id, result_id, end_id = tok.special(fmt.call), tok.special(fmt.result), tok.special(fmt.end)
    for m in missions.additions(10, seed=1, fmt=fmt):
        (call,), result = m.calls, Toolbox(m.seed)(m.calls[0])
        tokens_T, authors_T = chat.render(m.trace, tok)
        model = tokens_T[authors_T == MODEL].tolist()
        assert model == [call_id] + tok.encode(call) + [result_id] + tok.encode(m.answer) + [end_id]
        assert tok.decode(model) == f"{fmt.call}{call}{fmt.result}{m.answer}{fmt.end}"
        program = tokens_T[authors_T == PROGRAM].tolist()
        assert program == tok.encode(m.trace[0].text) + tok.encode(result) + tok.encode(fmt.assistant)
        assert tok.decode(program).endswith(result + fmt.assistant)
        # and the result's tokens sit right after <|result|> in the trace
        i = tokens_T.tolist().index(result_id) + 1
        assert tokens_T[i:i + len(tok.encode(result))].tolist() == tok.encode(result)
        assert set(authors_T[i:i + len(tok.encode(result))]) == {PROGRAM}


@pytest.mark.parametrize("name", ["minagent", "chatml"])
def test_render_by_segments_equals_encoding_the_whole_text(toks, name):
    """The agent loop appends tokens segment by segment; training renders the same tokens."""
    fmt, tok = toks[name]
    for split in ("train", "test"):
        for m in missions.generate(44, seed=2, split=split, fmt=fmt) + missions.unseen_mul(4, seed=2, fmt=fmt):
            tokens_T, _ = chat.render(m.trace, tok)
            assert tokens_T.tolist() == tok.encode(chat.text(m.trace))


def test_show_marks_program_text(toks):
    fmt, tok = toks["minagent"]
    tokens_T, authors_T = chat.render(_doc_trace(fmt), tok)
    assert show(tokens_T, authors_T, tok, color=False) == \
        "[<|user|>What is 4821 + 3907?<|assistant|>]<|call|>add 4821 3907<|result|>[8728<|assistant|>]8728<|end|>"
    coloured = show(tokens_T, authors_T, tok, color=True)
    assert "\x1b[" in coloured and re.sub(r"\x1b\[[0-9;]*m", "", coloured) == DOC_TEXT["minagent"]


def test_system_text_placement():
    q, s = "What is 12 times 34?", "You can call mul A B to multiply A by B."
    assert chat.prompt(MINAGENT, q, system=s).text == f"<|user|>{s}\n{q}<|assistant|>"
    assert chat.prompt(CHATML, q, system=s).text == \
        f"<|im_start|>system\n{s}<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
    assert chat.prompt(MINAGENT, "Say {hello}.", system="{braces} stay").text == \
        "<|user|>{braces} stay\nSay {hello}.<|assistant|>"


def test_rounds_reads_calls_and_results_back():
    trace = _doc_trace(MINAGENT)
    assert chat.rounds(trace, MINAGENT) == [("add 4821 3907", "8728")]
    assert chat.rounds(_doc_trace(CHATML), CHATML) == [("add 4821 3907", "8728")]
    assert chat.rounds([chat.prompt(MINAGENT, "Say hello."), chat.answer(MINAGENT, "Hello!")], MINAGENT) == []


def test_check_tokenizer(toks):
    chat.check_tokenizer(MINAGENT, toks["minagent"][1])
    chat.check_tokenizer(CHATML, toks["chatml"][1])
    with pytest.raises(ValueError, match="im_start"):
        chat.check_tokenizer(CHATML, toks["minagent"][1])
    # SmolLM2's tokenizer has <|im_start|> and <|im_end|> only: adding the format's specials completes it
    smol_like = tk.train(ENGLISH, vocab_size=260, specials=["<|im_start|>", "<|im_end|>"])
    with pytest.raises(ValueError, match="call"):
        chat.check_tokenizer(CHATML, smol_like)
    chat.check_tokenizer(CHATML, tk.add_special_tokens(smol_like, CHATML.specials))
