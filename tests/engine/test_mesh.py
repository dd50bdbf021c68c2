"""Over a mesh of devices, training gives the single-device losses (data parallel and FSDP, full and
LoRA), and a Batch split over the devices gives the single-device tokens.

    python -m pytest tests/engine/test_mesh.py -q -m slow

Eight CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8) must be set before jax
starts, so each check runs in a fresh Python process. Two processes of four devices each
train together through jax.distributed (gloo on CPU), and must agree with one process.
"""

import inspect
import json
import os
import socket
import subprocess
import sys
import textwrap

import jax
import pytest

from minagent import train
from minagent.mesh import data_mesh

slow = pytest.mark.slow              # each check that starts fresh Python processes: ~30 s each on 2 cores

SETUP = """
import json, sys
import jax, numpy as np
from minagent import lora, model, train
from minagent.mesh import data_mesh
from minagent.runner import RunnerConfig

CFG = model.Config(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)
TCFG = train.TrainConfig(steps=5, batch_size=8, seq_len=32, lr=1e-2, warmup=2, log_every=1)
rng = np.random.RandomState(0)
EXAMPLES = [(rng.randint(0, 64, n), rng.randint(0, 2, n)) for n in rng.randint(8, 30, 40)]

def losses(mesh=None, sharding="data", adapters=False, tcfg=TCFG):
    params = model.init(jax.random.PRNGKey(0), CFG)       # here, not above: after jax.distributed.initialize
    if adapters:
        _, history = lora.train_lora(params, CFG, EXAMPLES, tcfg, rank=4, new_rows=2, progress=False,
                                     mesh=mesh, sharding=sharding)
    else:
        _, history = train.train(params, CFG, EXAMPLES, tcfg, progress=False, mesh=mesh, sharding=sharding)
    return [r["loss"] for r in history]
"""


def python(code, env=None, devices=8):
    env = {**os.environ, **(env or {}), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(SETUP) + textwrap.dedent(code)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result(proc, timeout=600):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@slow
def test_data_parallel_and_fsdp_give_the_single_device_losses():
    got = result(python("""
        mesh = data_mesh()
        assert mesh.size == 8
        shard = train.placement(model.init(jax.random.PRNGKey(0), CFG), mesh, "fsdp")["layers"]["wq"].spec
        explicit = jax.make_mesh((8,), ("data",))           # "explicit" axes: taken as automatic ones
        print(json.dumps({"spec": list(shard), "full explicit": losses(explicit),
                          **{f"{kind} {how}": losses(mesh if how != "single" else None, how
                          if how != "single" else "data", kind == "lora")
                          for kind in ("full", "lora") for how in ("single", "data", "fsdp")}}))
    """))
    assert got.pop("spec") == [None, "data", None]        # wq [L, D, NH] = [2, 32, 32]: D first of the largest
    assert max(abs(a - b) for a, b in zip(got.pop("full explicit"), got["full single"])) <= 1e-5
    for kind in ("full", "lora"):
        single = got[f"{kind} single"]
        assert len(single) == 5 and single[-1] < single[0]
        for how in ("data", "fsdp"):
            assert max(abs(a - b) for a, b in zip(got[f"{kind} {how}"], single)) <= 1e-5, (kind, how, got)


@slow
def test_the_batch_must_split_over_the_devices():
    got = result(python("""
        import dataclasses
        try:
            losses(data_mesh(), tcfg=dataclasses.replace(TCFG, batch_size=6))
        except ValueError as e:
            print(json.dumps(str(e)))
    """))
    assert "batch_size=6 must be a multiple of the mesh's 8 devices" in got


def free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@slow
def test_two_processes_train_together_as_one():
    """2 processes x 4 CPU devices, jax.distributed over gloo: one mesh of 8, the single process's losses."""
    port = free_port()
    code = """
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize("localhost:{port}", num_processes=2, process_id={i})
        assert jax.device_count() == 8 and jax.local_device_count() == 4
        print(json.dumps(losses(data_mesh(), "fsdp")))
    """
    procs = [python(code.format(port=port, i=i), devices=4) for i in range(2)]
    one = result(python("print(json.dumps(losses()))"))
    both = [result(p) for p in procs]
    assert both[0] == both[1]
    assert max(abs(a - b) for a, b in zip(both[0], one)) <= 1e-5, (both, one)


def serve(mesh, seed, slots=8, n=1):
    """12 sequences through a Batch of `slots` slots (temperature 1), n decode steps a call (step() or
    steps(n)): random prompts and limits; each
    time one pauses, stops or reaches its limit, it is sent new tokens (up to 3 times; every third
    time parked first), then finished. What is sent depends on the sequence only, never on the
    schedule. Checks on the way that each sequence's pages lie on one device, and at the end that
    every page of every device is free -> (each sequence's tokens, pauses, parks)."""
    import jax
    import numpy as np
    from minagent import model
    from minagent.batch import WAITING, Batch
    from minagent.runner import RunnerConfig
    V = 40
    cfg = model.Config(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)
    params = jax.tree.map(lambda w: 4 * w if w.ndim > 1 else w, model.init(jax.random.PRNGKey(0), cfg))
    D = 1 if mesh is None else mesh.size
    # Pages for all 12 on each device (10 each at most): parked sequences keep theirs, and with less a
    # device could hold parked ones that all wait for more pages there, a schedule the caller must break.
    batch = Batch(params, cfg, slots=slots, n_pages=1 + 12 * 10, page_size=4, max_len=40,
                  temperature=1.0, pause_tokens=[3], stop_tokens=[4],
                  runner=RunnerConfig(buckets=(4, 16), prefill_rows=(2,), mesh=mesh))
    rng = np.random.RandomState(seed)
    ids = [batch.add(list(rng.randint(5, V, rng.randint(1, 20))), int(rng.randint(1, 12))) for _ in range(12)]
    sent, pauses, parks = dict.fromkeys(ids, 0), 0, 0
    while True:
        for i in ids:                                    # the caller, in id order
            seq = batch.seqs[i]
            if seq.status in WAITING:
                pauses += seq.status == "paused"
                more = [5 + (7 * i + 3 * sent[i] + j) % (V - 5) for j in range(1 + (i + sent[i]) % 4)]
                if sent[i] < 3 and batch.fits(len(seq.tokens) + len(more), 6):
                    if (i + sent[i]) % 3 == 0:
                        batch.park(i)
                        parks += 1
                    sent[i] += 1
                    batch.send(i, seq.tokens + more, 6)
                else:
                    batch.finish(i)
        if not batch.running():
            break
        batch.step() if n == 1 else batch.steps(n)
        for seq in batch.seqs.values():
            assert len({batch.pool.device_of(p) for p in seq.pages}) <= 1, seq
    assert [len(f) for f in batch.pool.free] == [batch.pool.n_pages - 1] * D, "leaked pages"
    return [batch.seqs[i].tokens for i in ids], pauses, parks


@slow
def test_several_steps_a_call_give_the_tokens_of_one_step_a_call():
    """Batch.steps(n): n decode steps in one device call (pause, stop and limit checked on the device),
    the caller acting only between calls: each sequence gets the tokens it gets one step a call."""
    plain, pauses, parks = serve(None, 1)
    assert serve(None, 1, n=5)[0] == plain
    assert pauses > 0 and parks > 0


@slow
def test_a_batch_on_a_one_device_mesh_equals_the_plain_batch():
    """The mesh path (shard_map, global page ids) on one device: the same tokens as without a mesh."""
    plain, pauses, parks = serve(None, 0)
    assert serve(data_mesh(jax.devices()[:1]), 0) == (plain, pauses, parks)
    assert pauses > 0 and parks > 0


@slow
def test_a_batch_split_over_8_devices_gives_the_single_device_tokens():
    """Slots and pages split over 8 CPU devices (1 and 2 slots each), random schedules with pause,
    send, park and finish: each sequence's tokens as on one device; no page leaks on any device."""
    got = result(python(inspect.getsource(serve) + textwrap.dedent("""
        mesh = data_mesh()
        assert mesh.size == 8
        out = []
        for seed in range(4):
            for slots in (8, 16):
                one, many = serve(None, seed, slots), serve(mesh, seed, slots)
                out.append([one == many, one[1], one[2]])
        one, many = serve(None, 0, 16), serve(mesh, 0, 16, n=4)         # and several steps a call
        out.append([one[0] == many[0], 0, 0])
        print(json.dumps(out))
    """)))
    assert all(same for same, _, _ in got), got
    assert sum(p for _, p, _ in got) > 0 and sum(k for _, _, k in got) > 0


@slow
def test_new_batch_gives_each_device_the_pages_of_its_own_holders():
    """Suspected, and confirmed: on a mesh of D devices new_batch gave every device the pages of all
    `holders`, D times what is needed (Batch's n_pages is per device). Now each device holds the
    pages of holders / D sequences of max_len (rounded up), and that is enough for a full batch."""
    got = result(python("""
        from minagent import agent, chat
        from minagent import tokenizer as tk
        from minagent.cache import pages_for
        from minagent.tasks.rote import rote
        tok = tk.train("look at this " * 50, vocab_size=300, specials=tk.MINAGENT_SPECIALS)
        params, cfg = rote(tok, "<|assistant|><|call|>look<|result|>")
        mesh = data_mesh()
        out = {}
        for holders in (None, 12):
            b = agent.new_batch(params, cfg, tok, chat.MINAGENT, slots=16, max_len=64, holders=holders,
                                runner=RunnerConfig(mesh=mesh))
            out[str(holders)] = [b.pool.n_pages, b.pool.n_devices, pages_for(64, 16)]
        records = agent.run(b, tok, chat.MINAGENT, [f"q{i}" for i in range(16)], [lambda c: "ok"] * 16, max_calls=2)
        out["records"] = [len(r.calls) for r in records]
        out["used"] = b.pool.n_used
        print(json.dumps(out))
    """))
    assert got["None"] == [2 * 4 + 1, 8, 4]            # 16 holders / 8 devices = 2 each, 4 pages each
    assert got["12"] == [2 * 4 + 1, 8, 4]              # 12 / 8, rounded up
    assert got["records"] == [2] * 16 and got["used"] == 0
