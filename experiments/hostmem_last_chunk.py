"""The host memory of a chunked prefill at long lengths on the CPU, measured on its longest chunk.

A chunked prefill (`prefill_chunk`, `jaxlong.generation.chunked`) allocates the cache once and runs one program per
chunk; XLA:CPU's memory over a program's attention loop comes back when the program returns, so the peak is the
last chunk's, the one that attends to the whole cache and runs the most kv iterations (`chunk_kv_steps`). A whole
prefill of 1M tokens takes hours on 2 cores (its causal attention grows with the square of the length), but its
last chunk runs alone in minutes. This script compiles the estimate (`jaxlong.evaluation.hostmem.prefill_estimate`,
as the eval command's guard does), allocates the cache (zeros where the earlier chunks' keys and values would be:
the same buffers, the same work), runs the last chunk's step once in this fresh process and prints its peak
resident memory (VmHWM) beside the estimate, and the chunk's time. The measured peak is a lower bound of the whole
prefill's (no earlier chunk left its memory behind) and omits the decode steps' temporaries (a few MiB here).

    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \\
        python experiments/hostmem_last_chunk.py 1048576 8192

The model and mesh are the host-memory test's (`tests/evaluation/test_hostmem.py`): a tiny Llama (2 layers,
hidden 64, 4 heads of 16), Ulysses over 4 CPU devices, blocks of 256. Results:
experiments/results/host_memory_ruler_cpu.md.
"""

from __future__ import annotations

import json
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlong.config import load_config
from jaxlong.core.mesh import BATCH_AXES, SEQ_AXES, build_mesh
from jaxlong.evaluation import hostmem
from jaxlong.generation.chunked import ChunkedPrefill, chunk_kv_steps
from jaxlong.models import llama

TINY = ["model.layers=2", "model.hidden=64", "model.heads=4", "model.kv_heads=2", "model.head_dim=16",
        "model.mlp_hidden=128", "model.vocab_size=257", "attention.block_q=256", "attention.block_k=256",
        "seq_len=1024", "global_batch=1", "mesh.num_devices=4", "mesh.fsdp=1", "mesh.context=4"]


def vm_hwm() -> int:
    """This process's peak resident memory (bytes)."""
    with open("/proc/self/status") as f:
        return 1024 * int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1))


def main(n: int, chunk: int) -> dict:
    """The estimate and the measured peak of the last chunk of an `n`-token prefill in chunks of `chunk` tokens
    (the process's peak, which includes the estimate's ahead-of-time compile, as the eval command's does).

    Raises:
      ValueError: `n` not a multiple of `chunk`."""
    if chunk <= 0 or n % chunk:
        raise ValueError(f"{n} tokens in chunks of {chunk}: the length must be a multiple of the chunk")
    cfg = load_config(None, [*TINY, f"prefill_chunk={chunk}"])
    mesh = build_mesh(cfg.mesh, jax.devices()[:cfg.mesh.num_devices])
    params = llama.init_params(cfg.model, mesh, cfg.seed, cfg.param_dtype)
    t0 = time.perf_counter()
    est, _ = hostmem.prefill_estimate(cfg, mesh, n, 1, 2)
    estimated_s = time.perf_counter() - t0
    pre = ChunkedPrefill(cfg, mesh, chunk, 2)
    step, m, j = pre.step_for(n), cfg.model, n // chunk - 1
    cache = tuple(jax.jit(lambda a=a: jnp.zeros(a.shape, a.dtype), out_shardings=a.sharding)()
                  for a in pre.stacks(1, n))
    logits = jax.device_put(np.zeros((1, m.vocab_size), np.float32), NamedSharding(mesh, P(BATCH_AXES, None)))
    ids = NamedSharding(mesh, P(BATCH_AXES, SEQ_AXES))
    pos = np.arange(j * chunk, n, dtype=np.int32)[None]
    part = {"inputs": jax.device_put(pos % 250, ids), "positions": jax.device_put(pos, ids),
            "segment_ids": jax.device_put(np.ones_like(pos), ids)}
    last = jax.device_put(np.array([n - 1], np.int32), NamedSharding(mesh, P(BATCH_AXES)))
    t0 = time.perf_counter()
    compiled = step.lower(params, cache, part, np.int32(j), last, logits).compile()
    compile_s, t0 = time.perf_counter() - t0, time.perf_counter()
    logits, cache = compiled(params, cache, part, np.int32(j), last, logits)
    jax.block_until_ready(logits)
    return {"tokens": n, "chunk": chunk, "chunks": n // chunk, "devices": est.devices,
            "kv_iterations_per_device_and_layer": chunk_kv_steps(cfg, chunk, est.devices, n),
            "estimate_gib": est.total / 2**30, "estimate_loop_gib": est.loop / 2**30,
            "estimate_per_device_gib": est.per_device / 2**30, "peak_gib": vm_hwm() / 2**30,
            "peak_over_estimate": vm_hwm() / est.total, "estimate_s": round(estimated_s, 1),
            "compile_s": round(compile_s, 1), "last_chunk_s": round(time.perf_counter() - t0, 1)}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), int(sys.argv[2]))))
