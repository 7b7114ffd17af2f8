"""The blockwise kernel's attention work, counted by its tiles per layer kind (docs/windows.md).

The blockwise kernel (`jaxlong.kernels.blockwise`, FlashAttention-2, arXiv 2307.08691 Algorithms 1 and 2) walks
score tiles `[block_q, block_k]` in loops whose bounds are data: the causal diagonal (each query tile's last key
tile), a sliding window (its first; Gemma 3's local layers, arXiv 2503.19786 section 2) and documents. XLA knows no
trip count for such a loop, so the HLO count of `jaxlong.plan.cost` sees one iteration (one tile) each time the
loop is entered: the forward enters its key-tile loop once per query tile (`seq / block_q` entries per call), the
backward its query-tile loop once per key tile (`seq / block_k`). The kernel computes `window_tiles(seq, block_q,
block_k, window)` tiles per call and head (the same tiles forward and backward): all the causal ones for a global
layer, the window's band for a local one.

So the estimate replaces the tile loops' counted FLOPs by

    attention FLOPs = sum over directions of  head_calls x mean_tiles x tile FLOPs
    tile FLOPs      = 4 x block_q x block_k x head_dim forward (QK^T, PV),
                      10 x ... backward (QK^T recomputed, dV, dP, dK, dQ: 2.5 x the forward)
    head_calls      = counted tile-loop FLOPs / (tile FLOPs x loop entries per call): the (batch x heads) of every
                      kernel call of the step, forward ones including the recomputation the remat policy compiles
    mean_tiles      = sum over layer kinds of layers x tiles per call / layers (from the config)

and scales the tile loops' HBM bytes by `mean_tiles / entries per call` alike. The calls and the heads per call come
from the compiled program (its recomputation, micro-batches, heads per device), the tiles from the config.
"""

from __future__ import annotations

import dataclasses

from jaxlong.config import ConfigError
from jaxlong.kernels.blockwise import window_tiles
from jaxlong.models.family import LOCAL, layer_kinds
from jaxlong.plan.cost import Cost

__all__ = ["layer_tiles", "count_tiles", "blockwise_attention_cost", "window_model_flops_per_token"]

MATMULS = {"forward": 2, "backward": 5}  # per score tile: FlashAttention-2 Algorithms 1 and 2


def layer_tiles(cfg) -> list[tuple[int, int]]:
    """`[(layers, tiles per call), ...]` for each layer kind of the model (global first, then local): the score
    tiles the blockwise kernel computes per call and head over the whole sequence (`window_tiles`, the causal ones
    for a global layer, the window's band for a local one), as it runs under FSDP, Ulysses and U-Pipe (each call
    sees the whole `seq_len`). Windows come from `model.sliding_window` and the layer kinds
    (`jaxlong.models.family.layer_kinds`)."""
    return list(_kind_tiles(cfg).values())


def _kind_tiles(cfg) -> dict[int, tuple[int, int]]:
    s, a = cfg.seq_len, cfg.attention
    kinds = layer_kinds(cfg.model)
    return {k: (kinds.count(k), window_tiles(s, a.block_q, a.block_k, cfg.model.sliding_window if k == LOCAL else 0))
            for k in sorted(set(kinds))}


def count_tiles(cost: Cost, *, seq: int, block_q: int, block_k: int, head_dim: int,
                layers: list[tuple[float, float]]) -> Cost:
    """`cost` (`jaxlong.plan.cost.hlo_cost` of a compiled step) with the blockwise kernel's tile loops counted by
    their tiles (module docstring): their counted FLOPs and HBM bytes (one iteration per entry) replaced, the
    result added to `attention_flops`, and the kernel's calls and (batch x heads) calls added to `attention_calls`
    and `attention_head_calls` (per step, per device).

    Args:
      cost: per-device cost of one step, with `tile_loop_flops`, `tile_loop_bytes`, `tile_loop_entries`.
      seq: the sequence each kernel call sees (tokens); block_q, block_k: its tiles (clamped to `seq`).
      head_dim: the attention head size.
      layers: `[(layers, tiles per call), ...]` per layer kind (`layer_tiles`); tiles may be fractional (a share of
        them skipped, e.g. between packed documents).

    Returns:
      A new `Cost`; `cost` itself when it has no tile loops. A warning is added where a loop's FLOPs are not a
      whole number of (batch x heads) tiles.

    Raises:
      ValueError: no layers, or a block that does not divide `seq`.
    """
    if not cost.tile_loop_entries:
        return cost
    n_layers = sum(n for n, _ in layers)
    bq, bk = min(block_q, seq), min(block_k, seq)
    if n_layers <= 0 or seq % bq or seq % bk:
        raise ValueError(f"count_tiles: layers {layers} and tiles {bq} x {bk} of a {seq}-token sequence")
    mean_tiles = sum(n * t for n, t in layers) / n_layers
    out = dataclasses.replace(cost, attention_calls=dict(cost.attention_calls),
                              attention_head_calls=dict(cost.attention_head_calls), warnings=list(cost.warnings))
    for kind, entries in cost.tile_loop_entries.items():
        per_call = seq // (bq if kind == "forward" else bk)  # loop entries per kernel call
        tile = 2.0 * MATMULS[kind] * bq * bk * head_dim
        head_calls = cost.tile_loop_flops.get(kind, 0.0) / (tile * per_call)
        if abs(head_calls - round(head_calls)) > 1e-6 * max(head_calls, 1):
            out.warnings.append(f"blockwise {kind} tile loops: {head_calls:.3f} (batch x heads) calls, not whole")
        flops = head_calls * mean_tiles * tile
        out.flops += flops - cost.tile_loop_flops.get(kind, 0.0)
        out.attention_flops += flops
        out.hbm_bytes += cost.tile_loop_bytes.get(kind, 0.0) * (mean_tiles / per_call - 1.0)
        out.attention_calls[kind] = out.attention_calls.get(kind, 0) + entries / per_call
        out.attention_head_calls[kind] = out.attention_head_calls.get(kind, 0) + head_calls
    return out


def blockwise_attention_cost(cost: Cost, cfg, global_fraction: float = 1.0) -> Cost:
    """`count_tiles` for the run `cfg`: its sequence, tiles, head size and layer kinds (`layer_tiles`), the global
    layers' tiles scaled by `global_fraction` (the share packed documents leave, `jaxlong.plan.packing`; local
    layers are counted by their window alone, an upper bound with documents). Under ring attention
    (`mesh.ring` > 1) each call sees a chunk and its halo, which this count does not model: the tile loops stay
    counted one iteration per entry, with a warning.

    Raises:
      ConfigError: `global_fraction` outside (0, 1].
    """
    if not cost.tile_loop_entries:
        return cost
    if not 0.0 < global_fraction <= 1.0:
        raise ConfigError(f"the packed documents' tile fraction {global_fraction} must be in (0, 1]",
                          key="data.doc_lengths", value=global_fraction)
    if cfg.mesh.ring > 1:
        return dataclasses.replace(cost, warnings=[*cost.warnings, (
            f"mesh.ring={cfg.mesh.ring}: the blockwise kernel's tile loops are counted one tile per entry "
            "(ring chunks and halos are not modelled)")])
    tiles = [(n, t * (1.0 if k == LOCAL else global_fraction)) for k, (n, t) in _kind_tiles(cfg).items()]
    return count_tiles(cost, seq=cfg.seq_len, block_q=cfg.attention.block_q, block_k=cfg.attention.block_k,
                       head_dim=cfg.model.head_dim, layers=tiles)


def window_model_flops_per_token(cfg) -> float:
    """The attention part of the model FLOPs per token (training: forward and backward, 12 x heads x head_dim per
    key seen, `jaxlong.training.metrics.flops_per_token`'s convention) with the window: a global layer sees seq / 2
    keys per query on average, a local one `W - W (W - 1) / (2 seq)` (W keys, fewer in the first window). Equals
    `flops_per_token`'s attention term `6 x layers x seq x heads x head_dim` for a model without windows."""
    m, s = cfg.model, cfg.seq_len
    w = min(m.sliding_window, s)
    keys = [w - w * (w - 1) / (2 * s) if k == LOCAL else s / 2 for k in layer_kinds(m)]
    return 12.0 * m.heads * m.head_dim * sum(keys)
