"""Host memory of the forward-only programs (the per-token stats of passkey and RULER, generation's prefill and
decode step) where the devices are the host's own CPU: every simulated device's buffers live in one process.

    peak RSS ~= rss_now
               + devices x (arguments + outputs - aliased + temporaries)       compiled memory_analysis, per device
               + KV_STEP_BYTES x layers x devices x kv_steps(cfg, length)      XLA:CPU with devices > 1 (below)
               + host arrays                                                   cases and one batch, int32

XLA:CPU with more than one host device holds about 5.5 KiB for each executed iteration of the blockwise
attention's kv loop until the program returns (measured on jax/jaxlib 0.10.2: malloc's in-use bytes grow linearly
through the run and come back when it ends; on one device they do not grow). The causal blockwise kernel runs
`n (n + 1) / 2` kv steps per device and layer (n = length / block, heads batched in a step), so this term grows
with the square of the length and dominates from about 64K tokens on 4 simulated devices. The chunked prefill's
loop (`jaxlong.generation.chunked`, `prefill_chunk`) holds about 38 KiB per iteration (`CHUNK_STEP_BYTES`), and
only for one chunk's program at a time: its longest chunk runs `chunk / block_q x (length / devices) / block_k`
iterations per device and layer, so chunks bound this term where the whole-prompt forward's grows with the
square of the length.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from typing import Callable

import jax
import jax.numpy as jnp

from jaxlong.config import ConfigError
from jaxlong.core.mesh import seq_shards
from jaxlong.core.units import fmt_bytes
from jaxlong.core.batch import batch_sharding
from jaxlong.evaluation.steps import make_token_stats_step
from jaxlong.generation.chunked import ChunkedPrefill, chunk_kv_steps
from jaxlong.generation.decode import make_prefill
from jaxlong.training import step as step_lib

KV_STEP_BYTES = 5632  # measured: 5.2-6.3 KiB per kv step at 32K-128K tokens, 4 simulated devices, block 256
CHUNK_STEP_BYTES = 38 * 1024  # measured: 34-44 KiB per iteration, 32K-64K tokens in chunks of 4K-16K, 4 devices
# The measured peaks were 0.93-1.10 times the estimate (32K-128K, 1 and 4 devices, whole and in chunks;
# experiments/results/host_memory_ruler_cpu.md): the guard refuses a length whose estimate, raised by this share,
# exceeds the host's memory, so that what it passes stays within what it predicts.
ESTIMATE_ERROR = 0.15


def rss_bytes() -> int:
    """This process's resident set now (Linux; 0 elsewhere)."""
    try:
        return 1024 * int(re.search(r"VmRSS:\s+(\d+)", open("/proc/self/status").read()).group(1))
    except (OSError, AttributeError):
        return 0


def host_devices(mesh) -> int:
    """Devices of `mesh` whose memory is this process's host memory: its CPU devices (0 on GPUs)."""
    return sum(1 for d in mesh.devices.flat if d.platform == "cpu" and d.process_index == jax.process_index())


def kv_steps(cfg, length: int) -> int:
    """Iterations of the causal blockwise kernel's kv loop per device and layer (Ulysses; U-Pipe runs it once per
    stage; under ring attention each of the ring's steps runs a share of it: not measured, counted as Ulysses)."""
    bq, bk = min(cfg.attention.block_q, length), min(cfg.attention.block_k, length)
    nq, nk = length // bq, length // bk
    steps = sum(min(nk, -(-((i + 1) * bq) // bk)) for i in range(nq))
    if cfg.attention.impl == "upipe" and cfg.attention.heads_per_stage:
        steps *= max(cfg.model.heads // cfg.attention.heads_per_stage, 1)
    return steps


@dataclass(frozen=True)
class HostBytes:
    """One program's host-memory estimate (bytes): `per_device` (memory_analysis: arguments + outputs - aliased +
    temporaries), `devices` (that share this host), `loop` (the XLA:CPU kv-step term), `host` (numpy arrays) and
    `base` (the process's RSS when estimated); `total` their sum, the expected peak RSS."""

    per_device: int
    devices: int
    loop: int
    host: int
    base: int
    steps: int = 0  # the kv loop's iterations per device and layer behind `loop`

    @property
    def total(self) -> int:
        return self.base + self.devices * self.per_device + self.loop + self.host


def estimate(cfg, mesh, compiled, length: int, *, host_arrays: int = 0, steps: int | None = None,
             step_bytes: int = KV_STEP_BYTES) -> HostBytes:
    """The expected peak RSS of running `compiled` (a forward over `length` tokens on `mesh`; `steps` its kv loop's
    iterations per device and layer, default `kv_steps`, each holding `step_bytes`)."""
    d = host_devices(mesh)
    steps = kv_steps(cfg, length) if steps is None else steps
    ma = compiled.memory_analysis()
    per_device = ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes + ma.temp_size_in_bytes
    loop = step_bytes * cfg.model.layers * d * steps if d > 1 else 0
    return HostBytes(per_device, d, loop, host_arrays, rss_bytes(), steps)


def loop_term(cfg, mesh, length: int, generation: bool) -> tuple[int, int]:
    """(kv loop iterations per device and layer, bytes XLA:CPU holds per iteration) of the forward over `length`
    tokens: the whole prompt's blockwise kernel, or by generation with `prefill_chunk` below the length the
    longest chunk's loop (`jaxlong.generation.chunked`)."""
    if generation and 0 < cfg.prefill_chunk < length:
        n = -(-length // cfg.prefill_chunk) * cfg.prefill_chunk
        return chunk_kv_steps(cfg, cfg.prefill_chunk, seq_shards(mesh), n), CHUNK_STEP_BYTES
    return kv_steps(cfg, length), KV_STEP_BYTES


def stats_estimate(cfg, mesh, length: int, batch: int, *, cases: int = 0) -> tuple[HostBytes, object]:
    """`estimate` of the per-token stats program (`jaxlong.evaluation.steps.make_token_stats_step`) for `batch`
    rows of `length` tokens, compiled ahead of time (nothing allocated); returns it with the compiled program (to
    reuse). `cases`: RULER cases held on the host meanwhile (int32 tokens, `length + 1` each)."""
    c = replace(cfg, seq_len=int(length))
    params = step_lib.abstract_params(c, mesh)
    compiled = make_token_stats_step(c, mesh).lower(params, step_lib.abstract_batch(c, mesh, batch)).compile()
    host = 4 * (length + 1) * cases + 5 * 4 * length * batch  # the cases, one passkey_batch
    return estimate(c, mesh, compiled, length, host_arrays=host), compiled


def host_limit() -> int:
    """This host's memory available to the process: physical memory, or the cgroup's limit when lower."""
    limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for f in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            v = open(f).read().strip()
            if v.isdigit():
                limit = min(limit, int(v))
        except OSError:
            pass
    return limit


def prefill_estimate(cfg, mesh, length: int, rows: int, max_new: int) -> tuple[HostBytes, object]:
    """`estimate` of generation's prefill (`jaxlong.generation.decode.make_prefill`) of `rows` prompts padded to
    `length` tokens with room for `max_new` new ones, compiled ahead of time; returns it with the compiled program.
    Its outputs are the KV cache, which stays resident through the decode steps (each adds only its temporaries, a
    few percent of the cache)."""
    c = replace(cfg, seq_len=int(length))
    params = step_lib.abstract_params(c, mesh)
    if 0 < cfg.prefill_chunk < length:  # chunk by chunk: one chunk step's program, the cache among its arguments
        n = -(-length // cfg.prefill_chunk) * cfg.prefill_chunk
        chunked = ChunkedPrefill(c, mesh, cfg.prefill_chunk, max_new)
        compiled = chunked.step_for(n).lower(params, *chunked.abstract_args(rows, n)).compile()
        steps, step_bytes = loop_term(cfg, mesh, length, generation=True)
        return estimate(c, mesh, compiled, length, host_arrays=3 * 4 * n * rows, steps=steps,
                        step_bytes=step_bytes), compiled
    sh = batch_sharding(mesh)
    batch = {k: jax.ShapeDtypeStruct((rows, length), jnp.int32, sharding=sh)
             for k in ("inputs", "positions", "segment_ids")}
    compiled = make_prefill(c, mesh, max_new).lower(params, batch).compile()
    return estimate(c, mesh, compiled, length, host_arrays=3 * 4 * length * rows), compiled


LONG = 1 << 16  # from this many tokens the estimate compiles the programs; below, the cheap terms decide


def check_lengths(cfg, mesh, lengths, *, rows: int | Callable[[int], int], max_new: int | None = None,
                  cases: int = 0, option: str = "--ruler-lengths", limit: int | None = None) -> dict:
    """Refuse, in one line naming every length, the lengths whose forward (`prefill_estimate` with `max_new`,
    else `stats_estimate`) would not fit this host's memory (`host_limit`, or `limit`) with a margin for the
    estimate's error (`ESTIMATE_ERROR`: the estimate times 1.15 must fit); a no-op when no device of `mesh` is this
    host's CPU. A length below `LONG` tokens whose XLA:CPU loop term is under a tenth of the limit is not compiled
    for (its programs are small). Returns {length: HostBytes} of the lengths estimated.

    Args:
      rows: prompts per forward, or a function of the length giving them (generation's `rows_per_batch`).

    Raises:
      ConfigError: `<option> <length>: ...` with the estimate's parts and, with several CPU devices, what one
        device would need (the same scores: the results equal one device's on every mesh).
    """
    if not host_devices(mesh):
        return {}
    limit = limit or host_limit()
    out, errors = {}, []
    for n in sorted(set(int(x) for x in lengths)):
        r = rows(n) if callable(rows) else rows
        steps, step_bytes = loop_term(cfg, mesh, n, generation=bool(max_new))
        loop = step_bytes * cfg.model.layers * host_devices(mesh) * steps if host_devices(mesh) > 1 else 0
        if n < LONG and loop < limit // 10:
            continue
        est = (prefill_estimate(cfg, mesh, n, r, max_new) if max_new else
               stats_estimate(cfg, mesh, n, r, cases=cases))[0]
        out[n] = est
        bound = est.total * (1 + ESTIMATE_ERROR)
        if bound <= limit:
            continue
        one = est.base + est.devices * est.per_device + est.host  # one CPU device: no loop term
        hint = (f"; mesh.num_devices=1 (the same scores) needs about {fmt_bytes(one)}"
                if est.loop and one * (1 + ESTIMATE_ERROR) <= limit else "")
        errors.append(f"{option} {n}: the forward needs about {fmt_bytes(est.total)} of host memory, up to "
                      f"{fmt_bytes(bound)} with a {ESTIMATE_ERROR:.0%} margin for "
                      f"the estimate's error ({est.devices} CPU device(s) x {fmt_bytes(est.per_device)} "
                      f"compiled, {fmt_bytes(est.loop)} held by XLA:CPU over the attention's {est.steps:,} kv steps "
                      f"per device and layer, {fmt_bytes(est.base)} in use) and this host has "
                      f"{fmt_bytes(limit)}{hint}")
    if errors:
        raise ConfigError("; ".join(errors), key=option)
    return out
