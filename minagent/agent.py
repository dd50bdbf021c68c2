"""The agent loop: many episodes advanced together in one batch.

An agent is a model in a loop. The model writes; when it writes
`<|call|> add 4821 3907 <|result|>` its sequence pauses (`<|result|>` is a
pause token of the batch), the loop runs the call, appends the result and
`<|assistant|>`, and resumes it. Only those appended tokens go through the
model: everything before is in the paged cache.

Each turn of the loop looks at every live episode once, a small state machine:

    finished   the model wrote <|end|>, or ran past its token budget -> record
    waiting    the model wrote <|result|> -> run the call, resume
    running    nothing to do: the batch step below advances it

then advances all running episodes by one token with a single `batch.step()`.

Budgets per episode (the design documents' numbers): at most 8 calls, at most
40 tokens written in one stretch between two results.
"""

import dataclasses

import numpy as np

from minagent import chat
from minagent.batch import Batch
from minagent.tools import Toolbox

MAX_CALLS = 8
MAX_STRETCH = 40


@dataclasses.dataclass
class Record:
    """One finished episode."""
    status: str            # "done" (wrote <|end|>) | "stretch" (40 tokens without end) | "calls" (over 8 calls)
    answer: str            # what the model wrote after its last <|assistant|>, without <|end|>
    calls: list            # [(call text, result text)]
    tokens: np.ndarray     # [T] the whole episode
    authors: np.ndarray    # [T] chat.PROGRAM or chat.MODEL for each token
    positions: int         # positions this episode pushed through the model


@dataclasses.dataclass
class _Episode:
    seq: int
    toolbox: Toolbox
    authors: list          # grows with the sequence's tokens
    calls: list


def run(params, cfg, tok, fmt, prompts, toolboxes, *, slots=32, max_calls=MAX_CALLS,
        max_stretch=MAX_STRETCH, cache=True, n_pages=None, page_size=16, max_len=512,
        temperature=0.0, seed=0, batch=None):
    """Run one episode per prompt (a chat.Segment the program writes) -> (records, batch).

    toolboxes[i] serves the calls of episode i. Pass `batch` to reuse a warm
    Batch (its compiled steps) across runs.
    """
    call_id, result_id, end_id = tok.special(fmt.call), tok.special(fmt.result), tok.special(fmt.end)
    if batch is None:
        n_pages = n_pages or slots * (max_len // page_size) + 1
        batch = Batch(params, cfg, slots=slots, n_pages=n_pages, page_size=page_size, max_len=max_len,
                      stop_tokens=(end_id,), pause_tokens=(result_id,), cache=cache,
                      temperature=temperature, seed=seed)
    handback = tok.encode(fmt.assistant)
    live, records = {}, [None] * len(prompts)
    for i, (prompt, toolbox) in enumerate(zip(prompts, toolboxes)):
        prompt_ids = tok.encode(prompt.text)
        seq = batch.add(prompt_ids, max_stretch)
        live[i] = _Episode(seq, toolbox, [chat.PROGRAM] * len(prompt_ids), [])

    def written(ep, after=None):
        """What the model wrote since the program last wrote, as text: from its last `after` token
        on if there is one (the call after <|call|>), without the <|result|> / <|end|> it ended on."""
        ids = batch.tokens(ep.seq)[len(ep.authors):]
        if after in ids:
            ids = ids[len(ids) - ids[::-1].index(after):]
        return tok.decode([t for t in ids if t not in (result_id, end_id)]).strip()

    def end(i, ep, status, answer=""):
        batch.finish(ep.seq)
        ids = batch.tokens(ep.seq)
        authors = ep.authors + [chat.MODEL] * (len(ids) - len(ep.authors))
        records[i] = Record(status, answer, ep.calls, np.asarray(ids, np.int32),
                            np.asarray(authors, np.uint8), batch.positions[ep.seq])
        del live[i]

    while live:
        for i, ep in list(live.items()):
            state = batch.status(ep.seq)
            if state == "stopped":                                  # finished: wrote <|end|>
                end(i, ep, "done", written(ep))
            elif state == "length":                                 # finished: stretch budget spent
                end(i, ep, "stretch")
            elif state == "paused":                                 # waiting for a tool
                if len(ep.calls) == max_calls:
                    end(i, ep, "calls")
                    continue
                call = written(ep, after=call_id)
                result = ep.toolbox(call)
                ep.calls.append((call, result))
                ep.authors += [chat.MODEL] * (len(batch.tokens(ep.seq)) - len(ep.authors))
                appended = tok.encode(result) + handback
                ep.authors += [chat.PROGRAM] * len(appended)
                batch.resume(ep.seq, appended, max_stretch)
        if live:
            batch.step()                                            # running: one token each
    return records, batch
