"""The attention backend: which kernel runs (`attention.backend`) and one call for each of forward, forward with
lse, and backward, whatever the kernel.

Backends: `blockwise` (`jaxlong.kernels.blockwise`, pure JAX, any device), `cudnn`
(`jaxlong.kernels.cudnn`), `pallas` (`jaxlong.kernels.pallas_gpu`, Triton; segment ids), `reference`
(dense, tests only) and `auto` (`resolve_backend`). Layout as in `jaxlong.kernels.blockwise`.
"""
from __future__ import annotations

import functools
from typing import Literal, get_args

import jax
import jax.numpy as jnp

from jaxlong.core.errors import ConfigError
from jaxlong.kernels import cudnn as cudnn_kernel
from jaxlong.kernels import pallas_gpu as pallas_kernel
from jaxlong.kernels.blockwise import (
    blockwise_attention,
    blockwise_attention_bwd,
    blockwise_attention_fwd,
    reference_attention,
    reference_attention_with_lse,
)
from jaxlong.kernels.layout import cudnn_head_dim_ok, pallas_head_dim_ok, pallas_tiles

Backend = Literal["auto", "blockwise", "cudnn", "pallas", "reference"]  # `attention.backend`
BACKENDS = get_args(Backend)


def resolve_backend(backend: str, q, segment_ids=None, platform: str | None = None) -> str:
    """Map `backend` (one of `BACKENDS`) to a concrete one for query array `q`.

    `'auto'` on GPUs (`platform`: the mesh's device platform, e.g. `mesh.devices.flat[0].platform`;
    default `jax.default_backend()`) with `q.dtype` bf16/fp16 picks `'cudnn'` without `segment_ids`
    (`head_dim % 8 == 0` and `<= 256`) and `'pallas'` with them (document masking;
    `head_dim` a power of two in [16, 256]); otherwise `'blockwise'`. Compile-only GPU devices (planning
    without a GPU) report `'gpu'` while `jax.default_backend()` is `'cpu'`: pass `platform`.

    Raises:
      ValueError: unknown backend, or `'cudnn'` with segment ids (`attention.backend`).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")
    if backend == "cudnn" and segment_ids is not None:
        raise ValueError(
            "attention.backend=cudnn cannot mask packed documents (cuDNN's packed layout is not usable at long "
            "context, see jaxlong.kernels.cudnn); use attention.backend=auto or pallas (GPUs) or blockwise, or "
            "data.packing=concat")
    if backend != "auto":
        return backend
    platform = jax.default_backend() if platform is None else platform
    return auto_backend(platform, jnp.dtype(q.dtype).name, q.shape[-1], segment_ids is not None)


def auto_backend(platform: str, compute_dtype: str, head_dim: int, segment_ids: bool) -> str:
    """What `attention.backend=auto` runs (`resolve_backend`, without arrays): on GPUs (`platform` `gpu` or
    `cuda`) in bfloat16 or float16, cuDNN without segment ids and the Pallas kernel with them, where the kernel
    takes `head_dim`; the blockwise kernel otherwise."""
    if platform not in ("gpu", "cuda") or compute_dtype not in ("bfloat16", "float16"):
        return "blockwise"
    if not segment_ids and cudnn_head_dim_ok(head_dim):
        return "cudnn"
    if segment_ids and pallas_head_dim_ok(head_dim):
        return "pallas"
    return "blockwise"


def kernel_that_runs(backend: str, platform: str | None, *, compute_dtype: str, head_dim: int,
                     segment_ids: bool) -> str | None:
    """The kernel a run's attention uses: an explicit `attention.backend` itself; `auto` resolved
    (`auto_backend`) where the platform is known, None where it is not (a config checked before the devices
    are known)."""
    if backend != "auto":
        return backend
    return None if platform is None else auto_backend(platform, compute_dtype, head_dim, segment_ids)


def attention(q, k, v, *, backend: str = "auto", causal: bool = True, block_q: int = 512,
              block_k: int = 512, segment_ids=None, window: int = 0):
    """Differentiable attention with backend dispatch; returns `out` (shape/dtype of q).

    backend: `'auto'` (see `resolve_backend`), `'blockwise'`, `'cudnn'`, `'pallas'` or `'reference'`.
    `block_q`/`block_k` are used only by `'blockwise'` (the Pallas kernel keeps its own Triton tile sizes).
    `segment_ids`: int `[batch, seq]` or None, document masking (module docstring).
    `window`: 0, or a sliding window of that many positions (`jaxlong.kernels.blockwise`, Gemma 3's local layers,
    docs/windows.md): every backend takes it (cuDNN without segment ids, as always).
    Raises ValueError for an unknown backend, cuDNN with segment ids (and as the kernel does).
    """
    backend = resolve_backend(backend, q, segment_ids)
    if backend == "blockwise":
        return blockwise_attention(q, k, v, causal=causal, block_q=block_q, block_k=block_k,
                                   segment_ids=segment_ids, window=window)
    if backend == "cudnn":
        return cudnn_kernel.cudnn_attention(q, k, v, causal=causal, window=window)
    if backend == "pallas":
        return pallas_kernel.pallas_attention(q, k, v, causal=causal, segment_ids=segment_ids, window=window)
    return reference_attention(q, k, v, causal=causal, segment_ids=segment_ids, window=window)


def attention_fwd_with_lse(q, k, v, *, backend: str = "auto", causal: bool = True,
                           block_q: int = 512, block_k: int = 512, segment_ids=None, window: int = 0,
                           kv_starts=None, kv_ends=None, kv_head_major: bool = False, interpret: bool = False):
    """Forward returning `(out, lse)`, for ops with their own custom_vjp and for the chunked prefill.

    * `'blockwise'`: `blockwise_attention_fwd` (real lse).
    * `'reference'`: exact lse from the materialized scores.
    * `'cudnn'`: `jaxlong.kernels.cudnn.cudnn_attention_fwd`, cuDNN's softmax statistic,
      which is the same natural-log lse.
    * `'pallas'`: `jaxlong.kernels.pallas_gpu.pallas_attention_fwd` (real lse, segment ids).
    `segment_ids` and `window` as for `attention`. `kv_starts` (int `[batch, seq]`: query t sees key j only if
    `j >= kv_starts[t]`) and `kv_head_major` (k, v `[batch, kv_heads, kv_seq, head_dim]`, a KV cache read in
    place) and `kv_ends` (query t sees key j only if `j < kv_ends[t]`; the Pallas kernel's forward takes it with
    `kv_starts`) as the blockwise and Pallas kernels take them. With them a query that sees no key gets output 0 and
    lse -inf.
    `interpret`: the Pallas kernel in its interpreter (CPU tests).

    Raises:
      ValueError: as `resolve_backend` and the kernel; bounds or the head-major layout given to cuDNN.
    """
    backend = resolve_backend(backend, q, segment_ids)
    bounds = dict(kv_starts=kv_starts, kv_ends=kv_ends)
    if backend == "blockwise":
        return blockwise_attention_fwd(q, k, v, causal=causal, block_q=block_q, block_k=block_k,
                                       segment_ids=segment_ids, window=window, kv_head_major=kv_head_major, **bounds)
    if backend == "reference":
        k, v = (jnp.swapaxes(x, 1, 2) for x in (k, v)) if kv_head_major else (k, v)
        return reference_attention_with_lse(q, k, v, causal=causal, segment_ids=segment_ids, window=window, **bounds)
    if backend == "pallas":
        return pallas_kernel.pallas_attention_fwd(q, k, v, causal=causal, segment_ids=segment_ids, window=window,
                                                  kv_head_major=kv_head_major, interpret=interpret, **bounds)
    if kv_starts is not None or kv_ends is not None or kv_head_major:
        raise ValueError("the cuDNN kernel takes no per-query key bounds and no head-major keys; use "
                         "attention.backend=blockwise or pallas")
    return cudnn_kernel.cudnn_attention_fwd(q, k, v, causal=causal, window=window)


def attention_bwd(q, k, v, out, lse, dout, *, backend: str = "auto", causal: bool = True,
                  block_q: int = 512, block_k: int = 512, segment_ids=None, window: int = 0):
    """Backward matching `attention_fwd_with_lse`; returns `(dq, dk, dv)`.

    `'blockwise'` uses `blockwise_attention_bwd`, `'cudnn'` `jaxlong.kernels.cudnn.cudnn_attention_bwd` and `'pallas'`
    `jaxlong.kernels.pallas_gpu.pallas_attention_bwd`, all from the saved `out`/`lse` (no forward is rerun).
    `'reference'` (tests only) ignores `out`/`lse` and recomputes the forward under `jax.vjp`. Dtypes follow q, k, v;
    `window` must be the forward's.
    """
    backend = resolve_backend(backend, q, segment_ids)
    if backend == "blockwise":
        return blockwise_attention_bwd(q, k, v, out, lse, dout, causal=causal,
                                       block_q=block_q, block_k=block_k, segment_ids=segment_ids, window=window)
    if backend == "cudnn":
        return cudnn_kernel.cudnn_attention_bwd(q, k, v, out, lse, dout, causal=causal, window=window)
    if backend == "pallas":
        return pallas_kernel.pallas_attention_bwd(q, k, v, out, lse, dout, causal=causal, segment_ids=segment_ids,
                                                  window=window)
    _, vjp = jax.vjp(functools.partial(reference_attention, causal=causal, segment_ids=segment_ids, window=window),
                     q, k, v)
    return vjp(dout.astype(q.dtype))


def check_backend(backend: str, *, head_dim: int, compute_dtype: str, segment_ids: bool) -> None:
    """An explicit `attention.backend` that the run's shapes, dtype, batches or mesh cannot use (the kernels' own
    checks, moved before compiling). `auto` always works: it falls back to the blockwise kernel.

    Args:
      backend: `attention.backend`; head_dim: `model.head_dim`; compute_dtype: `compute_dtype`;
      segment_ids: the batches carry segment ids (`data.packing=documents`).

    Raises:
      ConfigError: cuDNN with segment ids or in float32, or a head_dim the kernel does not take (`key`
        attention.backend, `keys` the option it conflicts with; `jaxlong.config.validate` adds what passes). Under
        ring attention (`ring` > 1) the same kernel runs its blocks.
    """
    at = dict(key="attention.backend", value=backend)
    if backend == "cudnn":
        if segment_ids:
            raise ConfigError("attention.backend=cudnn cannot mask packed documents (data.packing=documents; "
                              "cuDNN's packed layout is not usable at long context)", keys=("data.packing",), **at)
        if compute_dtype not in ("bfloat16", "float16"):
            raise ConfigError(f"attention.backend=cudnn needs compute_dtype=bfloat16 or float16, got "
                              f"{compute_dtype}", keys=("compute_dtype",), **at)
        if not cudnn_head_dim_ok(head_dim):
            raise ConfigError(f"attention.backend=cudnn needs model.head_dim a multiple of 8 and <= 256, got "
                              f"{head_dim}", keys=("model.head_dim",), **at)
    if backend == "pallas" and not pallas_head_dim_ok(head_dim):
        raise ConfigError(f"attention.backend=pallas needs model.head_dim a power of two in [16, 256], got "
                          f"{head_dim}", keys=("model.head_dim",), **at)


def check_kernel_size(kernel: str, *, backend: str, batch: int, seq: int, heads: int, head_dim: int) -> None:
    """The GPU kernels' limit of one call's tensors (int32 offsets: `MAX_ELEMENTS` of `jaxlong.kernels.cudnn` and
    `jaxlong.kernels.pallas_gpu`), checked while tracing by the kernels and before it by `jaxlong.config.validate`.

    Args:
      kernel: the kernel that runs (`kernel_that_runs`); backend: `attention.backend` as set (named in the message).
      batch: sequences per device per call; seq: tokens per call (the whole sequence after Ulysses' all-to-all,
        or ring attention's local S/ring); heads: query heads per device per call (heads/context, or U-Pipe's
        U/context); head_dim: `model.head_dim`.

    Raises:
      ConfigError: the Pallas kernel's padded query `[batch, padded seq, heads, head_dim]`, or one head's cuDNN call
        `[batch, seq, 1, head_dim]`, would exceed the limit (`key` attention.backend).
    """
    if kernel == "pallas":
        shape = (batch, pallas_tiles(seq, pallas_kernel.DEFAULT_BLOCK, pallas_kernel.DEFAULT_BLOCK)[2], heads, head_dim)
        limit = pallas_kernel.MAX_ELEMENTS
    elif kernel == "cudnn":
        shape, limit = (batch, seq, 1, head_dim), cudnn_kernel.MAX_ELEMENTS
    else:
        return
    elements = shape[0] * shape[1] * shape[2] * shape[3]
    if elements > limit:
        raise ConfigError(
            f"attention.backend={backend} runs the {kernel} kernel on q of {list(shape)} (batch, sequence, heads per "
            f"call and device, head_dim): {elements:,} elements, more than its {limit:,} (int32 offsets)",
            key="attention.backend", value=backend,
            keys=("mesh.context", "mesh.ring", "attention.impl", "attention.heads_per_stage", "grad_accum", "seq_len"))
