"""The device check: one script to run when a GPU is lent (one H200, a few minutes of device time).

    PYTHONPATH=. python experiments/gpu_check.py                  # on the GPU machine, < 8 minutes
    PYTHONPATH=. python experiments/gpu_check.py --smoke --out /tmp/gc   # the same code path on the CPU, < 1 min

Sections (each in its own subprocess, so a crash, an out-of-memory or a hang costs one row, not the run; the
parent never touches the GPU, and every child starts with a clean `peak_bytes_in_use`):
  kernel  the GPU attention backend (cuDNN, `jaxlong.kernels.cudnn`) against the blockwise kernel: forward,
          lse and gradients (dq, dk, dv) in bf16, causal and not, GQA, head_dim 64 and 128, an uneven length,
          both against a float32 blockwise run; the cuDNN backward fed the blockwise kernel's (out, lse) (the
          statistic's convention); segment ids (cuDNN: a clear error expected; a backend with segment ids:
          compared with attention run per document); the Pallas kernel with segment ids
          (`jaxlong.kernels.pallas_gpu`, what `auto` runs for packed documents) against the blockwise kernel,
          forward, lse and gradients, both against float32 blockwise; and a large-tensor probe: a cuDNN call on
          tensors of more than 2**31 elements compared head by head with small calls (does `MAX_ELEMENTS` need
          to stay?).
  window  rows of the kernel table, in their own child: a sliding window (Gemma 3's local layers, window 1,024
          over 4,096 tokens, 4 query heads over 1 KV head, head_dim 256; docs/windows.md) on cuDNN without
          documents and on the Pallas kernel with documents, against the windowed blockwise kernel in bf16,
          forward, lse and gradients, both against float32 blockwise.
  generate  a tiny Gemma 3 (a local and a global layer, window 8) generating greedily from prompts up to 4 windows
          long: the logits of the prefill and of every cached decode step against one whole forward of each
          row's prompt and generated tokens (the full recompute), in float32 (the blockwise kernel) and in
          bfloat16 (on a GPU the kernels `auto` picks: the prefill, with its padding's segment ids, on Pallas; the
          whole forward on cuDNN), with a float32 reference-attention forward as the truth.
  train   Llama-3.2-1B shapes on one GPU (mesh.context=1): Ulysses (C = 1) and U-Pipe at several U, a few steps
          at 64K (all 16 layers), 256K and a long length (fewer layers, so a step fits the time budget; the
          layer count is in the table): tokens/s, MFU (flops_per_token, dense bf16 peak) and
          `memory_stats()["peak_bytes_in_use"]`; one run also writes a jax.profiler trace of two steps.
  plan    the same configs compiled deviceless for the h200 target (`jaxlong.plan`, 1 device), started at the
          beginning on the CPU cores in parallel with the GPU work: plan peak and total beside the measured peak.

A global time guard (`--budget-s`, default 450 s) skips what would not finish in time (the skip is recorded,
with the estimate), children get timeouts, and `gpu_check.md`, `gpu_check.csv` (one row per train config,
with the plan columns) and `gpu_check.json` (everything) in `--out` (default experiments/results; runs/gpu_check_smoke with --smoke) are
rewritten after every section. In `--smoke` mode the shapes are tiny, the candidate kernel is the blockwise
one (compared with the reference kernel), and the plan uses the h200 target if the CUDA plugin is installed,
else the CPU approximation.
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing (`python experiments/gpu_check.py`)
GiB = 1024**3

# --------------------------------------------------------------------------------------------- run matrix


def train_specs(smoke: bool) -> list[dict]:
    """The train configs in priority order (the time guard drops from the end): Ulysses and U-Pipe side by side
    at each length first, then U-Pipe at other U, then the long length."""
    if smoke:
        return _named([dict(seq_len=256, layers=1, impl="ulysses", u=None),
                       dict(seq_len=256, layers=1, impl="upipe", u=4, profile=True)])
    short, mid, long = (65536, 16), (262144, 4), (1048576, 1)
    specs = [dict(seq_len=s, layers=layers, impl=impl, u=u) for (s, layers) in (short, mid)
             for impl, u in (("ulysses", None), ("upipe", 4))]
    specs[1]["profile"] = True  # U-Pipe at 64K
    specs += [dict(seq_len=s, layers=layers, impl="upipe", u=16) for (s, layers) in (short, mid)]
    specs += [dict(seq_len=long[0], layers=long[1], impl="upipe", u=4, steps=2),
              dict(seq_len=long[0], layers=long[1], impl="ulysses", u=None, steps=2)]
    return _named(specs)


def _named(specs: list[dict]) -> list[dict]:
    for sp in specs:
        sp["name"] = f"{sp['impl']}{'' if sp['u'] is None else ' U=' + str(sp['u'])} S={sp['seq_len']:,} L={sp['layers']}"
    return specs


def overrides(spec: dict, smoke: bool) -> list[str]:
    base = ["mesh.data=1", "mesh.fsdp=1", "mesh.context=1", "mesh.num_devices=1", "global_batch=1",
            "remat.policy=full", "tiling.loss=true", "tiling.mlp=true", "compute_dtype=bfloat16",
            f"seq_len={spec['seq_len']}", f"model.layers={spec['layers']}", f"attention.impl={spec['impl']}"]
    if spec["u"] is not None:
        base.append(f"attention.heads_per_stage={spec['u']}")
    if smoke:
        base += ["model.vocab_size=256", "model.hidden=64", "model.heads=8", "model.kv_heads=4", "model.head_dim=16",
                 "model.mlp_hidden=128", "attention.block_q=128", "attention.block_k=128", "attention.backend=auto"]
    return base


CONFIG = "configs/llama3_2_1b.yaml"

# ------------------------------------------------------------------------------------------------ children


def _np_inputs(shape, seed, dtype):
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32), dtype)


def child_kernel(smoke: bool, large: bool) -> list[dict]:
    """Compare the GPU backend (smoke: blockwise) with the baseline (smoke: reference); rows of max errors."""
    import inspect  # noqa: PLC0415

    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from jaxlong.kernels import backend as B  # noqa: PLC0415
    from jaxlong.kernels import blockwise as K  # noqa: PLC0415

    jax.config.update("jax_default_matmul_precision", "highest")  # the float32 truth without TF32
    gpu = jax.default_backend() == "gpu"
    cand, base = ("cudnn", "blockwise") if gpu else ("blockwise", "reference")
    cases = ([(1, 4096, 8, 2, 128, True), (2, 2048, 8, 8, 64, True), (1, 4096, 16, 4, 64, False),
              (1, 1000, 8, 2, 128, True)] if not smoke else
             [(1, 128, 4, 2, 16, True)])
    rows = []
    for b, s, h, kv, d, causal in cases:
        name = f"b={b} S={s} H={h} KV={kv} d={d} {'causal' if causal else 'full'}"
        try:
            blk = min(512, s) if s % min(512, s) == 0 else 200
            q, k, v, do = (_np_inputs((b, s, n, d), i, jnp.bfloat16) for i, n in enumerate((h, kv, kv, h)))

            def run(backend, q, k, v, do, out_lse=None):
                kw = dict(backend=backend, causal=causal, block_q=blk, block_k=blk)
                out, lse = jax.jit(lambda q, k, v: B.attention_fwd_with_lse(q, k, v, **kw))(q, k, v)
                o, l_ = out_lse or (out, lse)
                grads = jax.jit(lambda *a: B.attention_bwd(*a, **kw))(q, k, v, o, l_, do)
                return [x.astype(jnp.float32) for x in (out, lse, *grads)]

            f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
            truth = run("blockwise" if gpu else "reference", *f32)
            got, ref = run(cand, q, k, v, do), run(base, q, k, v, do)
            row = {"case": name, "candidate": cand, "baseline": base}
            ok = True
            for j, t in enumerate(("out", "lse", "dq", "dk", "dv")):
                scale = 1.0 if t == "lse" else float(jnp.max(jnp.abs(truth[j]))) + 1e-6
                e_c = float(jnp.max(jnp.abs(got[j] - truth[j]))) / scale
                e_b = float(jnp.max(jnp.abs(ref[j] - truth[j]))) / scale
                row[f"{t}_err"], row[f"{t}_err_baseline"] = e_c, e_b
                ok &= e_c <= max(2 * e_b, 2e-2)  # bf16: within 2% of the largest value, or the baseline's error x2
            if gpu:  # cuDNN backward from the blockwise kernel's (out, lse): same statistic convention
                base_out = jax.jit(lambda q, k, v: B.attention_fwd_with_lse(
                    q, k, v, backend=base, causal=causal, block_q=blk, block_k=blk))(q, k, v)
                cross = run(cand, q, k, v, do, out_lse=base_out)
                scale = float(jnp.max(jnp.abs(truth[2]))) + 1e-6
                row["dq_err_cudnn_bwd_from_blockwise_lse"] = float(jnp.max(jnp.abs(cross[2] - truth[2]))) / scale
                ok &= row["dq_err_cudnn_bwd_from_blockwise_lse"] <= max(2 * row["dq_err_baseline"], 2e-2)
            row["pass"] = bool(ok)
        except Exception as e:  # noqa: BLE001
            row = {"case": name, "candidate": cand, "pass": False, "error": f"{type(e).__name__}: {e}"[:400]}
        rows.append(row)
    for backend in dict.fromkeys((cand, "blockwise")):  # the GPU backend, and the blockwise one where it differs
        rows.append(_segment_row(K, backend, smoke, inspect))
    rows.append(_pallas_row(K, smoke, gpu))
    for backend in ((cand, "pallas") if gpu else ("blockwise", "pallas")):
        rows.append(_ring_row(K, backend, smoke, gpu))
    if large and gpu:
        rows.append(_large_tensor_row())
    return rows


def _segment_row(K, cand, smoke, inspect) -> dict:
    """Segment ids: cuDNN must refuse them clearly; a backend that has them must match attention per document."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from jaxlong.kernels import backend as B  # noqa: PLC0415

    row = {"case": "segment ids", "candidate": cand}
    if "segment_ids" not in inspect.signature(B.attention_fwd_with_lse).parameters:
        return {**row, "pass": True, "note": "attention_fwd_with_lse has no segment_ids argument in this build"}
    s, d = (128, 16) if smoke else (2048, 128)
    q, k, v = (_np_inputs((1, s, n, d), i, jnp.bfloat16) for i, n in enumerate((4, 2, 2)))
    seg = jnp.asarray([0] * (s // 4) + [1] * (s // 2) + [2] * (s - s // 4 - s // 2), jnp.int32)[None]
    try:
        out, _ = jax.jit(lambda q, k, v, g: B.attention_fwd_with_lse(q, k, v, backend=cand, segment_ids=g,
                                                                    block_q=s // 8, block_k=s // 8))(q, k, v, seg)
    except Exception as e:  # noqa: BLE001
        expected = cand == "cudnn" and "segment" in str(e)
        return {**row, "pass": expected, "note": f"{'expected: ' if expected else ''}{type(e).__name__}: {e}"[:300]}
    bounds = [0, s // 4, s // 4 + s // 2, s]
    parts = [B.attention_fwd_with_lse(q[:, a:b], k[:, a:b], v[:, a:b], backend="reference")[0]
             for a, b in zip(bounds, bounds[1:])]
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - jnp.concatenate(parts, 1).astype(jnp.float32))))
    return {**row, "out_err": err, "pass": err <= 3e-2}


def _errors(row: dict, got, ref, truth) -> bool:
    """Max errors of (out, lse, dq, dk, dv) of the candidate (`got`) and the baseline (`ref`) against `truth`,
    relative to the largest true value (lse: absolute), into `row`; whether the candidate is within twice the
    baseline's error or 2% (bf16)."""
    import jax.numpy as jnp  # noqa: PLC0415

    ok = True
    for j, t in enumerate(("out", "lse", "dq", "dk", "dv")):
        scale = 1.0 if t == "lse" else float(jnp.max(jnp.abs(truth[j]))) + 1e-6
        row[f"{t}_err"] = float(jnp.max(jnp.abs(got[j] - truth[j]))) / scale
        row[f"{t}_err_baseline"] = float(jnp.max(jnp.abs(ref[j] - truth[j]))) / scale
        ok &= row[f"{t}_err"] <= max(2 * row[f"{t}_err_baseline"], 2e-2)
    return bool(ok)


def _pallas_row(K, smoke: bool, gpu: bool) -> dict:
    """The Pallas kernel with segment ids (what `attention.backend=auto` runs for packed documents on GPUs)
    against the blockwise kernel, both bf16, errors relative to a float32 blockwise run: forward, lse and the
    backward from each kernel's own (out, lse). GQA, three documents cut through tiles, trailing padding.
    Smoke: Pallas' interpreter on the CPU at tiny shapes."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    try:
        from jaxlong.kernels import pallas_gpu as PG  # noqa: PLC0415
    except ImportError as e:
        return {"case": "pallas segment ids", "candidate": "pallas", "pass": False, "error": str(e)[:300]}
    b, s, h, kv, d = (1, 64, 4, 2, 16) if smoke else (2, 4096, 16, 4, 128)
    name = f"pallas segment ids b={b} S={s} H={h} KV={kv} d={d}"
    row = {"case": name, "candidate": "pallas", "baseline": "blockwise"}
    lens = [s * 3 // 16, s * 7 // 16, s // 4]
    seg = jnp.asarray(sum(([i + 1] * n for i, n in enumerate(lens)), []) + [0] * (s - sum(lens)), jnp.int32)
    seg = jnp.broadcast_to(seg[None], (b, s))
    blk = 16 if smoke else 512
    try:
        q, k, v, do = (_np_inputs((b, s, n, d), i, jnp.bfloat16) for i, n in enumerate((h, kv, kv, h)))

        def run(fwd, bwd, q, k, v, do):
            out, lse = jax.jit(lambda q, k, v, g: fwd(q, k, v, segment_ids=g))(q, k, v, seg)
            grads = jax.jit(lambda *a: bwd(*a, segment_ids=seg))(q, k, v, out, lse, do)
            return [x.astype(jnp.float32) for x in (out, lse, *grads)]

        pf = functools.partial(PG.pallas_attention_fwd, interpret=not gpu)
        pb = functools.partial(PG.pallas_attention_bwd, interpret=not gpu)
        bf = functools.partial(K.blockwise_attention_fwd, block_q=blk, block_k=blk)
        bb = functools.partial(K.blockwise_attention_bwd, block_q=blk, block_k=blk)
        truth = run(bf, bb, *(x.astype(jnp.float32) for x in (q, k, v, do)))
        got, ref = run(pf, pb, q, k, v, do), run(bf, bb, q, k, v, do)
        row["pass"] = _errors(row, got, ref, truth)
    except Exception as e:  # noqa: BLE001
        row.update({"pass": False, "error": f"{type(e).__name__}: {e}"[:400]})
    return row


def child_window(smoke: bool) -> list[dict]:
    """The sliding-window rows of the kernel table (their own child, so that their compiles cannot push the kernel
    section past its timeout): the GPU backend (smoke: blockwise) and the Pallas kernel with documents."""
    import jax  # noqa: PLC0415

    jax.config.update("jax_default_matmul_precision", "highest")  # the float32 truth without TF32
    gpu = jax.default_backend() == "gpu"
    return [_window_row(backend, smoke, gpu) for backend in ("cudnn" if gpu else "blockwise", "pallas")]


def _window_row(backend: str, smoke: bool, gpu: bool) -> dict:
    """A sliding window (query t sees keys t - W + 1 .. t) on `backend` against the windowed blockwise kernel, both
    bf16, errors relative to a float32 blockwise run: forward, lse and the backward from each kernel's own (out, lse)
    (the backward that `attention(window=)`'s custom_vjp runs).
    Gemma 3's heads (4 query heads over 1 KV head, head_dim 256 on the GPU); cuDNN without documents, the Pallas
    kernel with three documents cut through tiles and trailing padding. Smoke: the blockwise kernel and Pallas'
    interpreter against the reference kernel (float32 reference as the truth) at tiny shapes."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from jaxlong.kernels import backend as B  # noqa: PLC0415
    from jaxlong.kernels import pallas_gpu as PG  # noqa: PLC0415

    b, s, h, kv, d, window = (1, 64, 4, 1, 16, 20) if smoke else (1, 4096, 4, 1, 256, 1024)
    docs = backend == "pallas"
    name = f"window {window}{' + documents' if docs else ''} b={b} S={s} H={h} KV={kv} d={d}"
    base = "blockwise" if gpu else "reference"
    row = {"case": name, "candidate": backend, "baseline": base}
    blk = 16 if smoke else 512
    seg = None
    if docs:
        lens = [s * 3 // 16, s * 7 // 16, s // 4]
        seg = jnp.asarray(sum(([i + 1] * n for i, n in enumerate(lens)), []) + [0] * (s - sum(lens)), jnp.int32)[None]
    try:
        q, k, v, do = (_np_inputs((b, s, n, d), i, jnp.bfloat16) for i, n in enumerate((h, kv, kv, h)))

        def run(fwd, bwd, q, k, v, do):
            out, lse = jax.jit(lambda q, k, v: fwd(q, k, v, segment_ids=seg, window=window))(q, k, v)
            grads = jax.jit(lambda *a: bwd(*a, segment_ids=seg, window=window))(q, k, v, out, lse, do)
            return [x.astype(jnp.float32) for x in (out, lse, *grads)]

        def kernel(name):
            if name == "pallas":
                return (functools.partial(PG.pallas_attention_fwd, interpret=not gpu),
                        functools.partial(PG.pallas_attention_bwd, interpret=not gpu))
            kw = dict(backend=name, block_q=blk, block_k=blk)
            return functools.partial(B.attention_fwd_with_lse, **kw), functools.partial(B.attention_bwd, **kw)

        truth = run(*kernel(base), *(x.astype(jnp.float32) for x in (q, k, v, do)))
        got, ref = run(*kernel(backend), q, k, v, do), run(*kernel(base), q, k, v, do)
        row["pass"] = _errors(row, got, ref, truth)
    except Exception as e:  # noqa: BLE001
        row.update({"pass": False, "error": f"{type(e).__name__}: {e}"[:400]})
    return row


def _ring_row(K, backend: str, smoke: bool, gpu: bool) -> dict:
    """Ring attention's block kernel (`jaxlong.parallel.ring.BlockKernel`, what a ring step calls) on one device:
    a causal sequence cut in two as ring rank 1 of 2 sees it -- its own half causal, the first half's K/V as one
    unmasked block (with packed documents, `pallas`: the Pallas kernel's `kv_starts` from the run ids) -- merged by
    log-sum-exp, and each block's backward from the *global* (out, lse), summed: forward, lse, dQ, dK, dV against
    one causal call of the float32 blockwise kernel over the whole sequence, with the bf16 blockwise kernel's
    errors as the baseline. Smoke: blockwise, and Pallas' interpreter, at tiny shapes."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from jaxlong.parallel.ring import BlockKernel  # noqa: PLC0415

    b, s, h, kv, d = (1, 64, 4, 2, 16) if smoke else (1, 8192, 16, 4, 128)
    docs = backend == "pallas"
    name = f"ring block kernel{' + documents' if docs else ''} b={b} S={s} H={h} KV={kv} d={d}"
    row = {"case": name, "candidate": backend, "baseline": "blockwise"}
    blk = 16 if smoke else 512
    c = s // 2
    seg = None
    if docs:  # documents across the cut, one wholly in the second half (its queries see no remote key)
        lens = [s * 3 // 8, s // 4, s // 8]
        seg = jnp.asarray(sum(([i + 1] * n for i, n in enumerate(lens)), []) + [0] * (s - sum(lens)), jnp.int32)[None]
        seg = jnp.broadcast_to(seg, (b, s))
    try:
        q, k, v, do = (_np_inputs((b, s, n, d), i, jnp.bfloat16) for i, n in enumerate((h, kv, kv, h)))

        def ring_two(kernel, q, k, v, do):
            runs = None if seg is None else K.segment_starts(seg)
            own = lambda x: x[:, c:]
            ids = (None, None) if runs is None else (runs[:, :c], runs[:, c:])
            o0, l0 = kernel.diagonal_fwd(q[:, :c], k[:, :c], v[:, :c], True, ids[0])  # rank 0's own block
            o1, l1 = kernel.diagonal_fwd(own(q), own(k), own(v), True, ids[1])
            ob, lb = kernel.block_fwd(own(q), k[:, :c], v[:, :c], ids[1], ids[0], (0,))  # the remote block
            lse1 = jnp.logaddexp(l1, lb)
            w = lambda a: jnp.swapaxes(jnp.exp(a - lse1), 1, 2)[..., None]
            o1 = (w(l1) * o1.astype(jnp.float32) + w(lb) * ob.astype(jnp.float32)).astype(q.dtype)
            out, lse = jnp.concatenate([o0, o1], 1), jnp.concatenate([l0, lse1], 2)
            g0 = kernel.diagonal_bwd(q[:, :c], k[:, :c], v[:, :c], out[:, :c], lse[:, :, :c], do[:, :c], True, ids[0])
            g1 = kernel.diagonal_bwd(own(q), own(k), own(v), own(out), lse[:, :, c:], own(do), True, ids[1])
            gb = kernel.block_bwd(own(q), k[:, :c], v[:, :c], own(out), lse[:, :, c:], own(do), ids[1], ids[0],
                                  (0,))
            f = lambda x: x.astype(jnp.float32)
            dq = jnp.concatenate([f(g0[0]), f(g1[0]) + f(gb[0])], 1)
            dk = jnp.concatenate([f(g0[1]) + f(gb[1]), f(g1[1])], 1)
            dv = jnp.concatenate([f(g0[2]) + f(gb[2]), f(g1[2])], 1)
            return [f(out), lse, dq, dk, dv]

        def whole(q, k, v, do):
            out, lse = K.blockwise_attention_fwd(q, k, v, segment_ids=seg, block_q=blk, block_k=blk)
            grads = K.blockwise_attention_bwd(q, k, v, out, lse, do, segment_ids=seg, block_q=blk, block_k=blk)
            return [x.astype(jnp.float32) for x in (out, lse, *grads)]

        kernel = BlockKernel(backend, blk, blk, interpret=backend == "pallas" and not gpu)
        truth = jax.jit(whole)(*(x.astype(jnp.float32) for x in (q, k, v, do)))
        got = jax.jit(lambda *a: ring_two(kernel, *a))(q, k, v, do)
        ref = jax.jit(lambda *a: ring_two(BlockKernel("blockwise", blk, blk), *a))(q, k, v, do)
        row["pass"] = _errors(row, got, ref, truth)
    except Exception as e:  # noqa: BLE001
        row.update({"pass": False, "error": f"{type(e).__name__}: {e}"[:400]})
    return row


def _large_tensor_row(b: int = 1, s: int = 65536, h: int = 264, d: int = 128) -> dict:
    """A cuDNN call on tensors of more than 2**31 elements (by default 2.2e9, 4.4 GB each in bf16) against
    small calls on single heads."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from jaxlong.kernels import cudnn as CU  # noqa: PLC0415

    row = {"case": f"large tensors b={b} S={s} H={h} d={d} ({b * s * h * d:,} elements)", "candidate": "cudnn"}
    saved = CU.MAX_ELEMENTS
    try:
        CU.MAX_ELEMENTS = 2**40
        # Distinct heads (a per-head scale and shift of one random [S, d] block), so that reading another
        # head's memory through a wrapped offset shows; built without drawing 2**31 random numbers.
        scale = jnp.linspace(0.5, 1.5, h, dtype=jnp.float32)[None, None, :, None]
        q, k, v = ((_np_inputs((b, s, 1, d), i, jnp.float32) * scale + 0.01 * i * scale).astype(jnp.bfloat16)
                   for i in range(3))
        out, lse = jax.jit(lambda q, k, v: CU.cudnn_attention_fwd(q, k, v))(q, k, v)
        dq = jax.jit(lambda q, k, v, o, l_: CU.cudnn_attention_bwd(q, k, v, o, l_, o)[0])(q, k, v, out, lse)
        errs = []
        for head in (0, h - 1):  # the last head's last rows lie past 2**31 elements
            sl = slice(head, head + 1)
            o1, l1 = CU.cudnn_attention_fwd(q[:, :, sl], k[:, :, sl], v[:, :, sl])
            d1 = CU.cudnn_attention_bwd(q[:, :, sl], k[:, :, sl], v[:, :, sl], o1, l1, o1)[0]
            errs += [float(jnp.max(jnp.abs(out[:, :, sl].astype(jnp.float32) - o1.astype(jnp.float32)))),
                     float(jnp.max(jnp.abs(dq[:, :, sl].astype(jnp.float32) - d1.astype(jnp.float32))))]
        row.update(out_err=max(errs[0::2]), dq_err=max(errs[1::2]))
        row["pass"] = max(errs) <= 2e-2
        row["note"] = ("cuDNN indexes past 2**31 elements correctly: MAX_ELEMENTS could be raised" if row["pass"]
                       else "wrong results past 2**31 elements: keep MAX_ELEMENTS")
    except Exception as e:  # noqa: BLE001
        row.update({"pass": False, "error": f"{type(e).__name__}: {e}"[:400]})
    finally:
        CU.MAX_ELEMENTS = saved
    return row


# a tiny Gemma 3: a local layer (window 8) and a global one, 4 query heads over 1 KV head (Gemma 3 270M's)
GEMMA_TINY = ["model.family=gemma3", "model.layers=2", "model.sliding_window_pattern=2", "model.sliding_window=8",
              "model.heads=4", "model.kv_heads=1", "model.head_dim=16", "model.hidden=64", "model.mlp_hidden=128",
              "model.vocab_size=257", "model.query_pre_attn_scalar=16", "model.tie_embeddings=true", "seq_len=64",
              "global_batch=4", "attention.block_q=16", "attention.block_k=16", "data.packing=concat",
              "param_dtype=float32", "mesh.data=1", "mesh.fsdp=1", "mesh.context=1", "mesh.num_devices=1"]


def child_generate(smoke: bool) -> list[dict]:
    """Greedy generation of the tiny Gemma 3 against the full recompute, one row per compute dtype (module
    docstring): prompts of 37, 20 and 3 tokens, 6 new tokens each; each step's logits (the prefill's, then each
    cached decode step's) against one whole forward of the row's prompt and generated tokens in the same dtype
    (`err_recompute`), and both against a float32 forward with reference attention (`err`, `err_baseline`), max
    error / max |truth|; whether each generated token is the argmax of the recompute's logits."""
    import dataclasses  # noqa: PLC0415

    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    from jaxlong.config import load_config, runtime  # noqa: PLC0415
    from jaxlong.core.mesh import build_mesh  # noqa: PLC0415
    from jaxlong.data import ByteTokenizer  # noqa: PLC0415
    from jaxlong.generation.generate import Generator  # noqa: PLC0415
    from jaxlong.models import llama as model_lib  # noqa: PLC0415

    prompts = [np.arange(3, 40), np.arange(60, 80), np.array([256, 72, 105])]
    rows, params = [], None
    for dtype in ("float32", "bfloat16"):
        row = {"case": f"generate gemma3 window 8, {dtype}", "dtype": dtype}
        try:
            cfg = load_config(None, [*GEMMA_TINY, f"compute_dtype={dtype}"])
            mesh = build_mesh(cfg.mesh, devices=jax.devices()[:1])
            if params is None:
                params = model_lib.init_params(cfg.model, mesh, 0, cfg.param_dtype)
            rt = runtime(cfg, mesh)
            row["kernels"] = {"prefill": dataclasses.replace(rt, document_masking=True).attention_backend,
                              "recompute": rt.attention_backend}
            steps: list = []
            out = Generator(cfg, mesh, params, ByteTokenizer(), max_new_tokens=6)(prompts, logits=steps)
            seqs = [np.concatenate([p, o.tokens]) for p, o in zip(prompts, out)]
            batch = np.zeros((len(seqs), -(-max(map(len, seqs)) // 16) * 16), np.int32)  # whole tiles
            for r, seq in enumerate(seqs):
                batch[r, :len(seq)] = seq

            def whole(rt_):
                graphdef = model_lib.model_graphdef(cfg.model, cfg.param_dtype)
                hidden, head = jax.jit(lambda p, t: model_lib.forward(graphdef, p, t, rt_))(params, batch)
                return np.asarray(hidden.astype(np.float32) @ head.astype(np.float32))

            recompute = whole(rt)
            truth = whole(dataclasses.replace(rt, compute_dtype=np.float32, attention=dataclasses.replace(
                rt.attention, backend="reference")))
            pick = lambda x: np.stack([x[r, len(p) - 1 + t] for t in range(len(steps))  # noqa: E731
                                       for r, p in enumerate(prompts)])
            got = np.stack([steps[t][r] for t in range(len(steps)) for r in range(len(prompts))])
            scale = float(np.abs(pick(truth)).max()) + 1e-6
            row.update(err=float(np.abs(got - pick(truth)).max()) / scale,
                       err_baseline=float(np.abs(pick(recompute) - pick(truth)).max()) / scale,
                       err_recompute=float(np.abs(got - pick(recompute)).max()) / scale,
                       argmax_agree=float(np.mean([o.tokens[t] == int(np.argmax(recompute[r, len(p) - 1 + t]))
                                                   for r, (p, o) in enumerate(zip(prompts, out))
                                                   for t in range(len(o.tokens))])))
            tol = 1e-4 if dtype == "float32" else max(2 * row["err_baseline"], 3e-2)
            row["pass"] = bool(row["err"] <= tol and row["err_recompute"] <= tol
                               and (row["argmax_agree"] == 1.0 or dtype != "float32"))
        except Exception as e:  # noqa: BLE001
            row.update({"pass": False, "error": f"{type(e).__name__}: {e}"[:400]})
        rows.append(row)
    return rows


def child_train(spec: dict, smoke: bool, steps: int, profile_dir: str | None) -> dict:
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from jaxlong.config import load_config, validate  # noqa: PLC0415
    from jaxlong.core.memstats import compiled_bytes  # noqa: PLC0415
    from jaxlong.core.mesh import build_mesh  # noqa: PLC0415
    from jaxlong.config import runtime  # noqa: PLC0415
    from jaxlong.core.batch import batch_sharding  # noqa: PLC0415
    from jaxlong.training import step as step_lib  # noqa: PLC0415
    from jaxlong.training.loop import check_fits  # noqa: PLC0415
    from jaxlong.training.metrics import flops_per_token, peak_flops  # noqa: PLC0415

    cfg = load_config(str(ROOT / CONFIG), overrides(spec, smoke))
    validate(cfg, num_devices=1)
    mesh = build_mesh(cfg.mesh, devices=jax.devices()[:1])
    row = {"backend": runtime(cfg, mesh).attention_backend, "device": jax.devices()[0].device_kind}
    t0 = time.perf_counter()
    compiled = step_lib.compile_train_step(cfg, mesh)
    row["compile_s"] = time.perf_counter() - t0
    cb = compiled_bytes(compiled)
    row["compiled_peak_bytes"], row["compiled_host_bytes"] = cb["peak"], cb["host_temp"]
    check_fits(compiled)
    state = step_lib.init_state(cfg, mesh)
    sh = batch_sharding(mesh)
    tokens = jax.random.randint(jax.random.key(1), (1, cfg.seq_len + 1), 0, cfg.model.vocab_size, jnp.int32)
    batch = {"inputs": jax.device_put(tokens[:, :-1], sh), "targets": jax.device_put(tokens[:, 1:], sh),
             "mask": jax.device_put(jnp.ones((1, cfg.seq_len), jnp.float32), sh),
             "positions": jax.device_put(jnp.arange(cfg.seq_len, dtype=jnp.int32)[None], sh),
             "segment_ids": jax.device_put(jnp.ones((1, cfg.seq_len), jnp.int32), sh)}  # one document
    times, losses = [], []
    for i in range(steps):
        if profile_dir and i == 1:
            jax.profiler.start_trace(profile_dir)
        t = time.perf_counter()
        state, m = compiled(state, batch)
        losses.append(float(m["loss"]))  # blocks until the step is done
        times.append(time.perf_counter() - t)
        if profile_dir and i == min(2, steps - 1):
            jax.profiler.stop_trace()
            row["profile"] = profile_dir
    step_time = min(times[1:]) if len(times) > 1 else times[0]
    row.update(step_times_s=times, step_time_s=step_time, loss_first=losses[0], loss_last=losses[-1],
               tokens_per_s=cfg.seq_len / step_time, flops_per_token=flops_per_token(cfg))
    peak = peak_flops()
    row["mfu"] = row["tokens_per_s"] * row["flops_per_token"] / peak if peak else None
    stats = jax.devices()[0].memory_stats() or {}
    row["peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
    row["bytes_limit"] = stats.get("bytes_limit")
    return row


def child_plan(specs: list[dict], smoke: bool, out: str) -> None:
    """Deviceless h200 plans of the train configs, one JSON line each, appended to `out` as they finish."""
    from jaxlong.config import load_config  # noqa: PLC0415
    from jaxlong.plan import plan  # noqa: PLC0415
    from jaxlong.plan.target import cuda_plugin_available, parse_target  # noqa: PLC0415

    target = parse_target("h200:1") if cuda_plugin_available() else None
    for spec in specs:
        row = {"name": spec["name"]}
        t0 = time.perf_counter()
        try:
            p = plan(load_config(str(ROOT / CONFIG), overrides(spec, smoke)), target)
            row.update({k: p[k] for k in ("peak", "total", "activations", "host", "workspace", "source")})
        except Exception as e:  # noqa: BLE001
            row["plan_error"] = f"{type(e).__name__}: {e}"[:300]
        row["plan_s"] = time.perf_counter() - t0
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")


# ------------------------------------------------------------------------------------------------- parent


class Report:
    def __init__(self, out: Path, argv: list[str]):
        self.out, self.argv = out, argv
        self.data = {"command": "python experiments/gpu_check.py " + " ".join(argv), "env": {}, "kernel": [],
                     "generate": [], "train": [], "plan": {}, "skipped": [], "errors": []}

    def flush(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu_check.json").write_text(json.dumps(self.data, indent=1, default=str))
        rows = self._train_rows()
        keys = ["name", "status", "backend", "seq_len", "layers", "impl", "u", "tokens_per_s", "mfu", "step_time_s",
                "compile_s", "peak_bytes_in_use", "compiled_peak_bytes", "plan_peak", "plan_total", "plan_source",
                "loss_first", "loss_last", "error"]
        with open(self.out / "gpu_check.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
        (self.out / "gpu_check.md").write_text(self._markdown(rows))

    def _train_rows(self) -> list[dict]:
        rows = []
        for r in self.data["train"]:
            p = self.data["plan"].get(r["name"], {})
            rows.append({**r, "plan_peak": p.get("peak"), "plan_total": p.get("total"),
                         "plan_source": p.get("source", p.get("plan_error"))})
        return rows

    def _markdown(self, rows) -> str:
        d, g = self.data, lambda x: "" if x is None else f"{x / GiB:.2f}"
        lines = [f"# Device check\n\n`{d['command']}`\n", "## Environment\n"]
        lines += [f"- {k}: {v}" for k, v in d["env"].items()]
        lines += ["\n## Attention kernel: candidate vs float32 truth (max error / max |truth|; lse: absolute)\n",
                  "| case | candidate | pass | out | lse | dq | dk | dv | baseline out / dq | note |",
                  "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
        f = lambda r, k: "" if r.get(k) is None else f"{r[k]:.2e}"  # noqa: E731
        for r in d["kernel"]:
            note = r.get("error") or r.get("note") or (
                f"cuDNN bwd from blockwise lse: dq {f(r, 'dq_err_cudnn_bwd_from_blockwise_lse')}"
                if "dq_err_cudnn_bwd_from_blockwise_lse" in r else "")
            lines.append(f"| {r['case']} | {r.get('candidate', '')} | {'yes' if r.get('pass') else 'NO'} | "
                         f"{f(r, 'out_err')} | {f(r, 'lse_err')} | {f(r, 'dq_err')} | {f(r, 'dk_err')} | "
                         f"{f(r, 'dv_err')} | {f(r, 'out_err_baseline')} / {f(r, 'dq_err_baseline')} | {note} |")
        lines += ["\n## Generation: prefill and cached decode against the full recompute (max error / max |truth|)\n",
                  "| case | kernels (prefill / recompute) | pass | vs float32 truth | recompute's | vs recompute | "
                  "argmax agree | note |", "|---|---|---|---:|---:|---:|---:|---|"]
        for r in d["generate"]:
            kernels = " / ".join(r.get("kernels", {}).values())
            agree = "" if r.get("argmax_agree") is None else f"{100 * r['argmax_agree']:.0f}%"
            lines.append(f"| {r['case']} | {kernels} | {'yes' if r.get('pass') else 'NO'} | {f(r, 'err')} | "
                         f"{f(r, 'err_baseline')} | {f(r, 'err_recompute')} | {agree} | {r.get('error', '')} |")
        lines += ["\n## Training, one device (Llama-3.2-1B shapes; L = layers)\n",
                  "| config | status | backend | tokens/s | MFU | step s | compile s | peak in use GiB | "
                  "compiled peak GiB | plan peak GiB | plan total GiB | measured / plan |",
                  "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            ratio = (f"{r['peak_bytes_in_use'] / r['plan_peak']:.2f}"
                     if r.get("peak_bytes_in_use") and r.get("plan_peak") else "")
            mfu = "" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%"
            tps = "" if r.get("tokens_per_s") is None else f"{r['tokens_per_s']:,.0f}"
            st = "" if r.get("step_time_s") is None else f"{r['step_time_s']:.2f}"
            cs = "" if r.get("compile_s") is None else f"{r['compile_s']:.0f}"
            status = r["status"] + (f": {r['error'][:120]}" if r.get("error") else "")
            lines.append(f"| {r['name']} | {status} | {r.get('backend', '')} | {tps} | {mfu} | {st} | {cs} | "
                         f"{g(r.get('peak_bytes_in_use'))} | {g(r.get('compiled_peak_bytes'))} | "
                         f"{g(r.get('plan_peak'))} | {g(r.get('plan_total'))} | {ratio} |")
        src = {p.get("source") for p in d["plan"].values() if p.get("source")}
        lines.append(f"\nplan source: {', '.join(sorted(src)) or 'none'}; MFU = tokens/s x "
                     f"`trainer.flops_per_token` / dense bf16 peak (989 TFLOP/s for H100/H200).")
        if d["skipped"]:
            lines += ["\n## Skipped (time guard)\n"] + [f"- {s}" for s in d["skipped"]]
        if d["errors"]:
            lines += ["\n## Section errors\n"] + [f"- {e}" for e in d["errors"]]
        return "\n".join(lines) + "\n"


def _child(args_list: list[str], timeout: float, env: dict) -> tuple[int, str, str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), *args_list]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout, 1), env=env, cwd=ROOT)
        return p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        return 124, (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout"


def _last_json(stdout: str):
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{") or line.startswith("["):
            return json.loads(line)
    raise ValueError("no result line")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (CI)")
    ap.add_argument("--out", default=None,
                    help="directory for md/csv/json (default experiments/results on a GPU, runs/gpu_check_smoke "
                         "with --smoke)")
    ap.add_argument("--budget-s", type=float, default=None, help="global time guard (default 450, smoke 55)")
    ap.add_argument("--steps", type=int, default=None, help="train steps per config (default 3, smoke 2)")
    ap.add_argument("--no-large", action="store_true", help="skip the large-tensor probe")
    ap.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._child:
        return _run_child(json.loads(args._child))
    t0 = time.monotonic()
    smoke = args.smoke
    budget = args.budget_s or (55.0 if smoke else 450.0)
    steps = args.steps or (2 if smoke else 3)
    if not smoke and not os.path.exists("/dev/nvidiactl"):
        print("error: no NVIDIA GPU here; run with --smoke for the CPU code path", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else (Path("runs") / "gpu_check_smoke" if smoke else ROOT / "experiments" / "results")
    rep = Report(out, argv)
    left = lambda: budget - (time.monotonic() - t0)  # noqa: E731
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    gpu_env = dict(env, XLA_PYTHON_CLIENT_MEM_FRACTION="0.95")
    cpu_env = dict(env, JAX_PLATFORMS="cpu")
    os.environ["JAX_PLATFORMS"] = "cpu"  # the parent imports jax for config and FLOPs only: never the GPU
    run_env = cpu_env if smoke else gpu_env
    specs = train_specs(smoke)

    # plan: in the background on the CPU, from the start
    plan_file = out / "gpu_check_plan.jsonl"
    out.mkdir(parents=True, exist_ok=True)
    plan_file.unlink(missing_ok=True)
    plan_proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--_child",
         json.dumps({"kind": "plan", "specs": specs, "smoke": smoke, "out": str(plan_file)})],
        env=cpu_env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    for section in ("env", "kernel", "window", "generate"):
        try:
            payload = {"kind": section, "smoke": smoke, "large": not args.no_large}
            rc, so, se = _child(["--_child", json.dumps(payload)], min(left() - 10, 150), run_env)
            if rc != 0:
                raise RuntimeError(f"exit {rc}: {se.strip().splitlines()[-1] if se.strip() else ''}"[:400])
            if section == "window":  # rows of the kernel table
                rep.data["kernel"] += _last_json(so)
            else:
                rep.data[section] = _last_json(so)
        except Exception as e:  # noqa: BLE001
            rep.data["errors"].append(f"{section}: {type(e).__name__}: {e}")
        rep.flush()

    from jaxlong.training.metrics import PEAK_FLOPS  # noqa: PLC0415 (imports jax; the parent never initializes it)

    peak = PEAK_FLOPS["H200"] if not smoke else 1e11
    compile_guess = 60.0 if not smoke else 8.0
    for spec in specs:
        n_steps = min(spec.get("steps", steps), steps)
        est = compile_guess + n_steps * _flops(spec, smoke) / (0.3 * peak)
        row = {"name": spec["name"], "seq_len": spec["seq_len"], "layers": spec["layers"], "impl": spec["impl"],
               "u": spec["u"], "estimate_s": est}
        if est > left() - 20:
            rep.data["skipped"].append(f"{spec['name']}: estimated {est:.0f} s, {max(left(), 0):.0f} s left")
            continue
        try:
            profile = str(out / "gpu_check_profile") if spec.get("profile") else None
            payload = {"kind": "train", "spec": spec, "smoke": smoke, "steps": n_steps, "profile": profile}
            rc, so, se = _child(["--_child", json.dumps(payload)], left() - 10, run_env)
            if rc == 0:
                row.update(_last_json(so), status="ok")
            else:
                tail = se.strip().splitlines()[-1] if se.strip() else ""
                row.update(status="timeout" if rc == 124 else "failed", error=tail[:300])
        except Exception as e:  # noqa: BLE001
            row.update(status="failed", error=f"{type(e).__name__}: {e}"[:300])
        rep.data["train"].append(row)
        _merge_plan(rep, plan_file)
        rep.flush()

    try:
        plan_proc.wait(timeout=max(left(), 1))
    except subprocess.TimeoutExpired:
        plan_proc.kill()
        rep.data["errors"].append("plan: stopped by the time guard (rows without plan columns were not planned)")
    _merge_plan(rep, plan_file)
    rep.data["env"]["wall_s"] = round(time.monotonic() - t0, 1)
    rep.flush()
    print(f"wrote {out / 'gpu_check.md'} ({rep.data['env']['wall_s']} s)")
    print((out / "gpu_check.md").read_text())
    return 0


def _flops(spec: dict, smoke: bool) -> float:
    """Training FLOPs of one step of `spec` (model FLOPs x 4/3 for the remat recompute)."""
    from jaxlong.config import load_config  # noqa: PLC0415
    from jaxlong.training.metrics import flops_per_token  # noqa: PLC0415

    cfg = load_config(str(ROOT / CONFIG), overrides(spec, smoke))
    return flops_per_token(cfg) * cfg.seq_len * 4 / 3


def _merge_plan(rep: Report, plan_file: Path) -> None:
    if plan_file.exists():
        for line in plan_file.read_text().splitlines():
            try:
                r = json.loads(line)
                rep.data["plan"][r["name"]] = r
            except ValueError:
                pass


def _run_child(payload: dict) -> int:
    kind = payload["kind"]
    try:
        if kind == "plan":
            child_plan(payload["specs"], payload["smoke"], payload["out"])
            return 0
        if kind == "env":
            import jax  # noqa: PLC0415

            info = {"jax": jax.__version__, "backend": jax.default_backend(),
                    "devices": f"{len(jax.devices())} x {jax.devices()[0].device_kind}"}
            try:
                from jax._src.lib import cuda_versions  # noqa: PLC0415

                info["cudnn"] = cuda_versions.cudnn_get_version() if cuda_versions else None
            except Exception as e:  # noqa: BLE001
                info["cudnn"] = f"unknown ({type(e).__name__})"
            stats = jax.devices()[0].memory_stats() or {}
            info["bytes_limit"] = stats.get("bytes_limit")
            result = info
        elif kind == "kernel":
            result = child_kernel(payload["smoke"], payload["large"])
        elif kind == "window":
            result = child_window(payload["smoke"])
        elif kind == "generate":
            result = child_generate(payload["smoke"])
        else:
            result = child_train(payload["spec"], payload["smoke"], payload["steps"], payload["profile"])
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        print(traceback.format_exc().strip().splitlines()[-1], file=sys.stderr)
        return 1
    print(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
