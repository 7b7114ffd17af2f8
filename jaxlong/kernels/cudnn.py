"""cuDNN flash attention with its softmax statistic in and out (NVIDIA GPUs).

    cudnn_attention_fwd(q, k, v)                      -> (out, lse)
    cudnn_attention_bwd(q, k, v, out, lse, dout)      -> (dq, dk, dv)     (no forward recomputation)
    cudnn_attention(q, k, v)                          -> out              (custom_vjp saving q, k, v, out, lse)

Layout as in `jaxlong.kernels.blockwise`: q `[batch, seq, heads, head_dim]`, k, v `[batch, seq, kv_heads,
head_dim]` (grouped-query attention: kv heads are not repeated, cuDNN maps query head h to kv head
h // (heads / kv_heads)), lse float32 `[batch, heads, seq]`. Inputs bf16 or fp16, head_dim a multiple of 8 and
at most 256 (Hopper; 128 before), scores scaled by 1/sqrt(head_dim), causal or not.

Why this kernel (survey, December 2026):
  - JAX's cuDNN fused-attention module `jax._src.cudnn.fused_attention_stablehlo` (chosen). Its
    `dot_product_attention(..., return_residual=True)` returns `(out, softmax_stat)` and lowers to the custom
    call `__cudnn$fmhaSoftmax`; its backward primitive (`_dot_product_attention_bwd_p_wrapper`, lowering to
    `__cudnn$fmhaSoftmaxBackward`) takes the saved statistic and output with the output gradient, so a backward
    needs no forward. It is what `jax.nn.dot_product_attention(implementation='cudnn')` and MaxText's
    `cudnn_flash_jax` path run (cuDNN's FlashAttention-2/3-class kernels), GQA natively, sequence length only
    bounded by memory (no `[S, S]` tensor), it partitions under `jax.shard_map`, and it compiles in a deviceless
    GPU compile (`jaxlong.plan.target`), so plans see the kernel that runs. Cost: the module is private.
  - `jax.nn.dot_product_attention(implementation='cudnn')`: the same kernel, but public API returns no
    statistic, so an op with its own backward (U-Pipe, ring attention) must recompute the forward under
    `jax.vjp` -- one extra attention forward per layer, what this module removes.
  - Tokamax (openxla/tokamax): wraps the same cuDNN call and Pallas/Mosaic GPU kernels behind an autotuning
    API; not installed with JAX, and its lse-returning entry points are internal too, so it adds a dependency
    without removing the private-API risk.
  - A Pallas GPU (Triton) kernel of our own (`jaxlong.kernels.pallas_gpu`): testable on the CPU in interpret
    mode and supports segment ids, but on H100 the Triton lowering reaches well under cuDNN's throughput (no
    warp specialization / TMA pipelining), and a faster Mosaic GPU kernel is a project of its own. It is the
    route for document masking, since cuDNN's packed layout is impractical at long context (below).
  - FlashAttention-3 bindings: PyTorch/CUDA extensions with no maintained XLA custom-call binding for JAX
    (and a CUDA build step per machine); they would not compile in a deviceless plan.

Private API guard: `_api()` checks that the module and the names used here exist (and that the forward has
`return_residual`) and raises a clear error otherwise (use `attention.backend=blockwise`); the backward's
operand list is read from the module's own `_dot_product_attention_bwd_impl` signature, since it has grown
across JAX versions (offsets, page tables), and an unknown parameter is an error, not a guess. Checked with JAX
0.10.2 (deviceless sm_90 compile); the device check `experiments/gpu_check.py` verifies the numbers on the JAX that
the GPU machine has (0.11).

The statistic's convention (from the source). cuDNN's SDPA graph defines its `Stats` output as
`max + log(sum(exp(P - max)))` over the keys, natural logarithm, where `P` is the scaled, masked score
(cudnn-frontend `CompositeSoftmaxNode`; JAX's docstring: "the logsumexp tensor", FlashAttention-2 §3.1.1);
JAX returns it as float32 `[batch, heads, seq]` (`softmax_stat_shape = (B, N, T)`), for either qkv layout.
That is exactly `blockwise_attention_fwd`'s lse, so the statistic is returned as the lse; the device check
compares the two numerically.

Sliding windows (`window` W > 0, causal only; Gemma 3's local layers, docs/windows.md): query t sees keys
`t - W + 1 .. t`, as in `jaxlong.kernels.blockwise`. The module's `sliding_window_length` has exactly that
meaning (its docstring: "(pos - sliding_window_length, pos]"; `jax.nn.dot_product_attention`'s
`local_window_size=(left, 0)` passes `left + 1`), so W is passed as is, to the forward and to the backward, whose
backend configs carry it (`sliding_window_length` of `cudnn_fmha_backend_config`); a window of at least the
sequence masks nothing and is not passed. With segment ids a window is refused as any segment ids are (below).

Segment ids (document masking) are not supported here and raise a clear error: JAX's packed layout
(`q_seqlen/kv_seqlen/q_offsets/kv_offsets`) needs a static maximum number of segments M per row, returns the
statistic with shape `[batch * M, heads, seq]` (M times the memory of the lse: gigabytes per call at a million
tokens and hundreds of documents, in a per-segment layout unlike the blockwise kernel's), and its checks
reject the packed layout unless the process's default backend is a Hopper GPU, so it cannot be planned on a
machine without one. With segment ids, `attention.backend=auto` on GPUs runs the Pallas (Triton) kernel pair
`jaxlong.kernels.pallas_gpu` instead: the same signatures, layout and lse convention, the blockwise kernel's
masking, tiles of other documents skipped, and it compiles in the deviceless sm_90 compile too
(`attention.backend=pallas` selects it explicitly; `blockwise` runs anywhere).

Sizes: each operand of a call (`q`, `out`, `dout`, `dq`, the backward's float32 dQ accumulator, `k`, `v`) must
have fewer than 2**31 elements (`MAX_ELEMENTS`). cuDNN's public descriptors are 64-bit, but whether every
kernel indexes with 64-bit offsets is not documented, and FlashAttention-style kernels have overflowed 32-bit
offsets at this size before; a silent overflow corrupts gradients, so the limit is enforced until the device
check's large-tensor probe (`experiments/gpu_check.py`) shows it can be lifted. With U-Pipe a call holds only
U/C heads, so the limit moves to 2**31 / (U/C * head_dim) tokens (16M for one 128-dim head).

Head chunks. A call is split over its heads where that helps: the forward runs as few calls as the size limit
allows (aligned with the KV groups), the backward one query head per call (`BWD_HEADS_PER_CALL`), with that
head's KV head; dK and dV of a KV group are summed over its calls (in float32, kept in the input dtype between calls).
The backward's run-time workspace (the float32 dQ accumulator, `4 * b * heads_per_call * S * head_dim` bytes,
see `jaxlong.plan.workspace`) then holds one head instead of all of them: for Ulysses on Llama-3-8B at C = 8,
a quarter (1.5 GiB instead of 6 GiB per device at 3M tokens). At millions of tokens one head saturates the GPU
(the Untied Ulysses paper's observation), so the extra launches cost nothing measurable.
"""

from __future__ import annotations

import functools
import inspect
import math

import jax
import jax.numpy as jnp

from jaxlong.core.errors import ConfigError
from jaxlong.core.kept import keep_attention_residuals
from jaxlong.kernels.layout import check_qkv, check_window, cudnn_head_dim_ok
from jaxlong.kernels.merge import add_rounded

__all__ = ["CHECKED_JAX", "MAX_ELEMENTS", "cudnn_attention", "cudnn_attention_bwd", "cudnn_attention_fwd"]

CHECKED_JAX = ("0.10.2",)  # the versions whose private module this file was read against
MAX_ELEMENTS = 2**31 - 1  # per operand; see the module docstring
BWD_HEADS_PER_CALL = 1  # query heads per cuDNN backward call (module docstring: head chunks)
_NAMES = ("dot_product_attention", "_dot_product_attention_bwd_p_wrapper", "_dot_product_attention_bwd_impl",
          "MaskType", "AttentionLayout")


def _api():
    """The private cuDNN fused-attention module, or a clear error when this JAX lacks it."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa  # noqa: PLC0415
    except ImportError as e:
        fa, err = None, e
    missing = [n for n in _NAMES if fa is None or not hasattr(fa, n)]
    if not missing and "return_residual" not in inspect.signature(fa.dot_product_attention).parameters:
        missing = ["dot_product_attention(return_residual=...)"]
    if missing:
        raise RuntimeError(
            f"attention.backend=cudnn needs jax._src.cudnn.fused_attention_stablehlo with {', '.join(missing)}, "
            f"which JAX {jax.__version__} does not have (checked with JAX {', '.join(CHECKED_JAX)}); use "
            f"attention.backend=blockwise" + (f" ({err})" if fa is None else ""))
    return fa


def _check(q, k, v, segment_ids, causal: bool = True, window: int = 0):
    """Validate shapes, dtypes, sizes and the window before anything is traced into cuDNN; return head_dim."""
    if segment_ids is not None:
        raise ValueError("attention.backend=cudnn does not support segment ids (document masking"
                         f"{', with a sliding window or without' if window else ''}): cuDNN's packed layout is not "
                         "usable at long context (see jaxlong.kernels.cudnn); use attention.backend=pallas (GPUs) or "
                         "attention.backend=blockwise")
    check_window(window, causal, "cudnn attention")
    b, s, h, d = check_qkv(q, k, v, "cudnn attention", causal)
    s = max(s, k.shape[1])
    if not (jnp.dtype(q.dtype) == jnp.dtype(k.dtype) == jnp.dtype(v.dtype)) or \
            jnp.dtype(q.dtype) not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"attention.backend=cudnn needs bfloat16 or float16 q, k, v (compute_dtype); got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    if not cudnn_head_dim_ok(d):
        raise ValueError(f"attention.backend=cudnn needs head_dim a multiple of 8 and <= 256 (model.head_dim), "
                         f"got {d}")
    if b * s * d > MAX_ELEMENTS:
        raise ConfigError(
            f"attention.backend=cudnn: even one head's call (q {tuple(q.shape)}) would take a tensor of "
            f"{b * s * d:,} elements, more than {MAX_ELEMENTS:,} (int32 offsets); use a shorter seq_len, "
            f"mesh.ring > 1, or attention.backend=blockwise")
    return d


def _mask(fa, causal: bool):
    return fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK


def _sliding_window(window: int, seq: int) -> int | None:
    """cuDNN's `sliding_window_length` for a window of `window` positions over `seq` keys: the same number (cuDNN's
    window `(pos - length, pos]` is the blockwise kernel's `pos - window + 1 .. pos`), or None (no band) where the
    window masks nothing (0, or at least the sequence)."""
    return window if 0 < window < seq else None


def cudnn_attention_fwd(q, k, v, *, causal: bool = True, segment_ids=None, window: int = 0):
    """cuDNN flash attention forward; returns `(out, lse)`.

    Args:
      q: `[batch, seq, heads, head_dim]` bf16/fp16; k, v: `[batch, kv_seq, kv_heads, head_dim]` (same dtype;
        `kv_seq` = `seq` when `causal`: an unmasked call may take a key block of another length).
      causal: query t sees keys 0..t.
      segment_ids: must be None (see the module docstring).
      window: 0, or a sliding window of that many positions with `causal` (query t sees keys `t - window + 1 ..
        t`; module docstring: sliding windows).

    Returns:
      `out` (shape and dtype of q) and `lse` float32 `[batch, heads, seq]`: the natural-log logsumexp of
      the scaled scores per query row, the convention of `blockwise_attention_fwd`.

    Raises:
      ValueError: segment ids, malformed shapes, a dtype other than bf16/fp16, an unsupported head_dim, a window
        that is negative or comes without `causal`.
      ConfigError: a tensor of 2**31 or more elements (`MAX_ELEMENTS`).
      RuntimeError: this JAX lacks the private cuDNN module (`CHECKED_JAX`).
    """
    d = _check(q, k, v, segment_ids, causal, window)
    fa = _api()
    band = _sliding_window(window, k.shape[1])
    outs, lses = [], []
    for lo, hi, kv_lo, kv_hi in _calls(q, k, _forward_heads_per_call(q, k)):
        out, stat = fa.dot_product_attention(q[:, :, lo:hi], k[:, :, kv_lo:kv_hi], v[:, :, kv_lo:kv_hi],
                                             scale=1.0 / math.sqrt(d), mask_type=_mask(fa, causal),
                                             qkv_layout="BTNH", sliding_window_length=band,
                                             return_residual=True)
        outs.append(out)
        lses.append(stat)  # the blockwise kernel's lse (module docstring)
    if len(outs) == 1:
        return outs[0], lses[0]
    return jnp.concatenate(outs, axis=2), jnp.concatenate(lses, axis=1)


def _forward_heads_per_call(q, k) -> int:
    """Query heads per forward call: all of them, or the most under `MAX_ELEMENTS` that keep calls aligned
    with the KV groups (a multiple or a divisor of the heads per KV head)."""
    b, s, h, d = q.shape
    g = h // k.shape[2]
    fits = [c for c in range(h, 0, -1)
            if h % c == 0 and (c % g == 0 or g % c == 0) and b * s * d * c <= MAX_ELEMENTS]
    return fits[0] if fits else 1


def _calls(q, k, heads_per_call: int):
    """`(q_lo, q_hi, kv_lo, kv_hi)` head ranges of the calls: `heads_per_call` query heads each (a divisor of a
    KV group's heads, or a multiple of it), with the KV heads they use."""
    h, kvh = q.shape[2], k.shape[2]
    g = h // kvh
    out = []
    for lo in range(0, h, heads_per_call):
        hi = min(lo + heads_per_call, h)
        out.append((lo, hi, lo // g, max(lo // g + 1, -(-hi // g))))
    return out


def cudnn_attention_bwd(q, k, v, out, lse, dout, *, causal: bool = True, segment_ids=None, window: int = 0):
    """cuDNN flash attention backward from the saved `out` and `lse`; returns `(dq, dk, dv)`.

    Args:
      q, k, v, causal, segment_ids, window: as for `cudnn_attention_fwd` (the window must be the forward's).
      out: the forward output (shape of q); lse: float32 `[batch, heads, seq]` in the blockwise convention
        (from `cudnn_attention_fwd` or `blockwise_attention_fwd`); dout: the gradient of out.

    Returns:
      `dq`, `dk`, `dv` with the shapes and dtypes of q, k, v (dk, dv summed over each GQA group by cuDNN).
      The forward is not run again: one `__cudnn$fmhaSoftmaxBackward` call.

    Raises:
      as `cudnn_attention_fwd`, and ValueError when `out`/`dout`/`lse` have the wrong shapes.
    """
    d = _check(q, k, v, segment_ids, causal, window)
    b, s, h, _ = q.shape
    if out.shape != q.shape or dout.shape != q.shape or lse.shape != (b, h, s):
        raise ValueError(f"cudnn attention backward: out {out.shape} and dout {dout.shape} must have q's shape "
                         f"{q.shape} and lse {lse.shape} must be [batch, heads, seq] = {(b, h, s)}")
    fa = _api()
    params = {"scale": 1.0 / math.sqrt(d), "seed": 42, "dropout_rate": 0.0, "variadic_args": (False, False),
              "mask_type": _mask(fa, causal), "layout": fa.AttentionLayout.BTNH.value,
              "sliding_window_length": _sliding_window(window, k.shape[1])}
    operands, keywords = _bwd_signature(fa)
    unknown = [n for n in keywords if n not in params]
    if unknown:
        raise RuntimeError(f"attention.backend=cudnn: JAX {jax.__version__}'s cuDNN backward primitive takes "
                           f"{', '.join(unknown)}, unknown to jaxlong (checked with JAX {', '.join(CHECKED_JAX)}); "
                           f"use attention.backend=blockwise")
    unused = jnp.zeros(0, dtype=q.dtype)  # the module's placeholder for absent bias / seqlens / offsets / pages
    lse = lse.astype(jnp.float32)
    # dK, dV of a KV group split over several calls are summed in float32 and kept in k's dtype between calls
    # (a float32 `[b, S, kv_heads, d]` buffer would cost what the split saves in workspace).
    dqs, dk, dv = [], jnp.zeros(k.shape, k.dtype), jnp.zeros(v.shape, v.dtype)
    for lo, hi, kv_lo, kv_hi in _calls(q, k, min(BWD_HEADS_PER_CALL, h)):
        named = dict(query=q[:, :, lo:hi], key=k[:, :, kv_lo:kv_hi], value=v[:, :, kv_lo:kv_hi],
                     activation=lse[:, lo:hi], fwd_output=out[:, :, lo:hi].astype(q.dtype),
                     grad_output=dout[:, :, lo:hi].astype(q.dtype))
        dq_c, dk_c, dv_c = fa._dot_product_attention_bwd_p_wrapper.bind(
            *(named.get(n, unused) for n in operands), **{n: params[n] for n in keywords})[:3]
        dqs.append(dq_c)
        dk = dk.at[:, :, kv_lo:kv_hi].set(add_rounded(dk[:, :, kv_lo:kv_hi], dk_c))
        dv = dv.at[:, :, kv_lo:kv_hi].set(add_rounded(dv[:, :, kv_lo:kv_hi], dv_c))
    dq = dqs[0] if len(dqs) == 1 else jnp.concatenate(dqs, axis=2)
    return dq, dk, dv


@functools.cache
def _bwd_signature(fa) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Operand and parameter names of the backward primitive, read from the module's own implementation
    (`_dot_product_attention_bwd_impl(query, ..., grad_output, scale, seed, ...)`; module docstring)."""
    names = list(inspect.signature(fa._dot_product_attention_bwd_impl).parameters)
    first = names.index("scale")
    return tuple(names[:first]), tuple(names[first:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _cudnn(q, k, v, causal, window):
    return cudnn_attention_fwd(q, k, v, causal=causal, window=window)[0]


def _cudnn_vjp_fwd(q, k, v, causal, window):
    out, lse = cudnn_attention_fwd(q, k, v, causal=causal, window=window)
    out, lse = keep_attention_residuals(out, lse)  # `remat.keep_attention` may keep them
    return out, (q, k, v, out, lse)


def _cudnn_vjp_bwd(causal, window, res, dout):
    return cudnn_attention_bwd(*res, dout, causal=causal, window=window)


_cudnn.defvjp(_cudnn_vjp_fwd, _cudnn_vjp_bwd)


def cudnn_attention(q, k, v, *, causal: bool = True, segment_ids=None, window: int = 0):
    """Differentiable cuDNN attention (`jax.custom_vjp`); returns `out` (shape and dtype of q).

    The residuals are exactly `(q, k, v, out, lse)` and the backward is `cudnn_attention_bwd`, the same
    kernel pair that U-Pipe calls through `attention_fwd_with_lse` / `attention_bwd`. Shapes, `window` and errors
    as for `cudnn_attention_fwd` (checked before tracing the custom_vjp).
    """
    _check(q, k, v, segment_ids, causal, window)
    return _cudnn(q, k, v, bool(causal), check_window(window, causal, "cudnn attention"))
