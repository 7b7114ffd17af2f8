"""The blockwise kernel's attention work, counted by its tiles per layer kind (docs/windows.md).

The blockwise kernel (`jaxlong.kernels.blockwise`, FlashAttention-2, arXiv 2307.08691 Algorithms 1 and 2) walks
score tiles `[tq, tk]` in loops whose bounds are data: the causal diagonal (each query tile's last key tile), a
sliding window (its first; Gemma 3's local layers, arXiv 2503.19786 section 2) and documents. XLA knows no trip
count for such a loop, so the HLO count of `jaxlong.plan.cost` sees one iteration (one tile) each time the loop is
entered: the forward enters its key-tile loop once per query tile (`n / tq` entries for a call over `n` tokens), the
backward its query-tile loop once per key tile (`n / tk`). The kernel computes `window_tiles(n, tq, tk, window)`
tiles per call and head (the same tiles forward and backward): all the causal ones for a global layer, the
window's band for a local one.

The calls a layer makes (`kernel_calls`, from the config; ring = 1):

    path                                      calls / layer  tokens n per call  (batch x) heads  tiles tq x tk
    FSDP, Ulysses by the all-to-all            1              S                  H / C            block_q x block_k
    U-Pipe by the all-to-all (U heads/stage)   H / U          S                  U / C            block_q x block_k
    a local layer's halo over context          1              h + S / C          H                halo_tiles(S / C)
      (Ulysses and U-Pipe alike, `jaxlong.parallel.halo`: the chunk and the h = halo_rows K/V rows before it)

(C: `mesh.context`, H: query heads, S: `seq_len`; blocks clamped to the call's tokens; the halo's first rank sees
fewer tiles, the count is the other ranks'.) Each tile loop of the HLO is recorded under its direction and the
FLOPs of one of its tiles over the call's (batch x heads) (`Cost.tile_loop_groups`): `2 x matmuls x tq x tk x
head_dim x batch x heads`, which tells the call's path; a group's entries divided by its path's entries per call
(`n / tq` or `n / tk`) and calls per layer are layer executions. The HLO shows a layer executions' number per
direction (a conditional over layer kinds counts its dearest branch for every layer; separate loops count their
own), not which kind ran: so

    passes          = layer executions / layers                   (forward 2 under remat.policy=full, backward 1)
    attention FLOPs = sum over directions of passes x sum over layer kinds of
                      layers x calls per layer x batch x heads x tiles per call x tile FLOPs
    tile FLOPs      = 4 x tq x tk x head_dim forward (QK^T, PV),
                      10 x ... backward (QK^T recomputed, dV, dP, dK, dQ: 2.5 x the forward)

and the tile loops' counted FLOPs are replaced by these; their HBM bytes by the tiles times each shape's bytes
per tile, as the HLO shows them (`Cost.tile_loop_seen_bytes`: in any branch of a conditional; a shape it shows
nowhere takes the counted tiles' bytes per FLOP). The executions (recomputation, micro-batches) come from the
compiled program, the tiles and the paths from the config. A group that matches no path's tile is left counted one
tile per entry, with a warning; paths whose tiles have equal FLOPs are told apart by none.
"""
from __future__ import annotations

import dataclasses

from jaxlong.config import ConfigError
from jaxlong.core.mesh import resolve_mesh_shape
from jaxlong.kernels.blockwise import window_tiles
from jaxlong.models.family import LOCAL, layer_kinds
from jaxlong.parallel.halo import halo_over_context, halo_rows, halo_tiles
from jaxlong.plan.cost import Cost

__all__ = ["KernelCall", "kernel_calls", "layer_tiles", "count_tiles", "blockwise_attention_cost",
           "window_model_flops_per_token"]

MATMULS = {"forward": 2, "backward": 5}  # per score tile: FlashAttention-2 Algorithms 1 and 2


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """The blockwise kernel calls of one layer kind, per device: `layers` layers each making `calls` calls over
    `tokens` tokens and `heads` heads (per batch row) in tiles `block_q x block_k`, each computing `tiles` score
    tiles per head (fractional: a share skipped between packed documents)."""

    layers: float
    calls: int
    tokens: int
    heads: int
    block_q: int
    block_k: int
    tiles: float

    def entries(self, kind: str) -> int:
        """Tile-loop entries per call: one per query tile forward, one per key tile backward."""
        return self.tokens // (self.block_q if kind == "forward" else self.block_k)

    def tile_flops(self, kind: str, head_dim: int) -> float:
        """FLOPs of one score tile and head."""
        return 2.0 * MATMULS[kind] * self.block_q * self.block_k * head_dim


def layer_tiles(cfg) -> list[tuple[int, int]]:
    """`[(layers, tiles per call), ...]` for each layer kind of the model (global first, then local): the score
    tiles the blockwise kernel computes per call and head over the whole sequence (`window_tiles`, the causal ones
    for a global layer, the window's band for a local one), as it runs under FSDP, Ulysses and U-Pipe by the
    all-to-all (each call sees the whole `seq_len`). Windows come from `model.sliding_window` and the layer kinds
    (`jaxlong.models.family.layer_kinds`)."""
    s, a = cfg.seq_len, cfg.attention
    kinds = layer_kinds(cfg.model)
    return [(kinds.count(k), window_tiles(s, a.block_q, a.block_k, cfg.model.sliding_window if k == LOCAL else 0))
            for k in sorted(set(kinds))]


def kernel_calls(cfg, global_fraction: float = 1.0) -> list[KernelCall]:
    """The blockwise kernel calls of each layer kind of the run `cfg` (ring = 1), per device (module docstring):
    the all-to-all's (FSDP, Ulysses, U-Pipe's stages) over the whole sequence, or a local layer's halo exchange over
    `context` (`attention.window_exchange`, `jaxlong.parallel.halo.halo_over_context`) over its chunk and halo with
    every head. The global layers' tiles are scaled by `global_fraction` (packed documents)."""
    m, a, s = cfg.model, cfg.attention, cfg.seq_len
    c = resolve_mesh_shape(cfg.mesh, cfg.mesh.num_devices)[3]
    heads, calls = m.heads // c, 1
    if a.impl == "upipe" and c > 1:
        u = a.heads_per_stage or c
        heads, calls = u // c, m.heads // u
    kinds = layer_kinds(m)
    out = []
    for k in sorted(set(kinds)):
        window = m.sliding_window if k == LOCAL else 0
        if k == LOCAL and halo_over_context(a.window_exchange, window, s, c, m.heads, m.kv_heads, m.head_dim,
                                            a.block_q, a.block_k):
            chunk = s // c
            tq, tk = halo_tiles(chunk, a.block_q, a.block_k)
            n = halo_rows(window, chunk, a.block_q, a.block_k) + chunk
            out.append(KernelCall(kinds.count(k), 1, n, m.heads, tq, tk, window_tiles(n, tq, tk, window)))
            continue
        bq, bk = min(a.block_q, s), min(a.block_k, s)
        tiles = window_tiles(s, bq, bk, window) * (1.0 if k == LOCAL else global_fraction)
        out.append(KernelCall(kinds.count(k), calls, s, heads, bq, bk, tiles))
    return out


def count_tiles(cost: Cost, *, calls: list[KernelCall], batch: int, head_dim: int) -> Cost:
    """`cost` (`jaxlong.plan.cost.hlo_cost` of a compiled step) with the blockwise kernel's tile loops counted by
    their tiles (module docstring): the matched groups' counted FLOPs and HBM bytes (one iteration per entry)
    replaced, the result added to `attention_flops`, and the kernel's calls and (batch x heads) calls added to
    `attention_calls` and `attention_head_calls` (per step, per device).

    Args:
      cost: per-device cost of one step, with `tile_loop_groups` and `tile_loop_group_bytes`.
      calls: the kernel calls of each layer kind (`kernel_calls`).
      batch: the batch rows of one call (per device and micro-batch).
      head_dim: the attention head size.

    Returns:
      A new `Cost`; `cost` itself when it has no tile loops. A warning is added for a group whose tile matches no
      call's, or whose entries are not a whole number of layer executions.

    Raises:
      ValueError: no layers, or a call's blocks do not divide its tokens.
    """
    if not cost.tile_loop_groups:
        return cost
    n_layers = sum(k.layers for k in calls)
    if n_layers <= 0 or any(k.tokens % k.block_q or k.tokens % k.block_k for k in calls):
        raise ValueError(f"count_tiles: calls {calls}")
    out = dataclasses.replace(cost, attention_calls=dict(cost.attention_calls),
                              attention_head_calls=dict(cost.attention_head_calls), warnings=list(cost.warnings))
    seen = {g: cost.tile_loop_seen_bytes.get(g, 0.0) / n for g, n in cost.tile_loop_seen_entries.items() if n}
    for kind in MATMULS:
        runs = flops = bytes_ = 0.0  # layer executions; the matched groups' counted FLOPs and bytes
        for group, entries in cost.tile_loop_groups.items():
            direction, tile = group.split()
            if direction != kind:
                continue
            match = next((k for k in calls if abs(k.tile_flops(kind, head_dim) * batch * k.heads - float(tile))
                          <= 1e-9 * float(tile)), None)
            if match is None:
                out.warnings.append(f"blockwise {kind} tile loops of {float(tile):.4g} FLOPs per tile match no "
                                    "kernel call of the config: counted one tile per entry")
                continue
            r = entries / (match.entries(kind) * match.calls)
            if abs(r - round(r)) > 1e-6 * max(r, 1):
                out.warnings.append(f"blockwise {kind} tile loops: {r:.3f} layer executions, not whole")
            runs += r
            flops += float(tile) * entries
            bytes_ += cost.tile_loop_group_bytes.get(group, 0.0)
        if not runs:
            continue
        passes = runs / n_layers
        work = traffic = 0.0
        for k in calls:
            tile = k.tile_flops(kind, head_dim) * batch * k.heads  # one tile over the call's batch x heads
            tiles = passes * k.layers * k.calls * k.tiles
            work += tiles * tile
            per_tile = seen.get(f"{kind} {tile:.0f}")  # this shape's bytes per tile, where the HLO shows it
            traffic += tiles * (per_tile if per_tile is not None else tile * bytes_ / flops)
        out.flops += work - flops
        out.attention_flops += work
        out.hbm_bytes += traffic - bytes_
        out.attention_calls[kind] = out.attention_calls.get(kind, 0) + passes * sum(k.layers * k.calls for k in calls)
        out.attention_head_calls[kind] = out.attention_head_calls.get(kind, 0) + passes * sum(
            k.layers * k.calls * batch * k.heads for k in calls)
    return out


def blockwise_attention_cost(cost: Cost, cfg, global_fraction: float = 1.0) -> Cost:
    """`count_tiles` for the run `cfg`: its kernel calls per layer kind (`kernel_calls`), batch rows per call and
    head size, the global layers' tiles scaled by `global_fraction` (the share packed documents leave,
    `jaxlong.plan.packing`; local layers are counted by their window alone, an upper bound with documents). Under
    ring attention (`mesh.ring` > 1) each call sees a chunk and its halo, which this count does not model: the tile
    loops stay counted one iteration per entry, with a warning.

    Raises:
      ConfigError: `global_fraction` outside (0, 1].
    """
    if not cost.tile_loop_groups:
        return cost
    if not 0.0 < global_fraction <= 1.0:
        raise ConfigError(f"the packed documents' tile fraction {global_fraction} must be in (0, 1]",
                          key="data.doc_lengths", value=global_fraction)
    data, fsdp, ring, _ = resolve_mesh_shape(cfg.mesh, cfg.mesh.num_devices)
    if ring > 1:
        return dataclasses.replace(cost, warnings=[*cost.warnings, (
            f"mesh.ring={ring}: the blockwise kernel's tile loops are counted one tile per entry "
            "(ring chunks and halos are not modelled)")])
    batch = cfg.global_batch // (cfg.grad_accum * data * fsdp)
    return count_tiles(cost, calls=kernel_calls(cfg, global_fraction), batch=max(batch, 1),
                       head_dim=cfg.model.head_dim)


def window_model_flops_per_token(cfg) -> float:
    """The attention part of the model FLOPs per token (training: forward and backward, 12 x heads x head_dim per
    key seen, `jaxlong.training.metrics.flops_per_token`'s convention) with the window: a global layer sees seq / 2
    keys per query on average, a local one `W - W (W - 1) / (2 seq)` (W keys, fewer in the first window). Equals
    `flops_per_token`'s attention term `6 x layers x seq x heads x head_dim` for a model without windows."""
    m, s = cfg.model, cfg.seq_len
    w = min(m.sliding_window, s)
    keys = [w - w * (w - 1) / (2 * s) if k == LOCAL else s / 2 for k in layer_kinds(m)]
    return 12.0 * m.heads * m.head_dim * sum(keys)
