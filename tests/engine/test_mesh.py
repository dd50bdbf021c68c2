"""Training over a mesh of devices gives the single-device losses: data parallel and FSDP, full and LoRA.

    python -m pytest tests/engine/test_mesh.py -q -m slow

Eight CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8) must be set before jax
starts, so each check runs in a fresh Python process. Two processes of four devices each
train together through jax.distributed (gloo on CPU), and must agree with one process.
"""

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow        # each check starts fresh Python processes: ~30 s each on 2 cores

SETUP = """
import json, sys
import jax, numpy as np
from minagent import lora, model, train

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


def test_data_parallel_and_fsdp_give_the_single_device_losses():
    got = result(python("""
        mesh = train.data_mesh()
        assert mesh.size == 8
        shard = train.placement(model.init(jax.random.PRNGKey(0), CFG), mesh, "fsdp")["layers"]["wq"].spec
        print(json.dumps({"spec": list(shard), **{f"{kind} {how}": losses(mesh if how != "single" else None, how
                          if how != "single" else "data", kind == "lora")
                          for kind in ("full", "lora") for how in ("single", "data", "fsdp")}}))
    """))
    assert got.pop("spec") == [None, "data", None]        # wq [L, D, NH] = [2, 32, 32]: D first of the largest
    for kind in ("full", "lora"):
        single = got[f"{kind} single"]
        assert len(single) == 5 and single[-1] < single[0]
        for how in ("data", "fsdp"):
            assert max(abs(a - b) for a, b in zip(got[f"{kind} {how}"], single)) <= 1e-5, (kind, how, got)


def test_the_batch_must_split_over_the_devices():
    got = result(python("""
        import dataclasses
        try:
            losses(train.data_mesh(), tcfg=dataclasses.replace(TCFG, batch_size=6))
        except ValueError as e:
            print(json.dumps(str(e)))
    """))
    assert "batch_size=6 must be a multiple of the mesh's 8 devices" in got


def free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_train_together_as_one():
    """2 processes x 4 CPU devices, jax.distributed over gloo: one mesh of 8, the single process's losses."""
    port = free_port()
    code = """
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize("localhost:{port}", num_processes=2, process_id={i})
        assert jax.device_count() == 8 and jax.local_device_count() == 4
        print(json.dumps(losses(train.data_mesh(), "fsdp")))
    """
    procs = [python(code.format(port=port, i=i), devices=4) for i in range(2)]
    one = result(python("print(json.dumps(losses()))"))
    both = [result(p) for p in procs]
    assert both[0] == both[1]
    assert max(abs(a - b) for a, b in zip(both[0], one)) <= 1e-5, (both, one)
