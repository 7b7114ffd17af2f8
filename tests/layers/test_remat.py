"""Remat policies: what each keeps for the backward pass (saved residuals), offload to host memory, and
equality of loss and gradients with the single-device model."""

import pytest
from helpers import assert_matches_single_device, mesh_for, random_batch, tiered, tiny_cfg

from jaxlong.config import ConfigError, RematConfig
from jaxlong.layers.remat import make_policy
from jaxlong.models import llama as model_lib
from jaxlong.training import step as step_lib

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
    graphdef, rt = model_lib.model_graphdef(cfg), model_lib.Runtime(mesh=mesh, cfg=cfg)
    batch = random_batch(cfg)
    res = saved_residuals(lambda p: step_lib.loss_fn(p, batch, graphdef, rt), params)
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
