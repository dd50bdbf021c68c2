"""How long do 64 agent episodes take on a CPU: one workload, the same weights, several loops.

    python benchmarks/bench_agent.py                  # 64 episodes, 1 and 2 threads, every loop: ~31 min
    python benchmarks/bench_agent.py --quick          # 4 episodes, all cores: a smoke test, a few minutes
    python benchmarks/bench_agent.py --quick --no-ref # minagent's two loops alone: no torch, no llama.cpp
    python benchmarks/bench_agent.py --quick --train-steps 2  # try the training path (a 2-step adapter, own checkpoint)
    python benchmarks/bench_agent.py --bf16 --gguf-type q8_0 --threads 2 --loops llama.cpp
                                                      # bfloat16 matrices against llama.cpp's Q8_0: ~9 min

(Times on 2 CPU cores of an AMD EPYC Zen 4, 2026-12-03: the full run 31 min, of which minagent's
warm-ups compile for 16.4 min, before the prefill buckets 12 and 24 were added, which made a
warm-up about a third longer; a full run first trains the adapter if 03's checkpoint is not there:
7 to 12 more minutes.)

The workload: SmolLM2-135M-Instruct with <|call|> and <|result|> added (ids 49152, 49153) and the
"tool" LoRA adapter of experiments/03_calculator.py merged into its weights (lora.merge), greedy,
float32, on `--episodes` held-out-phrasing missions of the families add, together, later and
sort_ages: one, three, two and four calls, served by the real tools (tools.Toolbox(mission.seed)).
The adapter is read from 03's checkpoint (experiments/results/03_smollm2_tool_lora-*.ckpt), or
trained here with exactly 03's recipe and saved there, where 03 finds it too. --quick never trains:
without the checkpoint it runs the base model (which does not call tools) and says so.

The loops, each an agent that sends the conversation, reads a call, runs the tool and sends the result:

    minagent batched       agent.run with every episode in one agent.new_batch: one decode step
                           advances all of them; a tool runs beside the batch; the paged KV cache
                           keeps each conversation, so only new tokens go through the model
    minagent one by one    the same loop with a batch of one slot, the episodes one after another,
                           its prefill chunks padded to ONE_ROW_BUCKETS
    transformers resend    what a simple agent framework writes: `generate` until <|result|> or
                           <|im_end|>, run the tool, append the result and the turn marker, and send
                           the WHOLE conversation to `generate` again (LlamaForCausalLM, the same
                           merged weights, float32)
    transformers cached    the same, generate continuing from the episode's KV cache (its `cache`,
                           `past_key_values` before transformers 5.2x): only new tokens go through
    llama.cpp              llama-cpp-python on the merged weights written as a GGUF file (F32, or
                           --gguf-type), its Llama object kept across turns: its prefix cache
                           pushes only the new tokens

Every loop follows minagent's rules (at most 8 calls, 40 tokens a stretch, --max-len tokens an
episode) and encodes with minagent's tokenizer, so on the same weights they write the same episodes.
Checks before timing: transformers' and llama.cpp's logits against minagent's on a gold trace
(max |difference|), and after: each loop's episodes against minagent batched's, the count of
identical ones (same calls, same answers), and where any part (the first token that differs,
and how close the two best logits were there: float differences decide near ties).

Timing: each --threads setting runs in processes of its own (each of minagent's loops in one, the
other loops together in another): one thread is one core (os.sched_setaffinity) and
XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
torch.set_num_threads and llama.cpp's n_threads. In a process each loop first warms up, untimed:
minagent compiles every shape its steps can use (Batch.warmup: 43 shapes of the 30-layer step for
one slot, 94 for 64, where a prefill call runs at 4 or 16 rows and a decode step at 8, 16, 32 or 64;
and 6 more, one a page-table width, for the stretch in one call of an episode alone in the loop;
reported apart as "compiling"), transformers and
llama.cpp run one episode (--quick: every loop runs its few episodes once, which compiles only the
shapes they use). Then one timed run of all the episodes. Reported: episodes per second, wall time
per episode, positions through the model (tokens pushed, summed: the whole conversation each turn
for "resend", only new tokens for the others), CPU seconds over wall seconds (the cores kept busy),
minagent batched's speed over each loop's, and where the time goes: for minagent the jitted model
calls, the Batch's host work around them (batch.step less those), the loop's host work (the rest)
and the tools (in worker threads beside the loop), each timed by wrapping from the outside (the
jitted calls are waited for, so their time is counted where it is spent); for the others the
model's forward calls (llama.cpp: Llama.eval), the host work around them and the tools. The CPU is
named, with its avx512f / avx512_vnni / amx_int8 flags.

Inside the model's time, every loop's calls are split into decode calls (one new token a row) and
prefill calls (more: prompts, and results appended on resume), with their count, seconds, and how
much of what they computed held something: rows with a sequence (minagent's fixed-shape steps
compute every slot) and positions with a token (its prefill pads chunks to a length bucket).
minagent's sampling from a prefill's logits (decode.sample_step, a small call of its own) counts
in the model's time, but in neither kind. Bytes
per token against bandwidth, for the decode calls: each worker first reads a 512 MiB matrix with
a jitted matrix-vector product (the bandwidth a decode step can reach on its cores) and times the
float32 model's matrix-vector products alone at batch 1, in one jitted call (the floor XLA's kernels
put under a decode call); a loop's decode calls then read weight bytes x calls / seconds, where a
call at batch 1 reads every weight once (the weights: minagent's Runner's arrays, torch's
parameters, the GGUF file).

llama.cpp's KV cache is float32, as minagent's and torch's are (its default, float16, moves the
logits by ~2e-2).

--int8: the same workload with int8 weights, dtype for dtype: minagent's int8.quantize (one scale
an output row; activations in two int8 parts, or as they are in a decode step of one row) against
llama.cpp on the merged weights written as Q8_0 (one scale a block of 32); transformers is left out.
The two round differently, so their episodes may part where float32's agree; the bench says where.

--bf16: minagent's matrices in bfloat16 (bf16.matrices: activations, norms and the embedding table
stay float32; each product rounds x to bfloat16 and sums in float32) against llama.cpp on the merged
weights written as BF16, or as --gguf-type says (q8_0: against llama.cpp's fastest format here);
transformers is left out. On a CPU with AVX512_BF16 both multiply bfloat16 pairs in hardware.

--int8 --bf16: int8.quantize(params, bf16=True), each matrix in int8 and in bfloat16 beside: a
decode step of one row reads the int8 values, every product of more rows the bfloat16 ones (a
prefill, a batch's step); against llama.cpp's Q8_0, or --gguf-type.

Writes benchmarks/results/agent.json (--out elsewhere; --quick writes only where --out says).
Needs the `ref` extra for transformers and llama.cpp (pyproject.toml says how to build llama.cpp);
a loop whose library is missing is skipped, with the reason printed. Run it on an idle machine:
with other work on the cores, torch's and llama.cpp's threads wait for each other, and two of them
can run ten times slower or more (beside a training job, transformers' two-thread run of the 64
episodes had not ended after 17 minutes; at one thread it took 93 s).
"""

import argparse
import collections
import dataclasses
import functools
import importlib.util
import json
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
CORES = "BENCH_AGENT_CORES"     # a worker's cores ("0,1"), set by its parent: XLA sizes its pool when jax starts
if os.environ.get(CORES):
    os.sched_setaffinity(0, {int(c) for c in os.environ[CORES].split(",")})

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from minagent import agent, bf16, chat, decode, int8, lora, model, tokenfile, train, weights  # noqa: E402
from minagent import tokenizer as tk  # noqa: E402
from minagent.tasks.calculator import demo, missions  # noqa: E402
from minagent.runner import RunnerConfig  # noqa: E402
from minagent.tools import Toolbox  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "agent.json"
FMT = chat.CHATML
FAMILIES = ("add", "together", "later", "sort_ages")     # 1, 3, 2 and 4 calls
# A batch of one slot makes every prefill call one row: one row count where the batch has two, so
# half the compiled prefill shapes, and room for lengths that fit this workload's chunks: a tool's
# result of 4 or 5 digits is 9 or 10 tokens with its markers (12 with the default buckets), a
# prompt 18 to 26. So: the defaults and 9, 10 and 20; 17 more shapes to compile
# (experiments/LOG.md, 2026-12-06: what they save).
ONE_ROW_BUCKETS = tuple(sorted({*RunnerConfig.buckets, 9, 10, 20}))
LOOPS = ("minagent batched", "minagent one by one", "transformers resend", "transformers cached", "llama.cpp")
REFERENCE = "minagent batched"      # the loop the others are compared with
LOGIT_TARGET = 1e-3                 # max |logit difference| expected from float32 rounding alone
ONE_THREAD_XLA = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--seed", type=int, default=0, help="of the missions")
    p.add_argument("--threads", type=int, nargs="+", default=None,
                   help="thread settings, each in its own process (default 1 and 2; --quick: all cores)")
    p.add_argument("--loops", nargs="+", choices=LOOPS, default=list(LOOPS), metavar="LOOP",
                   help=f"a subset of: {', '.join(LOOPS)} ({REFERENCE} always runs: the reference)")
    p.add_argument("--max-len", type=int, default=512, help="tokens an episode may hold, in every loop")
    p.add_argument("--gguf-type", choices=("f32", "f16", "bf16", "q8_0"), default=None,
                   help="the merged weights as llama.cpp reads them (default f32, the same numbers as the "
                        "others; q8_0 with --int8, bf16 with --bf16)")
    p.add_argument("--int8", action="store_true",
                   help="int8 weights, dtype for dtype: minagent's int8.quantize against llama.cpp's q8_0 "
                        "(transformers is left out)")
    p.add_argument("--bf16", action="store_true",
                   help="minagent's matrices in bfloat16 (bf16.matrices) against llama.cpp's bf16, or "
                        "--gguf-type (transformers is left out); with --int8: int8 for one row, bfloat16 "
                        "beside for more (int8.quantize(params, bf16=True))")
    p.add_argument("--beside", type=int, default=None, metavar="N",
                   help="minagent batched: a prefill of chunks of up to N tokens runs in the decode step's call "
                        "(RunnerConfig.prefill_beside); its warm-up then runs the episodes once, as every shape "
                        "of its batch would not fit one process's memory mappings (runner.py, \"Shapes\")")
    p.add_argument("--prefill-rows", type=int, nargs="+", default=None, metavar="R",
                   help="minagent batched: these prefill row counts (RunnerConfig.prefill_rows, default 4 16); "
                        "warmed up by a run of the episodes, as with --beside. With --beside the beside rows "
                        "are the smallest (or up to --beside-rows): 2 4 8 16 pads a prefill beside the step to 2 "
                        "rows, not 4")
    p.add_argument("--beside-rows", type=int, default=None, metavar="R",
                   help="minagent batched, with --beside: up to R rows of a prefill go beside the decode step, "
                        "padded to the smallest prefill row count that holds them (RunnerConfig.beside_rows; "
                        "default the smallest), warmed up by a run of the episodes, as with --beside")
    p.add_argument("--packed", action="store_true",
                   help="minagent batched: each call's products take only its real tokens (RunnerConfig.packed); "
                        "warmed up by a run of the episodes, as with --beside")
    p.add_argument("--train-steps", type=int, default=None,
                   help="train the adapter this many steps instead of 03's (its own checkpoint): to try the path")
    p.add_argument("--no-ref", action="store_true", help="minagent's loops alone: no torch, no llama.cpp")
    p.add_argument("--quick", action="store_true", help="4 episodes, all cores, never trains: a smoke test")
    p.add_argument("--out", default=None, help=f"the JSON file (default {RESULTS.relative_to(ROOT)})")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)   # internal: the plan of one process
    args = p.parse_args(argv)
    if args.prefill_rows is not None and min(args.prefill_rows) < 1:
        p.error(f"--prefill-rows {' '.join(map(str, args.prefill_rows))}: row counts of at least 1")
    if args.beside_rows is not None and (args.beside_rows < 1 or args.beside is None):
        p.error(f"--beside-rows {args.beside_rows}: a row count of at least 1, with --beside")
    if args.quick:
        args.episodes = min(args.episodes, 4)
    if args.threads is None:
        args.threads = [len(os.sched_getaffinity(0))] if args.quick else [1, 2]
    if args.no_ref:
        args.loops = [name for name in args.loops if name.startswith("minagent")]
    if args.int8 or args.bf16:     # minagent's format, and llama.cpp's Q8_0 or BF16
        args.gguf_type = args.gguf_type or ("q8_0" if args.int8 else "bf16")
        args.loops = [name for name in args.loops if not name.startswith("transformers")]
    args.gguf_type = args.gguf_type or "f32"
    if REFERENCE not in args.loops:                  # every loop is compared with it
        args.loops.insert(0, REFERENCE)
    return args


# ---------------------------------------------------------------- the machine

def cpu_info():
    """The CPU's model name and which of CPU_FLAGS it has, from /proc/cpuinfo (Linux)."""
    text = pathlib.Path("/proc/cpuinfo").read_text() if pathlib.Path("/proc/cpuinfo").exists() else ""
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    return {"model": fields.get("model name", platform.processor() or platform.machine()),
            "cores": len(os.sched_getaffinity(0)), "flags": {f: f in flags for f in CPU_FLAGS}}


def has(module):
    return importlib.util.find_spec(module) is not None


# ---------------------------------------------------------------- the weights

def load_03():
    """experiments/03_calculator.py as a module (its name starts with a digit): its recipe's numbers."""
    sys.path.insert(0, str(ROOT / "experiments"))           # 03 imports experiments/common.py
    spec = importlib.util.spec_from_file_location("calculator_03", ROOT / "experiments" / "03_calculator.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def adapter_recipe(train_steps=None):
    """03's recipe for its "tool" adapter -> (03's args, the TrainConfig, the checkpoint path).
    The numbers are 03's defaults (03's parse_args); the TrainConfig is built as part_smollm2 builds
    it, so the checkpoint path, a hash of the recipe, is the one 03 writes and reads."""
    calc = load_03()
    a = calc.parse_args([])
    tcfg = train.TrainConfig(steps=train_steps or a.smol_steps, batch_size=4, seq_len=128, lr=a.smol_lr,
                             warmup=10, weight_decay=0.0, seed=a.seed, log_every=5)
    path = calc.common.checkpoint_path("03_smollm2_tool_lora", dict(
        missions=a.smol_missions, rank=a.rank, alpha=a.alpha, tcfg=dataclasses.asdict(tcfg)))
    return calc, a, tcfg, path


def smollm2_tokenizer():
    """SmolLM2's tokenizer with the chat format's tokens it lacks: <|call|> 49152, <|result|> 49153."""
    return tk.add_special_tokens(tokenfile.from_gguf(weights.smollm2_path()), FMT.specials)


def base_model():
    """SmolLM2 with <|call|> and <|result|> added, as 03 builds it -> (params, cfg, tok, n_new)."""
    base, cfg = weights.load_params()
    tok = smollm2_tokenizer()
    n_new = tok.n_vocab - cfg.vocab_size
    base = model.add_tokens(base, n_new)                            # rows: the mean of the table's rows
    return base, model.with_vocab(cfg, base), tok, n_new


def tool_weights(base, cfg, tok, n_new, args):
    """The base weights with 03's tool adapter merged in -> (params, what they are: a dict).

    The adapter comes from 03's checkpoint; if absent it is trained with 03's recipe and saved there
    (~15 min on 2 cores). --quick never trains: it returns the base weights."""
    calc, a, tcfg, path = adapter_recipe(args.train_steps)
    about = {"adapter": str(path.relative_to(ROOT)), "train_steps": tcfg.steps}
    like = lora.init(jax.random.PRNGKey(a.seed), base, a.rank, new_rows=n_new)
    if path.exists():
        print(f"the tool adapter: {about['adapter']}")
        adapters = train.load_checkpoint(path, params_like=like)["params"]
        return lora.merge(base, adapters, a.alpha), {**about, "trained_now": False}
    if args.quick and args.train_steps is None:
        print(f"--quick: no tool adapter at {about['adapter']}, so the base model (it will not call tools); "
              f"a run without --quick trains it")
        return base, {**about, "adapter": None}
    print(f"training the tool adapter with 03's recipe ({tcfg.steps} steps), saved to {about['adapter']}")
    train_ms = missions.generate(a.smol_missions, seed=a.seed + 1, split="train", families=calc.SMOL_FAMILIES,
                                 fmt=FMT)
    t0 = time.perf_counter()
    adapters, _ = lora.train_lora(base, cfg, demo.examples(train_ms, tok), tcfg, rank=a.rank, alpha=a.alpha,
                                  new_rows=n_new, seed=a.seed, checkpoint_path=path, tokenizer=tok)
    return lora.merge(base, adapters, a.alpha), {**about, "trained_now": True,
                                                 "train_minutes": (time.perf_counter() - t0) / 60}


def save_params(params, cfg, path):
    """The merged params as an .npz (the processes that time the loops read it) and cfg as JSON."""
    flat = {"embed": params["embed"], "final_norm": params["final_norm"],
            **{f"layers/{k}": v for k, v in params["layers"].items()}}
    np.savez(path, **{k: np.asarray(v) for k, v in flat.items()})
    pathlib.Path(path).with_suffix(".json").write_text(json.dumps(dataclasses.asdict(cfg)))


def load_params(path):
    with np.load(path) as z:
        layers = {k.split("/", 1)[1]: jnp.asarray(z[k]) for k in z.files if k.startswith("layers/")}
        params = {"embed": jnp.asarray(z["embed"]), "final_norm": jnp.asarray(z["final_norm"]), "layers": layers}
    return params, model.Config(**json.loads(pathlib.Path(path).with_suffix(".json").read_text()))


# ---------------------------------------------------------------- the same weights for transformers

def unpermute(w_OxI, n_heads):
    """GGUF's q/k row order (adjacent pairs rotate together, model.rope) -> Hugging Face's rotate_half
    order (row i pairs with row i + H/2), per head: the inverse of llama.cpp's convert permutation."""
    O, I = w_OxI.shape
    return w_OxI.reshape(n_heads, O // n_heads // 2, 2, I).swapaxes(1, 2).reshape(O, I)


def hf_model(params, cfg):
    """LlamaForCausalLM holding minagent's params (float32). minagent computes x @ w with w [in, out];
    torch's Linear holds [out, in]: each matrix is transposed, and wq, wk un-permuted."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    hf_cfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
                         num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                         num_key_value_heads=cfg.n_kv_heads, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
                         tie_word_embeddings=cfg.tie_embeddings, max_position_embeddings=8192,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    names = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
             "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj",
             "attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
    heads = {"wq": cfg.n_heads, "wk": cfg.n_kv_heads}
    state = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["final_norm"]}
    for ours, theirs in names.items():
        for l in range(cfg.n_layers):
            w = np.asarray(params["layers"][ours][l])
            if w.ndim == 2:
                w = unpermute(w.T, heads[ours]) if ours in heads else w.T
            state[f"model.layers.{l}.{theirs}.weight"] = w
    hf = LlamaForCausalLM(hf_cfg).eval()
    missing, unexpected = hf.load_state_dict({k: torch.tensor(np.asarray(v)) for k, v in state.items()},
                                             strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    hf.tie_weights()                                # lm_head is the embedding table
    return hf


# ---------------------------------------------------------------- the same weights for llama.cpp

def write_gguf(params, cfg, tok, base_path, out_path, qtype="f32"):
    """The merged params as a GGUF file llama.cpp loads: the base file's metadata (architecture,
    tokenizer, chat template), its vocabulary grown by the two added tokens, every tensor replaced.
    GGUF holds [out, in] matrices (numpy's shape; GGUF lists it as [in, out]) in the q/k row order
    minagent keeps, so minagent's [in, out] matrices go in transposed, not permuted."""
    import gguf
    types = {"f32": (np.float32, None), "f16": (np.float16, None),
             "bf16": (np.float32, gguf.GGMLQuantizationType.BF16),
             "q8_0": (np.float32, gguf.GGMLQuantizationType.Q8_0)}
    dtype, quant = types[qtype]
    reader = gguf.GGUFReader(base_path)
    writer = gguf.GGUFWriter(out_path, arch=reader.fields["general.architecture"].contents())
    n_base = len(reader.fields["tokenizer.ggml.tokens"].data)
    added = [tok.pieces[i].decode() for i in range(n_base, tok.n_vocab)]      # <|call|>, <|result|>
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue                                 # the writer writes these itself
        value = field.contents()
        if name == "tokenizer.ggml.tokens":
            value = value + added
        elif name == "tokenizer.ggml.token_type":
            value = value + [3] * len(added)        # 3: a control token, as <|im_end|>
        elif name == "llama.vocab_size":
            value = cfg.vocab_size
        elif name == "general.file_type":
            value = {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}[qtype]  # llama.cpp's LLAMA_FTYPE_*
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(name, value, field.types[0], sub)

    def matrix(name, w_OxI):
        w = np.ascontiguousarray(np.asarray(w_OxI, np.float32))
        if quant is None:
            writer.add_tensor(name, w.astype(dtype))
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, quant), raw_dtype=quant)   # its shape: bytes a row

    theirs = {"wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output", "w_gate": "ffn_gate",
              "w_up": "ffn_up", "w_down": "ffn_down", "attn_norm": "attn_norm", "mlp_norm": "ffn_norm"}
    matrix("token_embd.weight", params["embed"])     # tied: also the output head
    writer.add_tensor("output_norm.weight", np.asarray(params["final_norm"], np.float32))
    for l in range(cfg.n_layers):
        for ours, name in theirs.items():
            w = np.asarray(params["layers"][ours][l], np.float32)
            if w.ndim == 1:                          # norms stay float32, as in every GGUF file
                writer.add_tensor(f"blk.{l}.{name}.weight", w)
            else:
                matrix(f"blk.{l}.{name}.weight", w.T)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def llama_cpp_model(gguf_path, threads, n_ctx, logits_all=False):
    """llama.cpp on the GGUF file, its KV cache in float32 as minagent's and transformers' are (its
    default, float16, moves the logits by ~2e-2 and tips near ties)."""
    import llama_cpp
    f32 = llama_cpp.GGML_TYPE_F32
    return llama_cpp.Llama(str(gguf_path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                           type_k=f32, type_v=f32, logits_all=logits_all, verbose=False)


# ---------------------------------------------------------------- the checks before timing

def logit_checks(params, cfg, tok, ms, gguf_path, loops):
    """max |logit difference| against minagent's model.forward on the first mission's gold trace
    (its calls and results included: the two added tokens are read and written)."""
    tokens, _ = chat.render(ms[0].trace, tok)
    ours_TxV = np.asarray(model.forward(params, cfg, jnp.asarray(tokens[None]))[0])
    out = {"tokens": len(tokens)}
    if any(name.startswith("transformers") for name in loops):
        import torch
        with torch.no_grad():
            theirs = hf_model(params, cfg)(torch.tensor(tokens[None].astype(np.int64))).logits[0].numpy()
        out["transformers"] = diff(ours_TxV, theirs)
    if "llama.cpp" in loops and gguf_path is not None:
        llm = llama_cpp_model(gguf_path, len(os.sched_getaffinity(0)), len(tokens) + 8, logits_all=True)
        llm.eval([int(t) for t in tokens])
        out["llama.cpp"] = diff(ours_TxV, np.asarray(llm.scores[:len(tokens)]))
    for name in ("transformers", "llama.cpp"):
        if name in out:
            d = out[name]
            verdict = "ok" if d["max_abs_diff"] <= LOGIT_TARGET else "ABOVE the target: expect episodes to part"
            print(f"logits, {name} vs minagent on a {len(tokens)}-token gold trace: max |difference| "
                  f"{d['max_abs_diff']:.2e} (target <= {LOGIT_TARGET:g}: {verdict}; largest |logit| "
                  f"{d['max_abs_logit']:.1f}), same argmax {d['argmax_same']}/{len(tokens)}")
    return out


def diff(ours_TxV, theirs_TxV):
    return {"max_abs_diff": float(np.abs(ours_TxV - theirs_TxV).max()),
            "max_abs_logit": float(np.abs(ours_TxV).max()),
            "argmax_same": int((ours_TxV.argmax(-1) == theirs_TxV.argmax(-1)).sum())}


# ---------------------------------------------------------------- timing helpers

class Clock:
    """Seconds summed per key, and positions pushed through the model. wrap(key, fn) -> fn, timed;
    blocking=True waits for a jitted call's result, so that its time is counted where it is spent
    and not at the next read on the host."""

    def __init__(self):
        self.seconds, self.lock = collections.Counter(), threading.Lock()   # tools add from worker threads
        self.positions = 0
        # model calls by kind, "decode" (one new token a row) or "prefill" (more): calls, seconds, rows
        # computed and rows that held a sequence, token positions computed and positions that held a token
        self.calls = collections.defaultdict(collections.Counter)

    def model_call(self, kind, seconds, rows, real_rows, positions, real_positions, calls=1):
        c = self.calls[kind]
        c.update(calls=calls, seconds=seconds, rows=rows, real_rows=real_rows, positions=positions,
                 real_positions=real_positions)

    def wrap(self, key, fn, blocking=False):
        def timed(*args, **kw):
            t0 = time.perf_counter()
            try:
                out = fn(*args, **kw)
                return jax.block_until_ready(out) if blocking else out
            finally:
                with self.lock:
                    self.seconds[key] += time.perf_counter() - t0
        return timed


def toolboxes(ms, clock):
    """A fresh Toolbox for each mission (its people table, its failure), each call timed."""
    return [clock.wrap("tools", Toolbox(m.seed, fail_first=m.fail_first)) for m in ms]


def episode(status, answer, calls, tokens, positions):
    """What the report keeps of an episode, the same for every loop."""
    return {"status": status, "answer": answer, "calls": [list(c) for c in calls],
            "tokens": [int(t) for t in tokens], "positions": int(positions)}


# ---------------------------------------------------------------- minagent's loops

def minagent_loop(params, cfg, tok, slots, max_len, compile_shapes=True, beside=None, prefill_rows=None,
                  packed=False, beside_rows=None):
    """-> run(missions) -> (episodes, clock): agent.run with `slots` slots, every mission in one batch
    (slots = the missions) or one after another (slots = 1, with ONE_ROW_BUCKETS). compile_shapes:
    compile every shape the Batch's steps can use now (Batch.warmup), so that nothing compiles while
    timed; else the first run compiles what it uses. beside: RunnerConfig.prefill_beside;
    prefill_rows: RunnerConfig.prefill_rows (None: its default); packed: RunnerConfig.packed (a
    call's positions are then those its products took); beside_rows: RunnerConfig.beside_rows.

    Instrumented from the outside: batch.step (the model's step and the Batch's host work around
    it), the jitted prefill and decode calls inside it, and each tool call."""
    rows = {} if prefill_rows is None else {"prefill_rows": tuple(prefill_rows)}
    shapes = RunnerConfig(buckets=ONE_ROW_BUCKETS, prefill_beside=beside, packed=packed, **rows) \
        if slots == 1 else RunnerConfig(prefill_beside=beside, packed=packed, beside_rows=beside_rows, **rows)
    batch = agent.new_batch(params, cfg, tok, FMT, slots=slots, max_len=max_len, runner=shapes)
    t0 = time.perf_counter()
    if compile_shapes:       # and the stretch in one call of an episode alone in the loop (Loop.step)
        batch.warmup(steps=(agent.MAX_STRETCH,))

    def run(ms):
        clock = Clock()
        real = {"prefill_step": decode.prefill_step, "decode_step": decode.decode_step,     # decode's own,
                "sample_step": decode.sample_step, "decode_steps": decode.decode_steps,    # put back after
                "decode_prefill_step": decode.decode_prefill_step}
        batch.step, batch.steps = clock.wrap("batch.step", batch.step), clock.wrap("batch.step", batch.steps)
        prefill_jit = clock.wrap("jit", real["prefill_step"], blocking=True)
        decode_jit = clock.wrap("jit", real["decode_step"], blocking=True)
        steps_jit = clock.wrap("jit", real["decode_steps"], blocking=True)
        both_jit = clock.wrap("jit", real["decode_prefill_step"], blocking=True)

        def prefill_step(params, cfg, cache, tokens_BxT, start_B, n_new_B, table_BxW, **kw):
            t0 = time.perf_counter()
            out = prefill_jit(params, cfg, cache, tokens_BxT, start_B, n_new_B, table_BxW, **kw)
            n_new_B = np.asarray(n_new_B)
            clock.model_call("prefill", time.perf_counter() - t0, len(n_new_B), int((n_new_B > 0).sum()),
                             kw.get("packed", tokens_BxT.size), int(n_new_B.sum()))
            return out

        def decode_step(params, cfg, cache, slots, *args, **kw):
            t0 = time.perf_counter()
            out = decode_jit(params, cfg, cache, slots, *args, **kw)
            active = int(np.asarray(slots.active_B).sum())
            clock.model_call("decode", time.perf_counter() - t0, len(slots.active_B), active,
                             kw.get("packed", len(slots.active_B)), active)
            return out
        def decode_steps(params, cfg, cache, slots, *args):     # an episode alone: its stretch in one call
            t0 = time.perf_counter()
            decode.decode_step = real["decode_step"]    # what its loop calls, if traced now: not timed
            try:
                out = steps_jit(params, cfg, cache, slots, *args)
            finally:
                decode.decode_step = decode_step
            took_NxR = np.asarray(out[1]) >= 0
            n_steps, tokens = int(took_NxR.any(axis=1).sum()), int(took_NxR.sum())
            rows = n_steps * len(slots.active_B)
            # counted as its n_steps decode steps: "calls" are steps, each reading every weight once
            clock.model_call("decode", time.perf_counter() - t0, rows, tokens, rows, tokens, calls=n_steps)
            return out
        def decode_prefill_step(params, cfg, cache, slots, tokens_RxT, start_R, n_new_R, table_RxW, *args, **kw):
            t0 = time.perf_counter()
            out = both_jit(params, cfg, cache, slots, tokens_RxT, start_R, n_new_R, table_RxW, *args, **kw)
            B, active, n_new_R = len(slots.active_B), int(np.asarray(slots.active_B).sum()), np.asarray(n_new_R)
            clock.model_call("decode+prefill", time.perf_counter() - t0, B + len(n_new_R),
                             active + int((n_new_R > 0).sum()), kw.get("packed", B + tokens_RxT.size),
                             active + int(n_new_R.sum()))
            return out
        decode.prefill_step, decode.decode_step, decode.decode_steps = prefill_step, decode_step, decode_steps
        decode.decode_prefill_step = decode_prefill_step
        decode.sample_step = clock.wrap("jit", real["sample_step"], blocking=True)    # a prefill's next tokens
        try:
            boxes = toolboxes(ms, clock)
            prompts = [m.trace[0] for m in ms]
            if slots >= len(ms):
                records = agent.run(batch, tok, FMT, prompts, boxes)
            else:
                records = [r for i in range(0, len(ms), slots)
                           for r in agent.run(batch, tok, FMT, prompts[i:i + slots], boxes[i:i + slots])]
        finally:
            del batch.step, batch.steps                      # the class's methods again
            for name, fn in real.items():
                setattr(decode, name, fn)
        return [episode(r.status, r.answer, r.calls, r.tokens, r.positions) for r in records], clock

    run.batch, run.compile_s = batch, time.perf_counter() - t0 if compile_shapes else None
    return run


# ---------------------------------------------------------------- the simple loop (transformers, llama.cpp)

def simple_episode(mission, tok, box, generate, max_len):
    """One episode the way a simple agent framework runs it, with minagent's rules and token ids.

    generate(tokens) -> the tokens of one stretch: greedy, at most agent.MAX_STRETCH, ending at
    <|result|> or <|im_end|> if one comes. After <|result|> the call is the text since <|call|>; the
    tool's result and the turn marker are appended, and generate sees the whole conversation again.
    -> (status, answer, calls, tokens), as agent.Loop would record them."""
    call_id, result_id, end_id = (tok.special(s) for s in (FMT.call, FMT.result, FMT.end))
    tokens, calls = chat.encode(tok, mission.trace[0]), []

    def written(ids, after=None):                        # agent.Loop.written
        if after in ids:
            ids = ids[len(ids) - ids[::-1].index(after):]
        return tok.decode([t for t in ids if t not in (result_id, end_id)]).strip()

    while True:
        new = generate(tokens)
        tokens = tokens + new
        if new[-1] == result_id:                         # paused on a call
            if len(calls) == agent.MAX_CALLS:
                return "calls", "", calls, tokens
            call = written(new, after=call_id)
            result = box(call)
            calls.append((call, result))
            sent = chat.encode(tok, chat.render_message(chat.Message("result", result), FMT))
            if len(tokens) + len(sent) + agent.MAX_STRETCH > max_len:      # Batch.fits
                return "max_len", "", calls, tokens
            tokens = tokens + sent
        elif new[-1] == end_id:
            return "done", written(new), calls, tokens
        else:                                            # the stretch ran out
            return "stretch", "", calls, tokens


def simple_loop(new_generate, tok, max_len):
    """-> run(missions) -> (episodes, clock): the episodes one after another, each with its own
    generate function from new_generate(clock) (a fresh cache, a fresh conversation)."""
    def run(ms):
        clock = Clock()
        out = []
        for m, box in zip(ms, toolboxes(ms, clock)):
            before = clock.positions
            status, answer, calls, tokens = simple_episode(m, tok, box, new_generate(clock), max_len)
            out.append(episode(status, answer, calls, tokens, clock.positions - before))
        return out, clock
    return run


def transformers_generate(hf, tok, cached):
    """new_generate(clock) for transformers: `generate` on the whole conversation each turn; cached:
    with the episode's KV cache from the last turn, so that only the tokens it has not seen go
    through the model. A forward hook counts the positions and times the model's forward calls."""
    import torch
    from transformers import DynamicCache
    from transformers.generation.utils import GenerateDecoderOnlyOutput
    # The cache's name, in generate's arguments and its output: `cache` since transformers 5.2x, before
    # that `past_key_values` (still taken, with a warning).
    cache_name = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"
    stops = [tok.special(FMT.result), tok.special(FMT.end)]

    def new_generate(clock):
        kv = {cache_name: DynamicCache()} if cached else {}
        t0 = {}

        def before(module, args, kwargs):
            t0["forward"] = time.perf_counter()
            clock.positions += kwargs["input_ids"].shape[1]

        def after(module, args, kwargs, output):
            seconds, n = time.perf_counter() - t0["forward"], kwargs["input_ids"].shape[1]
            clock.seconds["model"] += seconds
            clock.model_call("decode" if n == 1 else "prefill", seconds, 1, 1, n, n)

        def generate(tokens):
            ids = torch.tensor([tokens])
            handles = (hf.register_forward_pre_hook(before, with_kwargs=True),
                       hf.register_forward_hook(after, with_kwargs=True))
            try:
                with torch.no_grad():
                    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=agent.MAX_STRETCH,
                                      do_sample=False, eos_token_id=stops, pad_token_id=stops[-1],
                                      return_dict_in_generate=True, **kv)
            finally:
                for h in handles:
                    h.remove()
            if cached:
                kv[cache_name] = getattr(out, cache_name)
            return out.sequences[0, len(tokens):].tolist()
        return generate
    return new_generate


def llama_cpp_generate(llm, tok):
    """new_generate(clock) for llama.cpp: Llama.generate on the whole conversation; it keeps the
    tokens it has evaluated and pushes only what follows their common prefix. Llama.eval is wrapped
    to count positions and time the model."""
    stops = {tok.special(FMT.result), tok.special(FMT.end)}
    real_eval = type(llm).eval

    def new_generate(clock):
        llm.reset()                                  # a new episode starts from an empty cache

        def timed_eval(tokens):
            clock.positions += len(tokens)
            t0 = time.perf_counter()
            real_eval(llm, tokens)
            seconds = time.perf_counter() - t0
            clock.seconds["model"] += seconds
            clock.model_call("decode" if len(tokens) == 1 else "prefill", seconds, 1, 1, len(tokens), len(tokens))
        llm.eval = timed_eval

        def generate(tokens):
            new = []
            for t in llm.generate(tokens, temp=0.0, repeat_penalty=1.0):
                new.append(int(t))
                if t in stops or len(new) == agent.MAX_STRETCH:
                    break
            return new
        return generate
    return new_generate


# ---------------------------------------------------------------- one process: one thread setting

def worker(plan_path, out_path):
    """Time every loop of the plan at its thread setting (this process's cores) -> a JSON file.

    Each loop warms up first, untimed. plan["warmup"] "shapes": minagent compiles every shape
    (Batch.warmup), the other loops run one episode; "run" (--quick): each loop runs all the
    episodes once, which compiles only the shapes they use (fewer: faster for a few episodes)."""
    plan = json.loads(pathlib.Path(plan_path).read_text())
    threads = plan["threads"]
    params, cfg = load_params(plan["params"])
    tok = smollm2_tokenizer()
    ms = missions.generate(plan["episodes"], seed=plan["seed"], split="test", families=FAMILIES, fmt=FMT)
    results, shared = {}, {}
    bandwidth, (bare_s, bare_bytes) = read_bandwidth(), bare_products(params, cfg)
    print(f"[{threads} thread(s)] reading a 512 MiB matrix (a jitted matrix-vector product): "
          f"{bandwidth / 1e9:.1f} GB/s; the model's matrix-vector products alone: {bare_s * 1e3:.1f} ms", flush=True)
    for name in plan["loops"]:
        say = functools.partial(print, f"[{threads} thread(s)] {name}:", flush=True)
        say("warming up")
        t0 = time.perf_counter()
        run = make_loop(name, params, cfg, tok, threads, plan, shared)
        minagent = name.startswith("minagent")
        # a minagent loop that compiled nothing yet (--beside, --prefill-rows, --packed) warms up on the episodes, as
        # --quick does
        warm_ms = ms if plan["warmup"] == "run" or (minagent and run.compile_s is None) else \
            [] if minagent else ms[:1]
        if warm_ms:
            run(warm_ms)
        res = {"warmup_s": time.perf_counter() - t0}
        if minagent:
            res.update(compile_s=run.compile_s, compiles=run.batch.compiles)
        say(f"{len(ms)} episodes")
        cpu0, t0 = time.process_time(), time.perf_counter()
        episodes, clock = run(ms)
        wall = time.perf_counter() - t0
        res.update(seconds=wall, cpu_seconds=time.process_time() - cpu0, episodes=episodes, clock=dict(clock.seconds),
                   bandwidth=bandwidth, bare_products=[bare_s, bare_bytes],     # this process's probes
                   model_calls={kind: dict(c) for kind, c in clock.calls.items()},
                   weight_bytes=weight_bytes(name, run, shared, plan))
        if minagent:
            res["compiles_while_timed"] = run.batch.compiles - res["compiles"]
        results[name] = res
        say(f"{wall:.1f} s")
    versions = {"jax": jax.__version__}
    for module in ("torch", "transformers", "llama_cpp"):
        if module in sys.modules:
            versions[module] = sys.modules[module].__version__
    pathlib.Path(out_path).write_text(json.dumps({"threads": threads, "loops": results, "versions": versions,
                                                  "bandwidth": bandwidth, "bare_products": [bare_s, bare_bytes]}))


def read_bandwidth(repeats=5):
    """Bytes per second these cores read weights at, as a decode step reads them: a jitted
    matrix-vector product over a 512 MiB float32 matrix, the best of `repeats` runs. The roofline
    of a step at batch 1, which must read every weight once per token."""
    w_IxO, x_I = jnp.ones((8192, 16384), jnp.float32), jnp.ones((8192,), jnp.float32)
    return w_IxO.nbytes / best_time(jax.jit(lambda x, w: x @ w), (x_I, w_IxO), repeats)


def bare_products(params, cfg, repeats=5):
    """Seconds of a decode step's matrix-vector products alone, float32, at batch 1: a vector through
    every layer's q, k, v, o, gate, up and down matrices in the step's order (each layer's input is
    the last one's output) and then the output head, one jitted call, the matrices as separate arrays
    (as the Runner holds them on CPU); the best of `repeats`. No attention, no cache, no norms: the
    floor that XLA's CPU kernels put under a decode call. -> (seconds, bytes of those matrices)."""
    layers = [{k: jnp.array(params["layers"][k][l]) for k in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")}
              for l in range(cfg.n_layers)]
    head_DxV = jnp.array(params["embed"].T)

    def products(layers, head_DxV):
        x_1xD = jnp.ones((1, cfg.d_model), head_DxV.dtype)
        for w in layers:
            q, k, v = x_1xD @ w["wq"], x_1xD @ w["wk"], x_1xD @ w["wv"]
            x_1xD = x_1xD + 1e-3 * (q @ w["wo"]) + 1e-9 * (k.sum() + v.sum())
            x_1xD = x_1xD + 1e-3 * ((x_1xD @ w["w_gate"]) * (x_1xD @ w["w_up"])) @ w["w_down"]
        return x_1xD @ head_DxV
    seconds = best_time(jax.jit(products), (layers, head_DxV), repeats)
    return seconds, sum(a.nbytes for a in jax.tree.leaves((layers, head_DxV)))


def best_time(jitted, args, repeats):
    """The shortest of `repeats` timed calls of jitted(*args), after one untimed call that compiles."""
    jitted(*args).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jitted(*args).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return best


def weight_bytes(name, run, shared, plan):
    """Bytes of weights a decode step at batch 1 reads: every matrix once (the tied embedding table
    too, as the output head). minagent: its Runner's params (int8 with their scales under --int8),
    less the embedding table where the head is a matrix of its own (int8.quantize and bf16.matrices
    make one): a lookup reads one row of it, and less int8's bfloat16 copies (--int8 --bf16): a
    step of one row reads the int8 values; transformers: its model's parameters; llama.cpp: the
    GGUF file (its header is a few MB)."""
    if name.startswith("minagent"):
        params = run.batch.runner.params
        looked_up = params["embed"].nbytes if "unembed" in params else 0
        matrices = jax.tree.leaves(params, is_leaf=lambda w: isinstance(w, int8.Int8))
        copies = sum(w.bf16.nbytes for w in matrices if isinstance(w, int8.Int8) and w.bf16 is not None)
        return sum(leaf.nbytes for leaf in jax.tree.leaves(params)) - looked_up - copies
    if name.startswith("transformers"):
        return sum(t.numel() * t.element_size() for t in shared["hf"].parameters())
    return pathlib.Path(plan["gguf"]).stat().st_size


def make_loop(name, params, cfg, tok, threads, plan, shared):
    """The run function of loop `name`, set up for `threads` threads (shared: the transformers
    model, built once for both of its loops)."""
    if name.startswith("minagent"):
        slots = plan["episodes"] if name == "minagent batched" else 1
        if plan.get("int8"):
            params = shared.setdefault("int8", int8.quantize(params, bf16=plan.get("bf16", False)))
        elif plan.get("bf16"):
            params = shared.setdefault("bf16", bf16.matrices(params))
        batched = name == "minagent batched"
        beside, rows = (plan.get("beside"), plan.get("prefill_rows")) if batched else (None, None)
        packed = batched and plan.get("packed", False)
        beside_rows = plan.get("beside_rows") if batched else None
        return minagent_loop(params, cfg, tok, slots, plan["max_len"], beside=beside, prefill_rows=rows,
                             packed=packed, beside_rows=beside_rows,
                             compile_shapes=plan["warmup"] == "shapes" and not (beside or rows or packed))
    if name.startswith("transformers"):
        import torch
        torch.set_num_threads(threads)
        if "hf" not in shared:
            shared["hf"] = hf_model(params, cfg)
        generate = transformers_generate(shared["hf"], tok, cached=name.endswith("cached"))
        return simple_loop(generate, tok, plan["max_len"])
    if name == "llama.cpp":
        llm = llama_cpp_model(plan["gguf"], threads, n_ctx=plan["max_len"])
        return simple_loop(llama_cpp_generate(llm, tok), tok, plan["max_len"])
    raise ValueError(name)


def run_worker(plan, threads, tmp):
    """Processes for one thread setting: `threads` cores (the last ones) and as many threads for each
    library. XLA sizes its pool when jax starts, so this must be decided before: a new process. Each
    of minagent's loops gets a process of its own, so that neither runs beside the other's compiled
    steps: each warms up every shape its Batch can use, and on CPU each compiled SmolLM2 step holds
    up to a thousand memory mappings (runner.py, "Shapes"): after a 64-slot warm-up of 113 shapes,
    the one-slot warm-up in the same process aborted in LLVM, out of Linux's 65,530 mappings a
    process. The other loops share one process."""
    cores = sorted(os.sched_getaffinity(0))[-threads:]
    env = {**os.environ, CORES: ",".join(map(str, cores))}
    if threads == 1:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + ONE_THREAD_XLA).strip()
    ours = [name for name in plan["loops"] if name.startswith("minagent")]
    groups = [[name] for name in ours] + [[name for name in plan["loops"] if name not in ours]]
    merged = None
    for g, loops in enumerate(group for group in groups if group):
        plan_path, out_path = tmp / f"plan_{threads}_{g}.json", tmp / f"worker_{threads}_{g}.json"
        plan_path.write_text(json.dumps({**plan, "threads": threads, "loops": loops}))
        subprocess.run([sys.executable, __file__, "--worker", str(plan_path), "--out", str(out_path)], env=env,
                       check=True)
        out = json.loads(out_path.read_text())
        if merged is None:
            merged = out                  # its probes stand for the setting; each loop keeps its own
        else:
            merged["loops"].update(out["loops"])
            merged["versions"].update(out["versions"])
    return merged


# ---------------------------------------------------------------- comparing the episodes

def same_episode(a, b):
    return a["status"] == b["status"] and a["answer"] == b["answer"] and a["calls"] == b["calls"]


def where_they_part(params, cfg, tok, a, b):
    """The first token where episodes a (the reference) and b differ, and the reference model's two
    best logits there: a gap of a few thousandths is a near tie that float rounding can tip."""
    k = next((i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y),
             min(len(a["tokens"]), len(b["tokens"])))
    out = {"token_index": k, "reference": tok.decode(a["tokens"][k:k + 6]), "other": tok.decode(b["tokens"][k:k + 6])}
    if 0 < k < len(a["tokens"]):
        logits_V = np.asarray(model.forward(params, cfg, jnp.asarray([a["tokens"][:k]]))[0, -1])
        top2 = np.sort(logits_V)[-2:]
        out["reference_top2_gap"] = float(top2[1] - top2[0])
    return out


def compare(runs, params, cfg, tok, max_reports=3):
    """Each loop's episodes against the reference's (minagent batched at the most threads):
    identical (same calls, answers, status), same tokens, and where a few of the others part."""
    ref_threads = max(t for t, r in runs.items() if REFERENCE in r["loops"])
    reference = runs[ref_threads]["loops"][REFERENCE]["episodes"]
    for r in runs.values():
        for res in r["loops"].values():
            pairs = list(zip(reference, res["episodes"]))
            res["identical"] = sum(same_episode(a, b) for a, b in pairs)
            res["same_tokens"] = sum(a["tokens"] == b["tokens"] for a, b in pairs)
            res["parted"] = [{"episode": i, **where_they_part(params, cfg, tok, a, b)}
                             for i, (a, b) in enumerate(pairs) if a["tokens"] != b["tokens"]][:max_reports]
    return ref_threads


# ---------------------------------------------------------------- figures and the report

def figures(res, n):
    """The numbers of one loop's timed run (its episodes' tokens left out of the JSON)."""
    wall, clock = res["seconds"], res["clock"]
    positions = sum(e["positions"] for e in res["episodes"])
    out = {"seconds": wall, "episodes_per_s": n / wall, "s_per_episode": wall / n, "positions": positions,
           "positions_per_s": positions / wall, "cpu_seconds": res["cpu_seconds"],
           "calls": sum(len(e["calls"]) for e in res["episodes"]), "identical": res["identical"],
           "same_tokens": res["same_tokens"], "parted": res["parted"], "warmup_s": res["warmup_s"],
           "bandwidth": res.get("bandwidth"), "bare_products": res.get("bare_products")}
    out["model_calls"] = calls = res.get("model_calls", {})
    decoding = calls.get("decode")
    if decoding and decoding["seconds"] > 0 and res.get("weight_bytes"):
        # weights read per second by the decode calls, as if each read every weight once (true at batch 1)
        out["weight_bytes"] = res["weight_bytes"]
        out["decode_bytes_per_s"] = res["weight_bytes"] * decoding["calls"] / decoding["seconds"]
    if "compiles" in res:
        step, jit, tools = (clock.get(k, 0.0) for k in ("batch.step", "jit", "tools"))
        out.update(compile_s=res["compile_s"], compiles_warmup=res["compiles"],
                   compiles_while_timed=res["compiles_while_timed"],
                   time_split={"model (jitted calls)": jit, "Batch host work": step - jit,
                               "loop host work": wall - step, "tools (in worker threads)": tools})
    else:
        model_s = clock.get("model", 0.0)
        out["time_split"] = {"model (forward calls)": model_s, "host work": wall - model_s,
                             "tools": clock.get("tools", 0.0)}
    return out


def report(runs, n, ref_threads):
    """-> {threads: {loop: figures}} with the ratios, printed as a table."""
    table = {}
    for threads, r in sorted(runs.items()):
        table[threads] = {name: figures(res, n) for name, res in r["loops"].items()}
        ref = table[threads].get(REFERENCE)
        for f in table[threads].values():
            f["minagent_batched_speedup"] = f["seconds"] / ref["seconds"] if ref else None
    print(f"\n{n} episodes, greedy; identical: episodes with the same calls, answers and status as minagent "
          f"batched's at {ref_threads} thread(s); x: minagent batched's speed over the loop's (same threads)")
    print("wall: the timed run; cores: CPU seconds / wall seconds; warm-up: untimed, compiling included")
    print(f"{'threads':>7} {'loop':<22} {'wall s':>7} {'ep/s':>6} {'s/ep':>6} {'positions':>9} {'pos/s':>6} "
          f"{'cores':>5} {'x':>5} {'identical':>9} {'warm-up s':>9}")
    for threads, loops in table.items():
        for name, f in loops.items():
            x = f"{f['minagent_batched_speedup']:.1f}" if f["minagent_batched_speedup"] else "-"
            compile_ = f" (compiling {f['compile_s']:.0f})" if f.get("compile_s") is not None else ""
            cores = f["cpu_seconds"] / f["seconds"]
            print(f"{threads:>7} {name:<22} {f['seconds']:>7.1f} {f['episodes_per_s']:>6.2f} "
                  f"{f['s_per_episode']:>6.2f} {f['positions']:>9} {f['positions_per_s']:>6.0f} {cores:>5.2f} "
                  f"{x:>5} {f['identical']:>5}/{n:<3} {f['warmup_s']:>9.1f}{compile_}")
    print("\nwhere the time of the timed run goes, seconds (share of the wall time)")
    for threads, loops in table.items():
        for name, f in loops.items():
            parts = ", ".join(f"{k} {v:.2f} ({v / f['seconds']:.0%})" for k, v in f["time_split"].items())
            print(f"{threads:>7} {name:<22} {parts}")
    print("\nthe model's calls in the timed run: decode (one new token a row), prefill (more: prompts, results),"
          "\ndecode+prefill (a decode step with a prefill's rows beside it, one call: RunnerConfig.prefill_beside);"
          "\nrows / positions: the share of the rows / token positions computed that held a sequence / a token;"
          "\nGB/s: weight bytes x decode calls / their seconds (a decode call at batch 1 reads every weight once),"
          "\nagainst the probe (a jitted matrix-vector product reading 512 MiB, the same threads, in the loop's process)")
    for threads, loops in table.items():
        for name, f in loops.items():
            probe = f.get("bandwidth") or runs[threads].get("bandwidth")
            parts = []
            for kind in ("decode", "prefill", "decode+prefill"):
                c = f["model_calls"].get(kind)
                if c:
                    parts.append(f"{kind} {c['calls']} calls {c['seconds']:.1f} s ({1e3 * c['seconds'] / c['calls']:.1f} ms "
                                 f"each), rows {c['real_rows'] / c['rows']:.0%}, positions "
                                 f"{c['real_positions'] / c['positions']:.0%}")
            if "decode_bytes_per_s" in f:
                share = f" = {f['decode_bytes_per_s'] / probe:.0%} of {probe / 1e9:.1f}" if probe else ""
                parts.append(f"{f['weight_bytes'] / 2**20:.0f} MiB of weights, {f['decode_bytes_per_s'] / 1e9:.1f} "
                             f"GB/s{share}")
            print(f"{threads:>7} {name:<22} " + "; ".join(parts))
        for name, f in loops.items():
            if f.get("bare_products"):
                bare_s, bare_bytes = f["bare_products"]
                print(f"{threads:>7} the model's matrix-vector products alone (float32, one jitted call, no attention),"
                      f" in {name}'s process: {bare_s * 1e3:.1f} ms ({bare_bytes / bare_s / 1e9:.1f} GB/s)")
    for threads, loops in table.items():
        for name, f in loops.items():
            for p in f["parted"]:
                gap = f", minagent's top-2 logit gap there {p['reference_top2_gap']:.4f}" \
                    if "reference_top2_gap" in p else ""
                print(f"{threads} thread(s), {name}: episode {p['episode']} parts at token {p['token_index']}: "
                      f"{p['reference']!r} vs {p['other']!r}{gap}")
    return table


def available(loops):
    """-> (the loops whose libraries are installed, {loop: why skipped})."""
    needs = {"transformers": ("torch", "transformers"), "llama.cpp": ("llama_cpp", "gguf")}
    skipped = {}
    for loop in loops:
        missing = [m for prefix, modules in needs.items() if loop.startswith(prefix) for m in modules if not has(m)]
        if missing:
            skipped[loop] = f"{', '.join(missing)} not installed (the ref extra; pyproject.toml)"
            print(f"{loop} skipped: {skipped[loop]}")
    return [loop for loop in loops if loop not in skipped], skipped


def export_gguf(params, cfg, tok, args, tmp, loops, skipped, about):
    """The merged weights as a GGUF file for llama.cpp -> its path, or None (llama.cpp then skipped, why said)."""
    if "llama.cpp" not in loops:
        return None
    path = tmp / f"merged-{args.gguf_type}.gguf"
    try:
        write_gguf(params, cfg, tok, weights.smollm2_path(), path, args.gguf_type)
    except Exception as e:                  # say why, and time the others
        skipped["llama.cpp"] = f"the merged weights could not be written as GGUF: {type(e).__name__}: {e}"
        print(f"llama.cpp skipped: {skipped['llama.cpp']}")
        loops.remove("llama.cpp")
        return None
    about["gguf"] = f"written with the gguf package: {args.gguf_type}, {path.stat().st_size / 2**20:.0f} MiB"
    return path


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return worker(args.worker, args.out)
    t_start, cpu, load_before = time.perf_counter(), cpu_info(), os.getloadavg()
    flags = ", ".join(f for f, on in cpu["flags"].items() if on) or "none of " + ", ".join(CPU_FLAGS)
    print(f"CPU: {cpu['model']}, {cpu['cores']} cores ({flags}); load average {load_before[0]:.1f}")
    if not weights.smollm2_path().exists():
        sys.exit(f"{weights.smollm2_path()} not found: `python -m minagent.weights fetch`")
    loops, skipped = available(args.loops)
    base, cfg, tok, n_new = base_model()
    params, about = tool_weights(base, cfg, tok, n_new, args)
    ms = missions.generate(args.episodes, seed=args.seed, split="test", families=FAMILIES, fmt=FMT)

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench_agent_"))    # the merged weights for the workers
    try:
        save_params(params, cfg, tmp / "params.npz")
        gguf_path = export_gguf(params, cfg, tok, args, tmp, loops, skipped, about)
        checks = logit_checks(params, cfg, tok, ms, gguf_path, loops)
        plan = {"params": str(tmp / "params.npz"), "gguf": str(gguf_path), "loops": loops, "seed": args.seed,
                "episodes": args.episodes, "max_len": args.max_len, "warmup": "run" if args.quick else "shapes",
                "int8": args.int8, "bf16": args.bf16, "beside": args.beside,
                "prefill_rows": args.prefill_rows, "packed": args.packed, "beside_rows": args.beside_rows}
        runs = {threads: run_worker(plan, threads, tmp) for threads in args.threads}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ref_threads = compare(runs, params, cfg, tok)
    table = report(runs, args.episodes, ref_threads)

    reference = runs[ref_threads]["loops"][REFERENCE]["episodes"]
    right = sum(e["answer"] == m.answer for e, m in zip(reference, ms))
    calls = [len(e["calls"]) for e in reference]
    weights_used = about["adapter"] or "the base model (no adapter)"
    print(f"\nminagent batched's episodes: {right}/{len(ms)} right answers, {np.mean(calls):.2f} calls per "
          f"episode ({min(calls)} to {max(calls)}); weights: {weights_used}")
    for threads, r in runs.items():
        print(f"versions ({threads} thread(s)): {r['versions']}")
    load_after = os.getloadavg()
    # The load after the run counts the bench's own threads (the last process's, for about a minute).
    if load_before[0] > cpu["cores"] / 4 or load_after[0] > max(args.threads) + cpu["cores"] / 4:
        print(f"WARNING: load average {load_before[0]:.1f} before, {load_after[0]:.1f} after (the bench's own "
              f"{max(args.threads)} thread(s) included) on {cpu['cores']} cores: other "
              f"work shared the CPUs, these times are not reliable; run it on an idle machine")
    minutes = (time.perf_counter() - t_start) / 60
    print(f"{minutes:.1f} minutes")
    result = {"cpu": cpu, "load_average_before": load_before, "load_average_after": load_after,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "quick": args.quick, "minutes": minutes,
              "workload": {"model": "SmolLM2-135M-Instruct, "
                           + (f"int8 and bfloat16 beside (minagent) / {args.gguf_type} (llama.cpp)"
                              if args.int8 and args.bf16 else
                              "int8 (minagent) / Q8_0 (llama.cpp)" if args.int8 else
                              f"bfloat16 matrices (minagent) / {args.gguf_type} (llama.cpp)" if args.bf16 else
                              "float32") + ", greedy",
                           "weights": weights_used,
                           "episodes": args.episodes, "families": FAMILIES, "seed": args.seed, "split": "test",
                           "max_len": args.max_len, "max_calls": agent.MAX_CALLS, "max_stretch": agent.MAX_STRETCH,
                           "prefill_beside": args.beside, "prefill_rows": args.prefill_rows, "packed": args.packed,
                           "beside_rows": args.beside_rows,
                           "right_answers": right, "calls_per_episode": float(np.mean(calls))},
              "weights": about, "skipped": skipped, "logit_checks": checks,
              "versions": {t: r["versions"] for t, r in runs.items()}, "runs": table,
              "read_bandwidth": {t: r.get("bandwidth") for t, r in runs.items()},
              "bare_products_s_bytes": {t: r.get("bare_products") for t, r in runs.items()},
              "reference": {"loop": REFERENCE, "threads": ref_threads}}
    out = pathlib.Path(args.out) if args.out else None if args.quick else RESULTS
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
