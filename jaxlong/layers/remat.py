"""Activation checkpointing (remat) policies for the scanned decoder layer.

Tensors inside the layer are tagged with `jax.ad_checkpoint.checkpoint_name` (see `NAMES`); a policy says
which of them the backward pass may keep (on device or in pinned host memory) instead of recomputing.

  none       no remat: autodiff keeps every residual of every layer.
  full       keep only each layer's input (the scan carry); recompute the rest in the backward pass.
  save_dots  keep matmul outputs without batch dimensions (`checkpoint_dots_with_no_batch_dims`),
             recompute norms, RoPE, activations and attention.
  offload    like `full`, but the saved layer input lives in pinned host memory and is brought back for the
             layer's backward (ALST, arXiv 2506.13996, §3.4).
  custom     `remat.save` names are kept on device, `remat.offload` names go to pinned host memory.

The layer input is the scan carry; it can only be offloaded because the layer names it inside the remat'd
body (jax#23869).
"""

from __future__ import annotations

from typing import Literal, get_args

import jax

from jaxlong.core.errors import ConfigError

RematPolicy = Literal["none", "full", "save_dots", "offload", "custom"]  # `remat.policy`
POLICIES = get_args(RematPolicy)

LAYER_INPUT = "layer_input"
# The attention sublayer's tensors (tagged by the Ulysses sublayer; U-Pipe computes them inside its op).
ATTENTION_NAMES = (
    "attn_norm_out",  # [b, s, hidden]
    "query_proj",  # [b, s, heads, head_dim], after RoPE
    "key_proj",  # [b, s, kv_heads, head_dim], after RoPE
    "value_proj",  # [b, s, kv_heads, head_dim]
    "attn_out",  # [b, s, heads, head_dim], before W_o
)
NAMES = (
    LAYER_INPUT,  # [b, s, hidden] residual stream entering the layer
    *ATTENTION_NAMES,  # with attention.impl=ulysses only
    "mlp_norm_out",  # [b, s, hidden]
    "mlp_hidden",  # [b, s, mlp_hidden], silu(gate) * up; not with tiling.mlp (the tiles recompute it)
)


def make_policy(cfg):
    """The `jax.checkpoint` policy for `cfg.policy` (`cfg`: a `jaxlong.config.RematConfig`), or None for `none`.

    Raises:
      ConfigError: unknown policy, or a `custom` name that the layer does not tag.
    """
    policies = jax.checkpoint_policies
    if cfg.policy == "none":
        return None
    if cfg.policy == "full":
        return policies.nothing_saveable
    if cfg.policy == "save_dots":
        return policies.checkpoint_dots_with_no_batch_dims
    if cfg.policy == "offload":
        return policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=[LAYER_INPUT],
            offload_src="device",
            offload_dst="pinned_host",
        )
    if cfg.policy == "custom":
        for key, names in (("remat.save", cfg.save), ("remat.offload", cfg.offload)):
            unknown = sorted(set(names) - set(NAMES))
            if unknown:
                raise ConfigError(f"{key}: unknown tensor names {unknown}; the layer tags: {', '.join(NAMES)} "
                                  f"(the attention ones with attention.impl=ulysses only)")
        return policies.save_and_offload_only_these_names(
            names_which_can_be_saved=list(cfg.save),
            names_which_can_be_offloaded=list(cfg.offload),
            offload_src="device",
            offload_dst="pinned_host",
        )
    raise ConfigError(f"remat.policy={cfg.policy!r}; choose one of: {', '.join(POLICIES)}")


def remat(fn, cfg):
    """Wrap a scan body `fn(carry, xs)` in `jax.checkpoint` with the configured policy (identity for `none`)."""
    policy = make_policy(cfg)
    if cfg.policy == "none":
        return fn
    return jax.checkpoint(fn, policy=policy, prevent_cse=False)
