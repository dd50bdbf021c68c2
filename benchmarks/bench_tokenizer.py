"""minagent's BPE against Hugging Face `tokenizers` on the WordNet corpus: training and encoding speed.

    bash experiments/data/make_corpus.sh        # once: writes experiments/data/wordnet.txt (~9 MB)
    python benchmarks/bench_tokenizer.py        # ~40 s on 2 CPU cores

Both train a byte-level BPE of 8192 pieces (256 bytes + 7936 merges) with the GPT-2 regex
pre-tokenizer, once each, on the corpus's lines, then encode every line with a fresh tokenizer
(minagent's chunk cache starts empty). HF trains with its default threads and again with
one; it encodes with one thread. Rayon reads RAYON_NUM_THREADS once per process, so
each HF measurement runs in a child process of this script (`--hf THREADS`).
Writes benchmarks/results/tokenizer.json. Needs the `ref` extra (tokenizers).
"""

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import time

from minagent import tokenizer as tk

ROOT = pathlib.Path(__file__).resolve().parents[1]
CORPUS = ROOT / "experiments" / "data" / "wordnet.txt"
OUT = ROOT / "benchmarks" / "results" / "tokenizer.json"
VOCAB = 8192


def bench_minagent(lines):
    t0 = time.perf_counter()
    tok = tk.train("\n".join(lines), VOCAB, tk.GPT2_PATTERN, specials=[])
    train_s = time.perf_counter() - t0
    tok = tk.Tokenizer(tok.pieces, tok.merges, tok.specials, tok.pattern)  # a fresh, empty chunk cache
    t0 = time.perf_counter()
    n_tokens = sum(len(tok.encode_ordinary(line)) for line in lines)
    encode_s = time.perf_counter() - t0
    merges = [f"{tk.to_str(tok.pieces[a])} {tk.to_str(tok.pieces[b])}" for a, b in tok.merges]
    return dict(train_s=train_s, encode_s=encode_s, n_tokens=n_tokens, merges=merges)


def bench_hf(lines, threads):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[], show_progress=False)
    t0 = time.perf_counter()
    hf.train_from_iterator(lines, trainer)
    train_s = time.perf_counter() - t0
    hf = Tokenizer.from_str(hf.to_str())  # a fresh tokenizer: no cache from training
    t0 = time.perf_counter()
    n_tokens = sum(len(e.ids) for e in hf.encode_batch(lines, add_special_tokens=False))
    encode_s = time.perf_counter() - t0
    merges = [m if isinstance(m, str) else " ".join(m) for m in json.loads(hf.to_str())["model"]["merges"]]
    return dict(threads=threads, train_s=train_s, encode_s=encode_s, n_tokens=n_tokens, merges=merges)


def run_hf_child(threads):
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false" if threads == 1 else "true")
    if threads:
        env["RAYON_NUM_THREADS"] = str(threads)
    else:
        env.pop("RAYON_NUM_THREADS", None)
    out = subprocess.run([sys.executable, __file__, "--hf", str(threads)], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hf", type=int, default=None, help=argparse.SUPPRESS)  # child mode: 0 = default threads
    args = ap.parse_args()
    if not CORPUS.exists():
        sys.exit(f"{CORPUS} not found: run `bash experiments/data/make_corpus.sh` first")
    lines = CORPUS.read_text(encoding="utf-8").split("\n")
    if args.hf is not None:
        print(json.dumps(bench_hf(lines, args.hf)))
        return

    mb = sum(len(line.encode("utf-8")) for line in lines) / 1e6
    ours = bench_minagent(lines)
    hf_all, hf_one = run_hf_child(0), run_hf_child(1)
    same_prefix = next((i for i, (a, b) in enumerate(zip(ours["merges"], hf_one["merges"])) if a != b),
                       len(ours["merges"]))
    result = dict(
        corpus=str(CORPUS.relative_to(ROOT)), corpus_mb=round(mb, 2), vocab_size=VOCAB,
        machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        minagent_train_s=round(ours["train_s"], 2),
        hf_train_s_default_threads=round(hf_all["train_s"], 2),
        hf_train_s_1_thread=round(hf_one["train_s"], 2),
        train_ratio_vs_hf_default=round(ours["train_s"] / hf_all["train_s"], 2),
        train_ratio_vs_hf_1_thread=round(ours["train_s"] / hf_one["train_s"], 2),
        minagent_encode_mb_s=round(mb / ours["encode_s"], 2),
        hf_encode_mb_s_1_thread=round(mb / hf_one["encode_s"], 2),
        encode_time_ratio_minagent_over_hf=round(ours["encode_s"] / hf_one["encode_s"], 2),
        minagent_tokens=ours["n_tokens"], hf_tokens=hf_one["n_tokens"],
        merges_identical_to_hf=sum(a == b for a, b in zip(ours["merges"], hf_one["merges"])),
        merges_identical_prefix=same_prefix,
    )
    print(f"corpus {result['corpus']}: {mb:.1f} MB, {len(lines)} lines; BPE of {VOCAB} pieces\n")
    print(f"{'':28}{'minagent':>10}{'HF 1 thread':>13}{'HF default':>12}")
    print(f"{'train (s)':28}{ours['train_s']:>10.2f}{hf_one['train_s']:>13.2f}{hf_all['train_s']:>12.2f}")
    print(f"{'encode, cold cache (MB/s)':28}{mb / ours['encode_s']:>10.2f}{mb / hf_one['encode_s']:>13.2f}")
    print(f"{'tokens in corpus':28}{ours['n_tokens']:>10}{hf_one['n_tokens']:>13}")
    print(f"\ntrain: minagent / HF = {result['train_ratio_vs_hf_default']}x (HF default threads), "
          f"{result['train_ratio_vs_hf_1_thread']}x (HF 1 thread); target <= 10x")
    print(f"encode: minagent takes {result['encode_time_ratio_minagent_over_hf']}x HF's time (1 thread each)")
    print(f"merges identical to HF's: {result['merges_identical_to_hf']} / {len(ours['merges'])} "
          f"(first {same_prefix} in the same order)")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"-> {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
