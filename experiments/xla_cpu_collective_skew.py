"""XLA:CPU aborts a process whose simulated devices reach one collective a minute apart (a warning after 20 s of
waiting, the abort 40 s later); the flags a jaxlong launch sets on the CPU
(`jaxlong.core.distributed.PATIENT_CPU_COLLECTIVES`) let it finish.

    python experiments/xla_cpu_collective_skew.py 90             # XLA's defaults: aborts after 60 s of waiting
    python experiments/xla_cpu_collective_skew.py 90 --patient   # as `python -m jaxlong.*` launches: completes

Two simulated CPU devices in `jax.shard_map`: device 0 multiplies matrices for about SECONDS seconds (timed
beforehand) while device 1 goes straight to a `psum`, where its thread waits for device 0's. This is what a long
prompt's attention does on simulated devices that share a few cores, when the OS runs some device threads before
the others (`experiments/results/host_memory_ruler_cpu.md`, "At 1M").
"""

from __future__ import annotations

import os
import sys
import time

SECONDS = float(sys.argv[1]) if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else 90.0
PATIENT = "--patient" in sys.argv
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if PATIENT:
    from jaxlong.core.distributed import set_host_device_count

    set_host_device_count(2)  # adds PATIENT_CPU_COLLECTIVES, as every jaxlong command does before jax starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

N = 512


def spin(a, steps):
    """`steps` products of an `[N, N]` matrix with itself, normalized (seconds of one core's work)."""
    return jax.lax.fori_loop(0, steps, lambda _, x: jnp.tanh(x @ x / N), a)


def main() -> None:
    print(f"XLA_FLAGS={os.environ['XLA_FLAGS']}", flush=True)
    a = jnp.ones((N, N), jnp.float32) * 0.01
    one = jax.jit(spin, static_argnums=1)
    one(a, 20).block_until_ready()
    t0 = time.perf_counter()
    one(a, 200).block_until_ready()
    steps = max(1, int(SECONDS / ((time.perf_counter() - t0) / 200)))

    mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))

    def body(x):
        slow = jax.lax.axis_index("d") == 0
        x = jax.lax.cond(slow, lambda y: spin(y[0], steps)[None], lambda y: y, x)
        return jax.lax.psum(x, "d")  # device 1 waits here for device 0

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P(), check_vma=False))
    x = jax.device_put(jnp.broadcast_to(a, (2, N, N)), NamedSharding(mesh, P("d")))
    t0 = time.perf_counter()
    f(x).block_until_ready()
    print(f"device 0 reached the psum {time.perf_counter() - t0:.0f} s after device 1 ({steps} products); "
          f"the program completed", flush=True)


if __name__ == "__main__":
    main()
