"""01: how numbers split into tokens, and why a calculator call is only copying.

A BPE learned on prose splits 4821 into pieces that do not follow the digits, so adding digit by
digit is out of reach; but the call `add 4821 3907` splits its numbers into the same pieces, in the
same order, as the question does: writing the call is copying (docs/engine.md, "The call and result tokens"). Shown for minagent's
BPE (8192 pieces on the WordNet glosses) and SmolLM2's (read from its GGUF file). Then, for context
budgets (minagent/tasks/context/counting.py): the token counts of four samples (tests/data/scripts/:
English, Russian, Chinese, Japanese) by each tokenizer and by a BPE of 32,768 pieces learned on the
word lists of those four languages, against characters / 4, the by-script estimate and the bound
that errs high; and the same on held-out words of each language's frequency list.

    bash experiments/data/make_corpus.sh          # once: the WordNet corpus (~9 MB)
    python experiments/01_tokenization.py         # ~1.5 min the first time (training the BPEs), ~50 s cached
    python experiments/01_tokenization.py --quick # ~5 s: 512 pieces on 300 KB (or a built-in text)
Times on 2 CPU cores; not run on a GPU (it needs none). Writes experiments/results/01_tokenization.json;
the trained tokenizers are cached (git-ignored) in experiments/results/*.tok (--retrain ignores them).
"""

import argparse
import sys
import time

import common
from minagent import tokenfile
from minagent import tokenizer as tk
from minagent import weights
from minagent.tasks.context import counting

CORPUS = common.DATA / "wordnet.txt"
SCRIPTS = common.REPO / "tests" / "data" / "scripts"
SAMPLES = ("english", "russian", "chinese", "japanese")
QUESTION, CALL, RESULT = "What is 4821 + 3907?", "add 4821 3907", "8728"
# --quick without the corpus: a few sentences of prose, repeated (enough for a few hundred merges)
TINY = ("a domesticated carnivorous mammal that typically has a long snout; the dog barked all night. "
        "the act of adding numbers together, as in 12 + 30 = 42, is called addition. "
        "a large body of water that is smaller than an ocean and partly enclosed by land. ") * 40


def show(tok, text):
    """Pieces as docs/engine.md writes them: ' · ' between, a word's leading space dropped, a lone space as ␣."""
    return " · ".join(tok.decode([i]).strip() or "␣" for i in tok.encode(text))


def number_pieces(tok, text):
    """The ids of the pieces that hold a digit, in order: for 'What is 4821 + 3907?' the pieces of both numbers."""
    return [i for i in tok.encode(text) if any(c.isdigit() for c in tok.decode([i]))]


def cached_bpe(path, title, train, retrain):
    """-> (tokenizer, title): loaded from `path` (git-ignored) if there, else train() and saved there."""
    if path.exists() and not retrain:
        return tokenfile.load(path), f"{title} (cached {path.name})"
    t0 = time.time()
    tok = train()
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenfile.save(tok, path)
    return tok, f"{title} (trained in {time.time() - t0:.1f} s)"


def get_minagent_bpe(args):
    if args.quick:
        text = CORPUS.read_text(encoding="utf-8")[:300_000] if CORPUS.exists() else TINY
        return tk.train(text, args.vocab_size), f"minagent BPE, {args.vocab_size} pieces, quick corpus"

    def train():
        if not CORPUS.exists():
            sys.exit(f"{CORPUS} not found: run `bash experiments/data/make_corpus.sh` (or use --quick)")
        return tk.train(CORPUS.read_text(encoding="utf-8"), args.vocab_size, progress=True)

    return cached_bpe(common.RESULTS / f"wordnet-bpe-{args.vocab_size}.tok",
                      f"minagent BPE, {args.vocab_size} pieces, WordNet", train, args.retrain)


def get_multilingual_bpe(args):
    """32,768 pieces on wordfreq's en/ru/zh/ja word lists (--quick: 2,048 on 3,000 words each, not cached)."""
    try:
        import wordfreq  # noqa: F401
    except ImportError:
        print("(multilingual BPE skipped: the wordfreq package is missing; pip install -e '.[test]')\n")
        return None
    if args.quick:
        return (tk.train_counts(counting.wordfreq_chunks(n_words=3000), 2048),
                "minagent BPE, 2048 pieces, word lists (quick)")
    return cached_bpe(common.RESULTS / "wordfreq-bpe-32768.tok", "minagent BPE, 32768 pieces, en/ru/zh/ja word lists",
                      lambda: tk.train_counts(counting.wordfreq_chunks(), 32768, progress=True), args.retrain)


def count_row(text, tokenizers):
    return {"chars": len(text), "bytes": counting.utf8_bytes(text), "chars4": counting.chars4(text),
            "document_estimate": counting.estimate_tokens(text),
            "smollm2_rates_estimate": counting.estimate_tokens(text, counting.SMOLLM2_RATES),
            "exact": {key: len(tok.encode(text)) for key, (tok, _) in tokenizers.items()}}


def print_rows(rows, tokenizers):
    print(f"{'text':9} {'chars':>7} {'bytes':>7} {'chars/4':>8} {'doc. est.':>9} {'SmolLM2 est.':>12} "
          + " ".join(f"{key:>12}" for key in tokenizers))
    for name, row in rows.items():
        print(f"{name:9} {row['chars']:>7} {row['bytes']:>7} {row['chars4']:>8} {row['document_estimate']:>9} "
              f"{row['smollm2_rates_estimate']:>12} " + " ".join(f"{n:>12}" for n in row["exact"].values()))
    print()


def word_list_counts(tokenizers, last=10_000):
    """Held-out text for the rates: each language's words 1,000 to `last` by frequency, joined
    (with spaces for English and Russian). Rarer words than the samples, so fewer learned pieces."""
    import wordfreq
    rows = {}
    for lang, sep in (("en", " "), ("ru", " "), ("zh", ""), ("ja", "")):
        rows[lang] = count_row(sep.join(wordfreq.top_n_list(lang, last, wordlist="large")[1000:]), tokenizers)
    print(f"words 1,000 to {last:,} of each language's frequency list:")
    print_rows(rows, tokenizers)
    return rows


def estimates(tokenizers):
    """Per sample: characters, utf-8 bytes, the estimates of counting.py, and each tokenizer's exact count."""
    rows = {name: count_row((SCRIPTS / f"{name}.txt").read_text(encoding="utf-8"), tokenizers) for name in SAMPLES}
    print_rows(rows, tokenizers)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--quick", action="store_true", help="small vocab on a small corpus, a few seconds")
    ap.add_argument("--retrain", action="store_true", help="ignore the cached .tok file")
    ap.add_argument("--out", default=None, help="the JSON file (default experiments/results/01_tokenization.json)")
    args = ap.parse_args()
    if args.quick and args.vocab_size == 8192:
        args.vocab_size = 512

    tokenizers = {"minagent": get_minagent_bpe(args)}
    gguf_path = weights.smollm2_path()
    if gguf_path.exists():
        tokenizers["smollm2"] = (tokenfile.from_gguf(gguf_path), "SmolLM2-135M-Instruct (GGUF)")
    else:
        print(f"(SmolLM2 column skipped: {gguf_path} not found; `python -m minagent.weights fetch`)\n")
    multilingual = get_multilingual_bpe(args)
    if multilingual:
        tokenizers["multilingual"] = multilingual

    results = {"quick": args.quick, "tokenizers": {}}
    for key, (tok, title) in tokenizers.items():
        same = number_pieces(tok, CALL) == number_pieces(tok, QUESTION)
        print(f"{title}: {tok.n_vocab} ids")
        for text in (QUESTION, CALL, RESULT):
            print(f"  {text!r:24} -> {show(tok, text)}")
        print(f"  the call's number pieces are the question's, in the same order: {same}\n")
        results["tokenizers"][key] = {
            "title": title, "n_vocab": tok.n_vocab, "call_reuses_question_pieces": same,
            "splits": {t: {"pieces": show(tok, t), "ids": tok.encode(t)} for t in (QUESTION, CALL, RESULT)},
        }
    results["estimates"] = estimates(tokenizers)
    if "multilingual" in tokenizers:
        results["word_lists"] = word_list_counts(tokenizers, last=1500 if args.quick else 10_000)
    common.write_json(common.out_path("01_tokenization", args.out, args.quick), results)


if __name__ == "__main__":
    main()
