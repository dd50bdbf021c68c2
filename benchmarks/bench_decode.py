"""Greedy decode speed on CPU: minagent's paged engine vs Hugging Face transformers' `generate` and llama.cpp.

    python benchmarks/bench_decode.py              # batch 1 and 32, 64 tokens, 3 turns
    python benchmarks/bench_decode.py --quick      # batch 1 and 4, 16 tokens; writes nothing (5 min)
    python benchmarks/bench_decode.py --one-core   # one core, one thread each (a shared machine): 27 min
    python benchmarks/bench_decode.py --quick --no-ref   # minagent alone, no torch: about 4 min

(Times on one busy core, load 5: most of it goes to minagent's bfloat16 rows, slow on CPU.)

SmolLM2-135M-Instruct, the same chat prompt in every row, `--new` greedy tokens. The engines:

    minagent f32                float32 weights (minagent dequantizes the GGUF file itself)
    minagent bf16, f32 cache    the same weights rounded to bfloat16, the KV cache in float32
    minagent bf16, bf16 cache   the same with the cache in bfloat16
    minagent int8               the float32 weights in int8 (minagent/int8.py), activations split in two int8 parts (one row: as they are)
    transformers f32 / bf16     the same weights (its GGUF loader dequantizes too), float32 / bfloat16
    transformers int8           its float32 model through torch's dynamic quantization (every nn.Linear,
                                the output head included: int8 weights, one scale a matrix; activations
                                rounded to int8 at each product): the int8 engine a torch user has at hand
    llama.cpp                   batch 1 only: llama-cpp-python on the GGUF file as it is (quantized weights)

"minagent bf16" in the ratios is the faster of its two cache dtypes (by the median decode step).
Each timed run covers everything from the prompt to the last token (prefill included, as
`generate` does); compiling happens in an untimed warm-up run. The engines take turns,
`--repeats` times, so that load from other processes on the machine hits them all; the table
reports the best run of each, and the median decode step of the best run (steadier than a total
under bursts of load). Greedy tokens are compared with minagent f32's: how many leading tokens agree;
and for minagent's other weights, on minagent f32's tokens (teacher forcing), how often the top
token is the same and the mean KL divergence of the next-token distributions (steadier than agreement,
which ends at the first near tie).
Run it on an idle machine: with two threads each and other work running, torch's threads slow
down far more than XLA's, which flatters minagent. The script warns when the load average is above 0.5.

Then the host overhead: a small random model at batch 64, where the model is
cheap and Python's bookkeeping shows: the share of the wall time of `step()`
spent outside the jitted calls (timed with block_until_ready).

Writes benchmarks/results/decode.json. Needs the `ref` extra (torch, transformers,
llama-cpp-python; without llama_cpp its rows are skipped, with the reason printed);
--no-ref runs minagent's engines and the host overhead only (SmolLM2's chat template
rebuilt with minagent's tokenizer), prints them and writes nothing.
"""

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--one-core" in sys.argv:     # must be decided before jax starts its thread pool
    os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from minagent import chat, decode, int8, model, tokenfile, weights  # noqa: E402
from minagent.batch import Batch  # noqa: E402
from minagent.runner import RunnerConfig  # noqa: E402
from minagent.cache import pages_for  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results" / "decode.json"
QUESTION = "Write a short story about a robot who learns to paint."
SMOLLM_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"   # its template's default
REFERENCE = "minagent f32"       # the engine whose greedy tokens the others are compared with
BATCH_1_ONLY = ("llama.cpp",)
RATIOS = [("minagent f32", "transformers f32"), ("minagent bf16", "transformers bf16"),
          ("minagent bf16", "minagent f32"), ("minagent f32", "llama.cpp"), ("minagent bf16", "llama.cpp"),
          ("minagent int8", "minagent f32"), ("minagent int8", "transformers f32"), ("minagent int8", "llama.cpp"),
          ("minagent int8", "transformers int8")]


@dataclasses.dataclass
class Run:
    """One timed greedy decode: wall seconds, the time after each step (from the start), row 0's tokens."""
    seconds: float
    stamps: list
    tokens: list
    compiles: int | None = None     # traces of the jitted steps it caused (minagent only)


def to_bfloat16(params):
    """The params pytree with every float array rounded to bfloat16."""
    return jax.tree.map(lambda a: a.astype(jnp.bfloat16) if jnp.issubdtype(a.dtype, jnp.floating) else a, params)


def minagent_run(params, cfg, prompt, B, new, cache_dtype="float32"):
    """B copies of `prompt`, `new` greedy tokens each, the KV cache in `cache_dtype`."""
    batch = Batch(params, cfg, slots=B, n_pages=1 + B * pages_for(len(prompt) + new, 16), page_size=16,
                  runner=RunnerConfig(cache_dtype=cache_dtype))
    t0 = time.perf_counter()
    ids = [batch.add(prompt, new) for _ in range(B)]
    stamps = []
    while batch.running():
        batch.step()
        stamps.append(time.perf_counter())
    return Run(stamps[-1] - t0, [t - t0 for t in stamps], batch.seqs[ids[0]].tokens[len(prompt):], batch.compiles)


def hf_run(hf_model, prompt, B, new):
    """The same with transformers' generate; a logits processor notes the time of each step."""
    import torch
    ids = torch.tensor([prompt] * B)
    stamps = []

    def stamp(input_ids, scores):     # called once per generated token, after the model's forward
        stamps.append(time.perf_counter())
        return scores

    t0 = time.perf_counter()
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                min_new_tokens=new, do_sample=False, pad_token_id=2, logits_processor=[stamp])
    return Run(time.perf_counter() - t0, [t - t0 for t in stamps], out[0, len(prompt):].tolist())


def torch_int8(hf_model):
    """hf_model with every nn.Linear in int8 (torch's dynamic quantization); None (the reason printed)
    where this torch has none (torch.ao.quantization is deprecated: newer releases may drop it)."""
    import torch
    try:
        return torch.ao.quantization.quantize_dynamic(hf_model, {torch.nn.Linear}, dtype=torch.qint8)
    except (AttributeError, ImportError, RuntimeError) as e:
        print(f"transformers int8 skipped: {type(e).__name__}: {e}")
        return None


def llama_cpp_model(path, threads, n_ctx):
    """llama-cpp-python's model on the GGUF file, `threads` threads; None (the reason printed) without it."""
    try:
        import llama_cpp
    except ImportError as error:
        print(f"llama.cpp rows skipped: llama_cpp is not importable ({error}); it comes with the ref extra "
              f"(pyproject.toml says how to build it)", flush=True)
        return None
    return llama_cpp.Llama(str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False)


def llama_cpp_info(llm, threads):
    """llama.cpp's version, threads, its description of the model (the weight type last) and CPU features."""
    import ctypes
    import llama_cpp
    desc = ctypes.create_string_buffer(256)
    llama_cpp.llama_model_desc(llm.model, desc, len(desc))
    return {"llama_cpp": llama_cpp.__version__, "llama_cpp_threads": threads, "llama_cpp_weights": desc.value.decode(),
            "llama_cpp_system": llama_cpp.llama_print_system_info().decode().strip()}


def llama_cpp_run(llm, prompt, new):
    """Batch 1 with llama.cpp, from an empty cache: generate() yields each greedy token (temp 0) once sampled."""
    llm.reset()                                      # forget the last run's tokens: no prefix reuse
    stamps, tokens = [], []
    t0 = time.perf_counter()
    for token in llm.generate(prompt, temp=0.0):
        stamps.append(time.perf_counter())
        tokens.append(token)
        if len(tokens) == new:
            break
    return Run(stamps[-1] - t0, [t - t0 for t in stamps], tokens)


def fidelity(variant, reference, prompt, tokens):
    """On prompt + tokens (minagent f32's greedy ones): how often the variant's top next token is the
    reference's, and the mean KL(reference || variant) of the next-token distributions, in nats.
    variant, reference: (params, cfg)."""
    seq = jnp.asarray([list(prompt) + list(tokens)])
    ref, got = (jax.nn.log_softmax(model.forward(p, c, seq)[0, len(prompt) - 1:-1].astype(jnp.float32))
                for p, c in (reference, variant))
    return {"top1_same": int((ref.argmax(-1) == got.argmax(-1)).sum()), "of": len(tokens),
            "kl_nats": float(jnp.mean(jnp.sum(jnp.exp(ref) * (ref - got), axis=-1)))}


def step_ms(stamps):
    """Median time of a decode step (after the first, which includes the prefill), in ms: robust to bursts
    of load from other processes, which a total time is not."""
    return 1e3 * statistics.median(np.diff(stamps))


def leading_agreement(tokens, reference):
    """How many leading tokens two greedy runs share."""
    return next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))


def measure(engines, B, args):
    """One row: each engine at batch B, an untimed warm-up run each (compiling), then `args.repeats` turns."""
    names = [name for name in engines if B == 1 or name not in BATCH_1_ONLY]
    warmups = {name: engines[name](B) for name in names}
    runs = {name: [] for name in names}
    for _ in range(args.repeats):                                 # take turns
        for name in names:
            runs[name].append(engines[name](B))
    reference = runs[REFERENCE][-1].tokens
    row = {"batch": B, "new_tokens": args.new, "engines": {}, "reference_tokens": [int(t) for t in reference]}
    for name in names:
        best = min(run.seconds for run in runs[name])
        row["engines"][name] = {
            "tok_s": B * args.new / best, "decode_step_ms": min(step_ms(run.stamps) for run in runs[name]),
            "first_token_s": min(run.stamps[0] for run in runs[name]),
            "greedy_tokens_agree": leading_agreement(runs[name][-1].tokens, reference),
            "runs_s": [run.seconds for run in runs[name]]}
        if warmups[name].compiles is not None:
            row["engines"][name].update(warmup_compiles=warmups[name].compiles,
                                        compiles_after_warmup=max(run.compiles for run in runs[name]))
    add_ratios(row)
    return row


def add_ratios(row):
    """The faster minagent bf16 engine, and the tok/s and decode-step ratios of each pair that both ran."""
    engines = row["engines"]
    bf16 = min((name for name in engines if name.startswith("minagent bf16")),
               key=lambda name: engines[name]["decode_step_ms"])
    row["minagent_bf16_cache"] = bf16.split(", ")[1]
    alias = {"minagent bf16": bf16}
    row["ratios"] = {}
    for ours, theirs in RATIOS:
        a, b = alias.get(ours, ours), alias.get(theirs, theirs)
        if a in engines and b in engines:
            row["ratios"][f"{ours} / {theirs}"] = {
                "tok_s": engines[a]["tok_s"] / engines[b]["tok_s"],
                "decode_step": engines[b]["decode_step_ms"] / engines[a]["decode_step_ms"]}


def print_row(row):
    """One line per engine, then the ratios."""
    for name, e in row["engines"].items():
        compiles = (f"; {e['warmup_compiles']} compiles in the warm-up, {e['compiles_after_warmup']} after"
                    if "warmup_compiles" in e else "")
        print(f"{row['batch']:>5} {name:<26} {e['tok_s']:>7.1f} {e['decode_step_ms']:>8.1f} "
              f"{e['first_token_s']:>8.2f} {e['greedy_tokens_agree']:>4}/{row['new_tokens']}  "
              f"runs {', '.join(f'{s:.2f}' for s in e['runs_s'])} s{compiles}")
    print(f"{'':>5} minagent bf16 below: the {row['minagent_bf16_cache']} (the faster decode step)")
    for pair, r in row["ratios"].items():
        print(f"{'':>5} {pair:<38} {r['tok_s']:>5.2f}x tok/s, {r['decode_step']:>5.2f}x decode step")


def matmul_floor(params, B, repeats=5):
    """ms for the weight matmuls of one decode step at batch B and nothing else, in XLA and in torch.

    Every projection of every layer and the unembedding, [B, D] @ [D, *], on the same float32 weights
    (no attention, no norms, no cache). An engine built on these libraries cannot step faster than this, so
    transformers' step / floor bounds the speed-up any engine could show against it.
    """
    import torch
    names = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
    layers = [[np.asarray(params["layers"][n][l]) for n in names] for l in range(params["layers"]["wq"].shape[0])]
    unembed_DxV = np.asarray(params.get("unembed", params["embed"].T))
    D = unembed_DxV.shape[0]

    @jax.jit
    def dots_xla(ws, unembed_DxV, x_BxD):
        for wq, wk, wv, wo, wg, wu, wd in ws:
            q_BxNH, k, v = x_BxD @ wq, x_BxD @ wk, x_BxD @ wv
            x_BxD = x_BxD + (q_BxNH + k.sum() + v.sum()) @ wo
            x_BxD = x_BxD + (jax.nn.silu(x_BxD @ wg) * (x_BxD @ wu)) @ wd
        return jnp.argmax(x_BxD @ unembed_DxV, axis=-1)

    def dots_torch(ws, unembed_DxV, x_BxD):
        for wq, wk, wv, wo, wg, wu, wd in ws:
            q_BxNH, k, v = x_BxD @ wq, x_BxD @ wk, x_BxD @ wv
            x_BxD = x_BxD + (q_BxNH + k.sum() + v.sum()) @ wo
            x_BxD = x_BxD + (torch.nn.functional.silu(x_BxD @ wg) * (x_BxD @ wu)) @ wd
        return torch.argmax(x_BxD @ unembed_DxV, dim=-1)

    def best_ms(fn, *args):
        fn(*args)                                       # compile / warm up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - t0)
        return 1e3 * min(times)

    x_BxD = np.random.RandomState(0).randn(B, D).astype(np.float32) * 0.1
    with torch.no_grad():
        torch_args = ([[torch.from_numpy(w) for w in ws] for ws in layers], torch.from_numpy(unembed_DxV),
                      torch.from_numpy(x_BxD))
        return {"xla_ms": best_ms(dots_xla, layers, unembed_DxV, x_BxD), "torch_ms": best_ms(dots_torch, *torch_args)}


def host_overhead(B=64, steps=64):
    """Share of step() wall time spent outside the jitted calls, small random model at batch B."""
    cfg = model.Config(vocab_size=8197, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=192)
    params = model.init(jax.random.PRNGKey(0), cfg)
    inside = [0.0]
    real = decode.decode_step, decode.prefill_step

    def timed(fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            out = jax.block_until_ready(fn(*args, **kwargs))
            inside[0] += time.perf_counter() - t0
            return out
        return wrapper

    batch = Batch(params, cfg, slots=B, n_pages=1 + B * 8, page_size=16, max_len=128)
    rng = np.random.RandomState(0)
    for _ in range(B):
        batch.add(list(rng.randint(5, cfg.vocab_size, rng.randint(4, 40))), steps)
    batch.warmup()
    batch.step()                     # prefill, untimed: the steady state is the decode step
    decode.decode_step, decode.prefill_step = timed(real[0]), timed(real[1])
    try:
        t0 = time.perf_counter()
        for _ in range(steps - 1):
            batch.step()
        total = time.perf_counter() - t0
    finally:
        decode.decode_step, decode.prefill_step = real
    return {"batch": B, "steps": steps - 1, "ms_per_step": 1e3 * total / (steps - 1),
            "ms_in_jit_per_step": 1e3 * inside[0] / (steps - 1), "share_outside_jit": 1 - inside[0] / total}


def overhead_line(overhead):
    return (f"host overhead at batch {overhead['batch']} (d_model 64, 2 layers): {overhead['ms_per_step']:.2f} ms "
            f"per step, {overhead['ms_in_jit_per_step']:.2f} ms inside jit, "
            f"{100 * overhead['share_outside_jit']:.1f}% outside")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--new", type=int, default=64, help="greedy tokens generated per row")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="batch 1 and 4, 16 tokens, 1 repeat")
    parser.add_argument("--one-core", action="store_true",
                        help="one core, one thread per engine: steadier on a machine shared with other work, "
                             "where two-thread runs (torch's above all) slow down erratically")
    parser.add_argument("--no-ref", action="store_true",
                        help="minagent alone, without torch, transformers and llama.cpp: prints, writes nothing")
    args = parser.parse_args()
    if args.quick:
        args.batches, args.new, args.repeats = [1, 4], 16, 1
    path = weights.smollm2_path()
    params, cfg = weights.load_params(path)
    params16, cfg16 = to_bfloat16(params), dataclasses.replace(cfg, dtype="bfloat16")
    params8 = int8.quantize(params)
    engines = {"minagent f32": lambda B: minagent_run(params, cfg, prompt, B, args.new),
               "minagent bf16, f32 cache": lambda B: minagent_run(params16, cfg16, prompt, B, args.new),
               "minagent bf16, bf16 cache": lambda B: minagent_run(params16, cfg16, prompt, B, args.new, "bfloat16"),
               "minagent int8": lambda B: minagent_run(params8, cfg, prompt, B, args.new)}
    versions = {"jax": jax.__version__}
    if args.no_ref:
        tok = tokenfile.from_gguf(path)         # the prompt SmolLM2's chat template makes, without transformers
        prompt = chat.encode(tok, chat.prompt(chat.CHATML, QUESTION, system=SMOLLM_SYSTEM))
    else:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        if args.one_core:
            torch.set_num_threads(1)
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        prompt = list(tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                              tokenize=True, return_dict=True)["input_ids"])

        def hf_model(dtype):
            return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).eval()

        hf_f32, hf_bf16 = hf_model(torch.float32), hf_model(torch.bfloat16)
        engines["transformers f32"] = lambda B: hf_run(hf_f32, prompt, B, args.new)
        engines["transformers bf16"] = lambda B: hf_run(hf_bf16, prompt, B, args.new)
        hf_int8 = torch_int8(hf_model(torch.float32))
        if hf_int8 is not None:
            engines["transformers int8"] = lambda B: hf_run(hf_int8, prompt, B, args.new)
        versions["torch"] = torch.__version__
        threads = 1 if args.one_core else len(os.sched_getaffinity(0))
        llm = llama_cpp_model(path, threads, n_ctx=len(prompt) + args.new + 16)
        if llm is not None:
            engines["llama.cpp"] = lambda B: llama_cpp_run(llm, prompt, args.new)
            versions.update(llama_cpp_info(llm, threads))
    load_before = os.getloadavg()
    print(f"{'batch':>5} {'engine':<26} {'tok/s':>7} {'step ms':>8} {'first s':>8} {'agree':>7}", flush=True)
    rows = []
    for B in args.batches:
        rows.append(measure(engines, B, args))
        if not args.no_ref:
            floor = matmul_floor(params, B)
            rows[-1].update(matmul_floor_ms=floor, best_possible_step_ratio=(
                rows[-1]["engines"]["transformers f32"]["decode_step_ms"] / min(floor.values())))
        print_row(rows[-1])
        sys.stdout.flush()

    tokens = rows[0]["reference_tokens"]
    quality = {name: fidelity(variant, (params, cfg), prompt, tokens)
               for name, variant in (("minagent bf16", (params16, cfg16)), ("minagent int8", (params8, cfg)))}
    overhead = host_overhead(steps=16 if args.quick else 64)
    n_cores = len(os.sched_getaffinity(0))
    cores = "1 core (--one-core)" if args.one_core else f"{n_cores} core{'s' * (n_cores > 1)}"
    result = {"device": f"{platform.processor() or platform.machine()}, {cores}", **versions,
              "prompt_tokens": len(prompt), "load_average_before": load_before,
              "load_average_after": os.getloadavg(), "rows": rows, "teacher_forced": quality,
              "host_overhead": overhead}
    result["machine_busy"] = max(load_before[0], result["load_average_after"][0]) > 0.5

    print(f"\nSmolLM2-135M greedy decode, CPU ({result['device']}), {len(prompt)}-token prompt, "
          f"load {load_before[0]:.1f}")
    if result["machine_busy"]:
        print("WARNING: the machine was busy with other work: these numbers are not reliable "
              "(two-thread torch suffers most); rerun on an idle machine or with --one-core")
    print("tok/s: prompt to last token, best run. step: median decode step, best run. first: time to the first "
          "token (prefill included). agree: leading greedy tokens the same as minagent f32's.")
    if "llama_cpp_weights" in result:
        print(f"llama.cpp {result['llama_cpp']}, {result['llama_cpp_threads']} thread(s), "
              f"weights as it loads them: {result['llama_cpp_weights']}")
    print(f"{'batch':>5} {'engine':<26} {'tok/s':>7} {'step ms':>8} {'first s':>8} {'agree':>7}")
    for row in rows:
        print_row(row)
    if not args.no_ref:
        print("floor: the float32 weight matmuls of one step alone (XLA / torch, ms); best possible: transformers "
              "f32 step / the faster floor, the step ratio that an engine doing nothing but those matmuls would reach")
        for row in rows:
            print(f"{row['batch']:>5} floor {row['matmul_floor_ms']['xla_ms']:.1f} / "
                  f"{row['matmul_floor_ms']['torch_ms']:.1f} ms, best possible step ratio "
                  f"{row['best_possible_step_ratio']:.2f}")
    for name, q in quality.items():
        print(f"{name} against minagent f32 on its {q['of']} greedy tokens: top token the same {q['top1_same']} / "
              f"{q['of']}, mean KL {q['kl_nats']:.4f} nats")
    print(overhead_line(overhead))
    if args.quick or args.no_ref:    # a smoke test, or nothing to compare with: keep the real results
        return
    out = RESULTS.with_name("decode_one_core.json") if args.one_core else RESULTS
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
