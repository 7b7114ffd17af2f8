"""Remat policies: what each keeps for the backward pass (saved residuals), offload to host memory, and
equality of loss and gradients with the single-device model."""

import pytest
from helpers import assert_matches_single_device, mesh_for, pairwise, random_batch, tiered, tiny_cfg

from jaxlong.config import runtime
from jaxlong.config import ConfigError, RematConfig
from jaxlong.layers.remat import default_offload_every, host_layer_inputs, make_policy
from jaxlong.models import llama as model_lib
from jaxlong.training import step as step_lib
from jaxlong.objectives.base import loss_sum

try:  # public in newer JAX; JAX 0.10 exposes only print_saved_residuals publicly
    from jax.ad_checkpoint import saved_residuals
except ImportError:
    from jax._src.ad_checkpoint import saved_residuals

BASE = ("mesh.fsdp=2", "mesh.context=4", "model.layers=3")


def _stacked_residuals(policy: str, *extra: str):
    """Residuals of the layer scan (leading dim = layers) kept for the backward pass: [(shape, on_host)]."""
    cfg = tiny_cfg(*BASE, f"remat.policy={policy}", *extra)
    mesh = mesh_for(cfg, 8)
    params = step_lib.init_state(cfg, mesh)["params"]
    graphdef, rt = model_lib.model_graphdef(cfg.model, cfg.param_dtype), runtime(cfg, mesh)
    batch = random_batch(cfg)
    res = saved_residuals(lambda p: loss_sum(p, batch, graphdef, rt), params)
    out = []
    for aval, desc in res:
        if "output of scan" in desc and aval.shape and aval.shape[0] == cfg.model.layers:
            out.append((tuple(aval.shape), "<host>" in aval.str_short()))
    return cfg, out


def test_full_keeps_only_layer_inputs():
    cfg, res = _stacked_residuals("full")
    b, s, h = cfg.global_batch, cfg.seq_len, cfg.model.hidden
    assert res == [((cfg.model.layers, b, s, h), False)]


def test_none_keeps_layer_internals():
    cfg, res = _stacked_residuals("none")
    shapes = {shape for shape, _ in res}
    L, b, s, m = cfg.model.layers, cfg.global_batch, cfg.seq_len, cfg.model
    assert (L, b, s, m.mlp_hidden) in shapes  # MLP intermediates
    assert (L, b, s, m.heads, m.head_dim) in shapes  # queries after RoPE
    assert len(res) > 5


def test_save_dots_keeps_matmul_outputs_not_elementwise():
    cfg, res = _stacked_residuals("save_dots")
    _, res_none = _stacked_residuals("none")
    shapes = [shape for shape, _ in res]
    L, b, s, m = cfg.model.layers, cfg.global_batch, cfg.seq_len, cfg.model
    assert shapes.count((L, b, s, m.mlp_hidden)) == 2  # gate and up projections; silu(gate)*up is recomputed
    assert len(res) < len(res_none)


def test_offload_moves_layer_inputs_to_pinned_host():
    cfg, res = _stacked_residuals("offload")
    b, s, h = cfg.global_batch, cfg.seq_len, cfg.model.hidden
    assert res == [((cfg.model.layers, b, s, h), True)]  # the only stacked residual, in host memory


def test_custom_policy_saves_and_offloads_named_tensors():
    cfg, res = _stacked_residuals("custom", "remat.save=[query_proj]", "remat.offload=[layer_input]")
    L, b, s, m = cfg.model.layers, cfg.global_batch, cfg.seq_len, cfg.model
    assert ((L, b, s, m.heads, m.head_dim), False) in res
    assert ((L, b, s, m.hidden), True) in res
    assert len(res) == 2


def test_custom_policy_rejects_unknown_names():
    with pytest.raises(ConfigError, match="unknown tensor names \\['qproj'\\]"):
        make_policy(RematConfig(policy="custom", save=["qproj"]))


@pytest.mark.parametrize(*tiered("policy", ["save_dots", "offload", "custom"], ids=["save_dots", "offload", "custom"],
                                 fast={"offload"}))
def test_policies_leave_loss_and_gradients_unchanged(policy):
    extra = ("remat.save=[attn_out]", "remat.offload=[mlp_hidden]") if policy == "custom" else ()
    cfg = tiny_cfg(*BASE, f"remat.policy={policy}", *extra)
    assert_matches_single_device(cfg, seed=7)


# Grouped checkpointing: `remat.offload_every=k` with `remat.policy=offload` (jaxlong.layers.remat.scan_layers).


def _host_residuals(*extra: str) -> tuple[object, list[tuple[int, ...]]]:
    """The config and the shapes of the residuals the backward pass keeps in host memory."""
    cfg = tiny_cfg(*BASE, "remat.policy=offload", *extra)
    mesh = mesh_for(cfg, 8)
    params = step_lib.init_state(cfg, mesh)["params"]
    graphdef, rt = model_lib.model_graphdef(cfg.model, cfg.param_dtype), runtime(cfg, mesh)
    res = saved_residuals(lambda p: loss_sum(p, random_batch(cfg), graphdef, rt), params)
    return cfg, [tuple(a.shape) for a, _ in res if "<host>" in a.str_short()]


@pytest.mark.parametrize("layers,k,expected", [(5, 2, [(2,), ()]), (6, 3, [(2,)]), (5, 5, [(1,)])],
                         ids=["5-layers-k2", "6-layers-k3", "5-layers-k5"])
def test_grouped_offload_keeps_one_input_per_group_on_host(layers, k, expected):
    """With offload_every=k the host keeps ceil(L/k) layer inputs: a stacked one per whole group (leading dim
    `layers // k`) and one for the last, smaller group when k does not divide L; plain offload keeps L."""
    cfg, host = _host_residuals(f"model.layers={layers}", f"remat.offload_every={k}")
    act = (cfg.global_batch, cfg.seq_len, cfg.model.hidden)
    assert sorted(host, key=len, reverse=True) == [(*lead, *act) for lead in expected]
    _, plain = _host_residuals(f"model.layers={layers}")
    assert plain == [(layers, *act)]


def test_offload_every_is_checked_before_compiling():
    with pytest.raises(ConfigError, match="needs remat.policy=offload"):
        tiny_cfg(*BASE, "remat.policy=full", "remat.offload_every=2")
    with pytest.raises(ConfigError, match="must be an integer >= 1"):
        tiny_cfg(*BASE, "remat.policy=offload", "remat.offload_every=0")
    with pytest.raises(ConfigError, match="exceeds model.layers=3"):
        tiny_cfg(*BASE, "remat.policy=offload", "remat.offload_every=4")


def test_group_size_default_and_host_inputs():
    """The ladder's and --fit's group size: the divisor of L with the fewest host inputs ceil(L/k) + k."""
    assert [(n, default_offload_every(n)) for n in (3, 4, 8, 32, 36, 64, 80)] == [
        (3, 1), (4, 1), (8, 2), (32, 4), (36, 6), (64, 8), (80, 8)]
    assert host_layer_inputs(32, 1) == 32 and host_layer_inputs(32, 4) == 12 and host_layer_inputs(5, 2) == 5


GROUPED_METHODS = {
    "ulysses": ("mesh.fsdp=2", "mesh.context=4"),
    "upipe": ("mesh.fsdp=2", "mesh.context=4", "attention.impl=upipe", "attention.heads_per_stage=4"),
    "ring": ("mesh.fsdp=2", "mesh.ring=2", "mesh.context=2", "data.packing=concat"),
}


@pytest.mark.parametrize(*pairwise({"method": list(GROUPED_METHODS), "k": [2, 3]}, fast=[("upipe", 2)], cover=False))
def test_grouped_offload_leaves_loss_and_gradients_unchanged(method, k):
    """Loss and every gradient with offload_every=k over 4 layers (k = 2 divides them; k = 3 leaves a group of
    one) equal the dense single-device reference, under Ulysses, U-Pipe and ring attention."""
    cfg = tiny_cfg(*GROUPED_METHODS[method], "model.layers=4", "remat.policy=offload", f"remat.offload_every={k}")
    assert_matches_single_device(cfg, seed=7)
