"""The blockwise kernel's attention work in the estimate (`jaxlong.plan.tiles`): its tile loops, whose bounds are
data, are found in the compiled HLO and counted by the tiles each layer kind computes (causal for a global layer,
the window's band for a local one), checked against hand counts on tiny configs. No GPU compile: the HLO is the
CPU compile of one attention call, or of a tiny windowed train step on 4 simulated devices (U-Pipe, Ulysses and
the halo exchange over `context`), or the step's counts are written out."""

import jax
import jax.numpy as jnp
import pytest
from helpers import mesh_for, tiny_cfg

from jaxlong.config import ConfigError
from jaxlong.kernels.blockwise import blockwise_attention
from jaxlong.plan.cost import Cost, hlo_cost
from jaxlong.plan.tiles import (KernelCall, blockwise_attention_cost, count_tiles, kernel_calls, layer_tiles,
                                 window_model_flops_per_token)
from jaxlong.training import step as step_lib

GEMMA = ("model.family=gemma3", "model.layers=6", "model.sliding_window_pattern=6", "model.sliding_window=256",
         "model.heads=4", "model.kv_heads=2", "model.head_dim=32", "seq_len=2048", "attention.backend=blockwise",
         "attention.block_q=256", "attention.block_k=256", "data.packing=concat")


def test_the_tile_loops_of_a_windowed_call_are_found_in_the_hlo_one_tile_per_entry():
    """One windowed attention call and its gradient (CPU compile): the forward's key-tile loop is entered once per
    query tile, the backward's query-tile loop once per key tile, each counted one tile of 2 (forward) or 5
    (backward) matmuls over batch x heads; `count_tiles` then counts the window's 13 tiles, by hand: query tile i
    of 128 sees keys from 128 i - 199, i.e. key tiles i - 1 .. i (tile 0: itself) -> 1 + 2 x 6 = 13."""
    b, s, h, kvh, d, blk, w = 1, 896, 4, 2, 32, 128, 200

    def loss(q, k, v):
        return blockwise_attention(q, k, v, block_q=blk, block_k=blk, window=w).sum()

    q, k = jax.ShapeDtypeStruct((b, s, h, d), jnp.float32), jax.ShapeDtypeStruct((b, s, kvh, d), jnp.float32)
    cost = hlo_cost(jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, k).compile().as_text())
    n = s // blk
    tile = blk * blk * d * b * h  # multiply-adds of one score tile over batch x heads
    assert cost.tile_loop_entries == {"forward": n, "backward": n}, cost.tile_loop_entries
    assert cost.tile_loop_flops == {"forward": 4 * tile * n, "backward": 10 * tile * n}
    assert not cost.warnings
    assert cost.tile_loop_groups == {f"forward {4 * tile}": n, f"backward {10 * tile}": n}
    counted = count_tiles(cost, calls=[KernelCall(1, 1, s, h, blk, blk, 13)], batch=b, head_dim=d)
    assert counted.attention_flops == pytest.approx((4 + 10) * tile * 13)
    assert counted.flops == pytest.approx(cost.flops + (4 + 10) * tile * (13 - n))
    assert counted.attention_calls == {"forward": 1, "backward": 1}
    assert counted.attention_head_calls == {"forward": b * h, "backward": b * h}
    assert counted.hbm_bytes == pytest.approx(cost.hbm_bytes + sum(cost.tile_loop_bytes.values()) * (13 / n - 1))


def test_a_step_of_local_and_global_layers_counts_each_kinds_tiles():
    """5 local layers (W 256) and 1 global over 2,048 tokens in tiles of 256 (8 query tiles): a global layer
    computes the 8 x 9 / 2 = 36 causal tiles, a local one 1 + 7 x 2 = 15 (query tile i sees key tiles i - 1 and
    i). Under full remat the step runs each layer's forward twice and its backward once; with 1 head per device
    (4 over `context` 4, by the all-to-all) and 1 sequence the attention work per device is (1 x 36 + 5 x 15)
    tiles x (2 x 4 + 10) x 256 x 256 x 32 FLOPs."""
    cfg = tiny_cfg(*GEMMA, "attention.window_exchange=all_to_all")
    assert layer_tiles(cfg) == [(1, 36), (5, 15)]
    assert layer_tiles(tiny_cfg(*GEMMA, "model.sliding_window=0")) == [(6, 36)]
    heads, nq, layers, tile = 1, 8, 6, 256 * 256 * 32
    hlo = Cost(flops=1e12, hbm_bytes=1e9,  # what hlo_cost reads: one tile per entry
               tile_loop_flops={"forward": 2 * layers * nq * 4 * tile * heads,
                                "backward": layers * nq * 10 * tile * heads},
               tile_loop_bytes={"forward": 2 * layers * nq * 1e6, "backward": layers * nq * 3e6},
               tile_loop_entries={"forward": 2 * layers * nq, "backward": layers * nq},
               tile_loop_groups={f"forward {4 * tile * heads}": 2 * layers * nq,
                                 f"backward {10 * tile * heads}": layers * nq},
               tile_loop_group_bytes={f"forward {4 * tile * heads}": 2 * layers * nq * 1e6,
                                      f"backward {10 * tile * heads}": layers * nq * 3e6})
    est = blockwise_attention_cost(hlo, cfg)
    by_hand = heads * (36 + 5 * 15) * (2 * 4 + 10) * tile
    assert est.attention_flops == pytest.approx(by_hand)
    assert est.flops == pytest.approx(1e12 - sum(hlo.tile_loop_flops.values()) + by_hand)
    assert est.hbm_bytes == pytest.approx(1e9 - sum(hlo.tile_loop_bytes.values()) + (2 * 1e6 + 3e6) * (36 + 5 * 15))
    assert est.attention_calls == {"forward": 2 * layers, "backward": layers}
    assert est.attention_head_calls == {"forward": 2 * layers * heads, "backward": layers * heads}
    every_global = blockwise_attention_cost(hlo, tiny_cfg(*GEMMA, "model.sliding_window=0"))
    assert every_global.attention_flops == pytest.approx(heads * 6 * 36 * 18 * tile)
    # packed documents leave a share of the global layers' tiles; local layers keep their window's
    half = blockwise_attention_cost(hlo, cfg, global_fraction=0.5)
    assert half.attention_flops == pytest.approx(heads * (18 + 5 * 15) * 18 * tile)
    with pytest.raises(ConfigError, match="tile fraction 0.0 must be in"):
        blockwise_attention_cost(hlo, cfg, global_fraction=0.0)
    ring = blockwise_attention_cost(hlo, tiny_cfg(*GEMMA, "mesh.ring=2", "mesh.context=1", "mesh.fsdp=1",
                                                  "mesh.num_devices=2", "global_batch=1"))
    assert ring.flops == hlo.flops and "mesh.ring=2" in ring.warnings[-1]


UPIPE = ("model.family=gemma3", "model.layers=6", "model.sliding_window_pattern=6", "model.sliding_window=64",
         "model.heads=8", "model.kv_heads=4", "model.head_dim=16", "seq_len=512", "attention.backend=blockwise",
         "attention.block_q=32", "attention.block_k=32", "data.packing=concat", "mesh.context=4", "mesh.fsdp=1",
         "mesh.num_devices=4", "global_batch=1", "remat.policy=full")


@pytest.mark.parametrize("impl,exchange", [pytest.param("upipe", "all_to_all", marks=pytest.mark.slow),
                                           pytest.param("upipe", "halo", marks=pytest.mark.slow),
                                           pytest.param("ulysses", "halo", marks=pytest.mark.slow)])
def test_a_windowed_train_step_counts_its_tiles_by_hand(impl, exchange):
    """A tiny Gemma 3 train step (CPU compile, 4 devices over `context`, 8 heads of 16, 512 tokens in tiles of 32:
    16 query tiles; 1 global layer, 5 local of W 64; full remat: 2 forward passes and 1 backward per layer). Its tile
    loops are found (U-Pipe's run inside its custom_vjp and stage scans, the halo's inside its own) and counted by
    hand, per device and pass: a global layer 16 x 17 / 2 = 136 causal tiles; a local one by the all-to-all
    1 + 2 + 14 x 3 = 45 tiles (query tile i sees key tiles i - 2 .. i); by the halo over `context` a call over the
    64 halo rows and its 128-token chunk, 6 query tiles: 1 + 2 + 4 x 3 = 15 tiles, with all 8 heads. U-Pipe (U = C
    = 4: 2 stages of 1 head per device) and Ulysses (2 heads per device) do the same all-to-all work."""
    cfg = tiny_cfg(*UPIPE, f"attention.impl={impl}", f"attention.window_exchange={exchange}")
    cost = hlo_cost(step_lib.compile_train_step(cfg, mesh_for(cfg, 4)).as_text(), 4)
    assert not [w for w in cost.warnings if "trip count" in w], cost.warnings
    # both shapes' tiles seen, forward and backward, where the halo's calls differ from the all-to-all's: a
    # conditional over the layer kinds counts one branch, its bytes per tile come from both
    assert len(cost.tile_loop_seen_entries) == (4 if exchange == "halo" else 2), cost.tile_loop_seen_entries
    est = blockwise_attention_cost(cost, cfg)
    assert not est.warnings, est.warnings
    tile = 2 * 32 * 32 * 16  # FLOPs of one matmul of a score tile and head
    local = (8, 15) if exchange == "halo" else (2, 45)  # (heads, tiles) of a local layer's calls per device
    per_pass = 1 * 2 * 136 + 5 * local[0] * local[1]  # head x tiles per pass over the 6 layers
    assert est.attention_flops == pytest.approx(per_pass * (2 * 2 + 5) * tile)
    calls = {"forward": 2, "backward": 1}
    stages = 2 if impl == "upipe" else 1  # calls of a layer by the all-to-all
    local_calls = 1 if exchange == "halo" else stages
    assert est.attention_calls == {k: n * (stages + 5 * local_calls) for k, n in calls.items()}
    assert est.attention_head_calls == {k: n * (2 + 5 * local[0]) for k, n in calls.items()}
    assert est.flops - est.attention_flops == pytest.approx(cost.flops - sum(cost.tile_loop_flops.values()))
    if exchange == "halo":
        assert kernel_calls(cfg)[1] == KernelCall(5, 1, 64 + 128, 8, 32, 32, 15)


def test_model_flops_count_a_local_layers_window():
    """Model FLOPs per token of attention: 12 x heads x head_dim per key, seq / 2 keys for a global layer,
    W - W (W - 1) / (2 seq) for a local one (the first window sees fewer)."""
    cfg = tiny_cfg(*GEMMA)
    per_key = 12 * 4 * 32
    assert window_model_flops_per_token(cfg) == pytest.approx(per_key * (1024 + 5 * (256 - 256 * 255 / 4096)))
    assert window_model_flops_per_token(tiny_cfg(*GEMMA, "model.sliding_window=0")) == 6 * 6 * 2048 * 4 * 32
