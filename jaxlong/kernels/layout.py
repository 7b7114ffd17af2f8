"""What the GPU attention kernels accept, in one place: the q/k/v layout check and the head_dim each kernel
supports (used by the kernels, by `attention.backend=auto` and by `jaxlong.config.validate`)."""

from __future__ import annotations


def check_qkv(q, k, v, name: str, causal: bool = True) -> tuple[int, int, int, int]:
    """Check q `[batch, seq, heads, head_dim]`, k, v `[batch, kv_seq, kv_heads, head_dim]` (grouped-query
    attention: heads a multiple of kv_heads) before anything is traced into a kernel; return
    `(batch, seq, heads, head_dim)`. `kv_seq` must equal `seq` for `causal` attention; unmasked calls may
    attend to a key block of another length (ring attention's remote blocks, `jaxlong.parallel.ring`).

    Raises:
      ValueError: naming the kernel `name` ("cudnn attention", "pallas attention") and the shapes given.
    """
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"{name}: q must be [batch, seq, heads, head_dim] and k, v [batch, seq, kv_heads, "
                         f"head_dim] of one shape; got {q.shape}, {k.shape}, {v.shape}")
    b, s, h, d = q.shape
    if (k.shape[0], k.shape[3]) != (b, d) or h % k.shape[2] or (causal and k.shape[1] != s):
        raise ValueError(f"{name}: k/v shape {k.shape} does not fit q shape {q.shape} (same batch and head_dim, "
                         f"heads a multiple of kv_heads, and for causal attention the same seq)")
    return b, s, h, d


def check_window(window, causal: bool, name: str = "") -> int:
    """A sliding window as an int: 0 (none) or W > 0 positions, with the causal mask only (query t sees keys
    `t - W + 1 .. t`, itself and the W - 1 before it: transformers' `sliding_window`, `jaxlong.kernels.blockwise`,
    docs/windows.md).

    Raises:
      ValueError: a negative or fractional window, or one with `causal=False` (naming the kernel `name`, if given).
    """
    if window is None or window == 0:
        return 0
    at = f"{name}: " if name else ""
    if int(window) != window or window < 0:
        raise ValueError(f"{at}window={window!r} must be 0 (no window) or a positive number of positions")
    if not causal:
        raise ValueError(f"{at}a sliding window needs causal=True (a query sees itself and the window - 1 keys "
                         f"before it)")
    return int(window)


def cudnn_head_dim_ok(d: int) -> bool:
    """cuDNN flash attention: head_dim a multiple of 8 and at most 256 (Hopper)."""
    return d % 8 == 0 and 0 < d <= 256


def pallas_head_dim_ok(d: int) -> bool:
    """The Pallas (Triton) kernel: head_dim a power of two in [16, 256] (Triton block shapes)."""
    return 16 <= d <= 256 and d & (d - 1) == 0


def pallas_tiles(seq: int, block_q: int, block_k: int) -> tuple[int, int, int]:
    """The Pallas kernel's `(block_q, block_k, padded)` for a sequence of `seq` tokens (the longer of the query
    and key sequences): tiles larger than the sequence padded to a power of two (at least 16) only add padding and
    are clamped to it, and the sequence is padded to a multiple of the larger tile."""
    cap = max(16, 1 << (seq - 1).bit_length())
    block_q, block_k = min(int(block_q), cap), min(int(block_k), cap)
    tile = max(block_q, block_k)
    return block_q, block_k, -(-seq // tile) * tile
