"""02: SmolLM2-135M-Instruct in the agent loop, before any training.

The pretrained model gets two new tokens, <|call|> and <|result|>, whose embedding rows are the mean
of the table's rows (docs/engine.md, "The call and result tokens"). Measured, greedy, in the ChatML format: (1) the calls it makes
on missions of every family (test phrasings), with a stretch budget of 128 tokens since it explains
before it answers (an answer cut off by the budget is shown with "..."); (2) its answers to a few
arithmetic and lookup questions; (3) nats per byte on held-out English (WordNet glosses, each one
document after <|endoftext|>), before and after adding the two tokens, and the difference the two
extra softmax terms should make (with tied embeddings no old logit moves).

    bash experiments/data/make_corpus.sh        # once: experiments/data/wordnet_heldout.txt
    python -m minagent.weights fetch            # once: the SmolLM2 GGUF file (98 MB)
    python experiments/02_baseline.py           # about 2-3.5 min
    python experiments/02_baseline.py --quick   # about 30 s: 5 missions, 20 glosses
Times on 2 CPU cores; not run on a GPU. Writes experiments/results/02_baseline.json.
"""

import argparse
import sys
import time

import numpy as np

import common
from minagent import agent, chat, model, train, weights
from minagent import tokenizer as tk
from minagent.tasks.calculator import missions
from minagent.tools import Toolbox, people_table

HELDOUT = common.DATA / "wordnet_heldout.txt"
FMT = chat.CHATML
NEW_TOKENS = ["<|call|>", "<|result|>"]
QUESTIONS = ("What is 31 + 52?", "What is 4821 + 3907?", "Sort 81 5 23.", "Reverse the word butter.",
             "Where does John live?", "How old is John?")
# Without the corpus: a few glosses in WordNet's style, so the loss part still runs (a rougher number).
TINY = ["a domesticated carnivorous mammal that typically has a long snout",
        "the act of adding numbers together", "a large body of water that is partly enclosed by land",
        "a person who lives in a particular place", "an instrument for measuring time",
        "move fast by using one's feet", "the quality of being honest"]


def said(r, tok):
    """Everything the model wrote in an episode, as text; '...' if the stretch budget cut it off."""
    text = tok.decode([int(t) for t, a in zip(r.tokens, r.authors) if a == chat.MODEL])
    text = text.replace(FMT.end, "").strip()
    return text + (" ..." if r.status == "stretch" else "")


def run_loop(params, cfg, tok, questions, boxes, args):
    prompts = [chat.prompt(FMT, q) for q in questions]
    batch = agent.new_batch(params, cfg, tok, FMT, slots=min(len(prompts), 32), max_len=512)   # greedy
    return agent.run(batch, tok, FMT, prompts, boxes, max_stretch=args.max_stretch)


def nats_per_byte(params, cfg, tok, glosses, args):
    """Loss on each gloss as a plain-text document: <|endoftext|> then the gloss, every gloss token supervised.

    Summed nats over the glosses' UTF-8 bytes: unlike nats per token, it compares models whose
    vocabularies differ. -> train.evaluate's dict with nats_per_byte added.
    """
    docs = [[0] + tok.encode_ordinary(g) for g in glosses]
    exs = [(np.array(d, np.int32), np.array([chat.PROGRAM] + [chat.MODEL] * (len(d) - 1), np.uint8)) for d in docs]
    ev = train.evaluate(params, cfg, exs, args.seq_len, args.batch_size)
    n_bytes = sum(len(tok.piece(t)) for d in docs for t in d[1:])     # the supervised targets: every gloss token
    return dict(ev, nats_per_byte=ev["loss"] * ev["n_tokens"] / n_bytes)


def softmax_shift(params, cfg, tok, glosses, n_new=2, width=64):
    """What the new rows should add, in nats per byte: log(1 + n_new * exp(mean logit - logsumexp)) per token.

    With tied embeddings a mean row's logit is the mean of the old logits, so the old log-softmax
    loses exactly that at every position. Measured on the old model's logits of a few glosses.
    """
    docs = [[0] + tok.encode_ordinary(g)[:width - 1] for g in glosses]
    tokens_BxT = np.zeros((len(docs), width), np.int32)
    mask_BxT = np.zeros((len(docs), width), bool)
    for b, d in enumerate(docs):
        tokens_BxT[b, :len(d)], mask_BxT[b, :len(d) - 1] = d, True      # position t predicts token t+1
    logits_BxTxV = np.asarray(model.forward(params, cfg, tokens_BxT), np.float64)
    lse_BxT = np.log(np.exp(logits_BxTxV - logits_BxTxV.max(-1, keepdims=True)).sum(-1)) + logits_BxTxV.max(-1)
    shift_BxT = np.log1p(n_new * np.exp(logits_BxTxV.mean(-1) - lse_BxT))
    n_bytes = sum(len(tok.decode_bytes(d[1:])) for d in docs)
    return float(shift_BxT[mask_BxT].sum() / n_bytes)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--missions", type=int, default=50, help="test missions, all families")
    ap.add_argument("--glosses", type=int, default=1000, help="held-out glosses for the loss")
    ap.add_argument("--max-stretch", type=int, default=128, help="tokens the model may write in one stretch")
    ap.add_argument("--seq-len", type=int, default=256, help="rows of the loss evaluation")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="5 missions, 20 glosses: about 30 s")
    ap.add_argument("--out", default=None, help="the JSON file (default experiments/results/02_baseline.json)")
    args = ap.parse_args()
    if args.quick:
        args.missions, args.glosses, args.max_stretch, args.batch_size = 5, 20, 48, 2
    t_start = time.perf_counter()

    if not weights.smollm2_path().exists():
        sys.exit(f"{weights.smollm2_path()} not found: run `python -m minagent.weights fetch`")
    params, cfg, tok = weights.load_smollm2()
    tok2 = tk.add_special_tokens(tok, NEW_TOKENS)
    params2 = model.add_tokens(params, len(NEW_TOKENS))   # rows = the mean of the embedding table
    cfg2 = model.with_vocab(cfg, params2)
    ids = {name: tok2.special(name) for name in NEW_TOKENS}
    print(f"SmolLM2-135M-Instruct, vocabulary {cfg.vocab_size} -> {cfg2.vocab_size}: {ids}")

    # 1. Missions of every family, the test phrasings, through the loop.
    ms = missions.generate(args.missions, seed=args.seed, split="test", fmt=FMT)
    records = run_loop(params2, cfg2, tok2, [m.question for m in ms],
                       [Toolbox(m.seed, fail_first=m.fail_first) for m in ms], args)
    n_calls = sum(len(r.calls) for r in records)
    exact = sum(r.answer == m.answer for r, m in zip(records, ms))
    contains = sum(m.answer in said(r, tok2) for r, m in zip(records, ms))
    statuses = {s: sum(r.status == s for r in records) for s in ("done", "stretch", "calls")}
    print(f"\n{len(ms)} missions: {n_calls} calls made; the gold answer exactly {exact}, "
          f"somewhere in what it wrote {contains}; episodes {statuses}")

    # 2. Questions answered out of the loop's tools: John is in table `seed`, which the model never sees.
    seed = next(s for s in range(1000) if "John" in [name for name, _, _ in people_table(s)])
    john = next(row for row in people_table(seed) if row[0] == "John")
    asked = run_loop(params2, cfg2, tok2, QUESTIONS, [Toolbox(seed) for _ in QUESTIONS], args)
    answers = [dict(question=q, said=said(r, tok2), status=r.status, calls=len(r.calls))
               for q, r in zip(QUESTIONS, asked)]
    print(f"\n{'question':26} {'calls':>5}  answer (greedy; table {seed}: John is {john[1]}, lives in {john[2]})")
    for a in answers:
        text = " ".join(a["said"].split())
        print(f"{a['question']:26} {a['calls']:>5}  {text if len(text) < 150 else text[:70] + ' [...] ' + text[-70:]}")

    # 3. Nats per byte on held-out prose, before and after adding the two tokens.
    if HELDOUT.exists():
        lines = [g for g in HELDOUT.read_text(encoding="utf-8").splitlines() if g.strip()]
        glosses, corpus = lines[:args.glosses], f"{HELDOUT.name}, first {min(args.glosses, len(lines))} glosses"
    else:
        print(f"\n({HELDOUT} not found: `bash experiments/data/make_corpus.sh`; using {len(TINY)} built-in glosses)")
        glosses, corpus = TINY, "built-in glosses"
    t0 = time.perf_counter()
    before = nats_per_byte(params, cfg, tok, glosses, args)
    after = nats_per_byte(params2, cfg2, tok2, glosses, args)
    loss_s = time.perf_counter() - t0
    expected = softmax_shift(params, cfg, tok, glosses[:16])
    diff = after["nats_per_byte"] - before["nats_per_byte"]
    print(f"\nloss on {corpus} ({before['n_tokens']} tokens, {loss_s:.0f} s):")
    print(f"  {'':28} {'nats/byte':>10} {'nats/token':>11}")
    print(f"  {'before adding the tokens':28} {before['nats_per_byte']:>10.4f} {before['loss']:>11.4f}")
    print(f"  {'after adding the tokens':28} {after['nats_per_byte']:>10.4f} {after['loss']:>11.4f}")
    print(f"  difference {diff:+.2e} nats/byte: {'unchanged' if round(diff, 4) == 0 else 'CHANGED'} to 4 decimals")
    print(f"  what the two extra softmax terms should add (float64, {min(16, len(glosses))} glosses): "
          f"{expected:+.2e} nats/byte")

    elapsed = time.perf_counter() - t_start
    print(f"\n{elapsed:.0f} s in all")
    results = dict(
        quick=args.quick, model="SmolLM2-135M-Instruct Q4_1", format=FMT.name, new_token_ids=ids,
        max_stretch=args.max_stretch, seconds=round(elapsed, 1),
        missions=dict(n=len(ms), calls=n_calls, exact=exact, contains=contains, statuses=statuses,
                      episodes=[dict(family=m.family, question=m.question, gold=m.answer, said=said(r, tok2),
                                     status=r.status, calls=len(r.calls)) for m, r in zip(ms, records)]),
        answers=answers, john=dict(table_seed=seed, age=john[1], city=john[2]),
        loss=dict(corpus=corpus, n_tokens=before["n_tokens"], before=before["nats_per_byte"],
                  after=after["nats_per_byte"], difference=diff, before_per_token=before["loss"],
                  after_per_token=after["loss"], expected_difference=expected, seconds=round(loss_s, 1)))
    common.write_json(common.out_path("02_baseline", args.out, args.quick), results)


if __name__ == "__main__":
    main()
