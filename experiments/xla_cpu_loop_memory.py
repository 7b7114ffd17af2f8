"""XLA:CPU holds host memory for every executed iteration of the blockwise attention's kv loop while the program
runs, when the process has more than one CPU device: the term `jaxlong.evaluation.hostmem.KV_STEP_BYTES` counts.

    python experiments/xla_cpu_loop_memory.py 65536 4      # causal blockwise attention, 4 simulated devices
    python experiments/xla_cpu_loop_memory.py 65536 1      # the same on one device: no growth

One head of `seq` tokens per device (head_dim 64, blocks 256) in `jax.shard_map`; the program is compiled, run
once to warm up, then run again while the resident set is sampled. It prints the compiled memory analysis, the
kv steps per device, the resident-set growth over the timed run and the bytes per kv step and device.
"""

from __future__ import annotations

import os
import sys
import threading
import time

SEQ = int(sys.argv[1]) if len(sys.argv) > 1 else 65536
DEVICES = int(sys.argv[2]) if len(sys.argv) > 2 else 4
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxlong.kernels.blockwise import blockwise_attention_fwd  # noqa: E402


def rss() -> int:
    with open("/proc/self/status") as f:
        return 1024 * int(next(line for line in f if line.startswith("VmRSS")).split()[1])


def main() -> None:
    mesh = jax.make_mesh((DEVICES,), ("d",))
    q = jax.device_put(jnp.full((DEVICES, SEQ, 1, 64), 0.01), NamedSharding(mesh, P("d")))
    attend = jax.jit(jax.shard_map(lambda x: blockwise_attention_fwd(x, x, x, causal=True, block_q=256,
                                                                     block_k=256)[0],
                                   mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    compiled = attend.lower(q).compile()
    ma = compiled.memory_analysis()
    print(f"compiled per device: arguments {ma.argument_size_in_bytes / 2**20:.1f} MiB, outputs "
          f"{ma.output_size_in_bytes / 2**20:.1f} MiB, temporaries {ma.temp_size_in_bytes / 2**20:.1f} MiB")
    jax.block_until_ready(compiled(q))
    peak, done = [rss()], threading.Event()

    def sample():
        while not done.is_set():
            peak.append(rss())
            time.sleep(0.1)

    before = rss()
    t = threading.Thread(target=sample)
    t.start()
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(q))
    done.set()
    t.join()
    n = SEQ // 256
    steps = n * (n + 1) // 2
    grow = max(peak) - before
    print(f"{DEVICES} device(s), {SEQ} tokens: {steps:,} kv steps per device; resident set {before / 2**30:.2f} GiB "
          f"before, peak {max(peak) / 2**30:.2f} GiB ({grow / 2**20:+.0f} MiB) in {time.perf_counter() - t0:.1f} s: "
          f"{grow / max(steps * DEVICES, 1):.0f} bytes per kv step and device")


if __name__ == "__main__":
    main()
