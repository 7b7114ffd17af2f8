"""Activation checkpointing (remat) policies for the scanned decoder layer.

Tensors inside the layer are tagged with `jax.ad_checkpoint.checkpoint_name` (see `NAMES`); a policy says
which of them the backward pass may keep (on device or in pinned host memory) instead of recomputing.

  none       no remat: autodiff keeps every residual of every layer.
  full       keep only each layer's input (the scan carry); recompute the rest in the backward pass.
  save_dots  keep matmul outputs without batch dimensions (`checkpoint_dots_with_no_batch_dims`),
             recompute norms, RoPE, activations and attention.
  offload    like `full`, but the saved layer input lives in pinned host memory and is brought back for the
             layer's backward (ALST, arXiv 2506.13996, §3.4); with U-Pipe, its output buffer (`attn_out`) also
             waits for its backward in pinned host memory (`offloads_attention_output`).
  custom     `remat.save` names are kept on device, `remat.offload` names go to pinned host memory.

Grouped (hierarchical) checkpointing, `remat.offload_every=k` with `offload` (`scan_layers`): the layer scan
runs over groups of k layers and only each group's input stays in host memory for the whole step. The backward
pass recomputes a group's forward from that input (its k layer inputs go to host memory, one group at a time),
then each layer's backward recomputes that layer from its input as `offload` does. Host memory per device falls
from L layer inputs to ceil(L/k) + k of them (least near k = sqrt(L)); the cost is one more forward of every layer
(4 forwards per step's 3 of model FLOPs become 5: 1.25x `offload`'s recompute factor). The nesting of
`jax.checkpoint` follows Chen et al., "Training Deep Nets with Sublinear Memory Cost", arXiv 1604.06174, §4
(recursive checkpointing of segments).

The layer input is the scan carry; it can only be offloaded because the layer names it inside the remat'd
body (jax#23869).
"""

from __future__ import annotations

from typing import Literal, get_args

import jax
from jax.ad_checkpoint import checkpoint_name

from jaxlong.core.errors import ConfigError

RematPolicy = Literal["none", "full", "save_dots", "offload", "custom"]  # `remat.policy`
POLICIES = get_args(RematPolicy)

LAYER_INPUT = "layer_input"
GROUP_INPUT = "group_input"  # [b, s, hidden] the input of a group of `remat.offload_every` layers
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
    "mlp_norm_out",  # [b, s, hidden]; not with tiling.mlp (the tiles normalize their own tokens)
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
        return _offload_only(LAYER_INPUT)
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


def offloads_attention_output(cfg) -> bool:
    """Whether U-Pipe keeps its output buffer (the attention output before W_o, the op's saved residual) in pinned
    host memory from its forward to its backward: with `remat.policy=offload` (`cfg`: a
    `jaxlong.config.RematConfig`)."""
    return cfg.policy == "offload"


def check_offload_every(offload_every: int, policy: str, layers: int) -> None:
    """Validate `remat.offload_every` (grouped checkpointing) for `remat.policy` and `model.layers`.

    Raises:
      ConfigError: k < 1, k > 1 with a policy other than `offload`, or k larger than the layer count.
    """
    if not isinstance(offload_every, int) or offload_every < 1:
        raise ConfigError(f"remat.offload_every={offload_every!r} must be an integer >= 1 (1: every layer input is "
                          f"offloaded; k: one input per group of k layers, the groups recomputed)")
    if offload_every > 1 and policy != "offload":
        raise ConfigError(f"remat.offload_every={offload_every} groups offloaded layer inputs and needs "
                          f"remat.policy=offload (got {policy!r}); set remat.policy=offload or remat.offload_every=1")
    if offload_every > layers:
        raise ConfigError(f"remat.offload_every={offload_every} exceeds model.layers={layers}; use a k from 2 to "
                          f"{layers} (host memory is least near k = sqrt(layers) = {max(2, round(layers ** 0.5))})")


def default_offload_every(layers: int) -> int:
    """The group size k for grouped checkpointing that keeps the fewest layer inputs on host, ceil(L/k) + k,
    among the divisors of `layers` (no parameter copy; ties to the smaller k: fewer layers recomputed at once).
    Returns 1 when no k > 1 keeps fewer than the L inputs of plain `offload`."""
    best = min((d for d in range(2, layers + 1) if layers % d == 0), key=lambda d: (layers // d + d, d), default=1)
    return best if best > 1 and layers // best + best < layers else 1


def host_layer_inputs(layers: int, offload_every: int) -> int:
    """Layer inputs `[b, S/C, hidden]` per device in host memory at the peak with `remat.policy=offload` and
    `remat.offload_every=k`: L for k = 1, else ceil(L/k) group inputs plus the k inputs of the group being
    recomputed (an upper bound: XLA may share the group's first input with its group input)."""
    if offload_every <= 1:
        return layers
    return -(-layers // offload_every) + offload_every


def remat(fn, cfg):
    """Wrap a scan body `fn(carry, xs)` in `jax.checkpoint` with the configured policy (identity for `none`)."""
    policy = make_policy(cfg)
    if cfg.policy == "none":
        return fn
    return jax.checkpoint(fn, policy=policy, prevent_cse=False)


def _offload_only(name: str):
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=[name], offload_src="device",
        offload_dst="pinned_host")


def scan_layers(layer, x: jax.Array, stacked, cfg, group_params=None) -> jax.Array:
    """Run `x` through the stacked decoder layers with the remat policy of `cfg` (a `jaxlong.config.RematConfig`).

    `layer(carry, layer_params) -> (carry, None)` is one decoder layer on `x` `[batch, seq, hidden]`; `stacked`
    holds every layer's parameters on a leading `[layers]` axis. With `cfg.policy=offload` and
    `cfg.offload_every=k > 1`, grouped checkpointing (module docstring): a scan over the `layers // k` groups
    (stacked parameters reshaped to `[groups, k, ...]`, no copy), each group `jax.checkpoint`-ed with only its
    input offloaded, inside it a scan over its k layers each remat'd by `offload`; when k does not divide the
    layer count the last `layers % k` layers form one more, smaller group (their parameters are sliced off: a
    copy of the stacked parameters' shard for the step). Otherwise one scan over the layers, each remat'd by
    `cfg.policy`.

    `group_params`: with grouped checkpointing, a function applied to a group's `[k, ...]` parameters before
    its inner scan. The outer scan copies each group's slice for the inner one (one more `[k, ...]` buffer, and
    one for its gradients): the model passes a cast of the weight matrices to the compute dtype, which the
    layer applies anyway, so both buffers are half the size (0.2 GiB less per device for Llama-3.1-8B, k = 4,
    FSDP over 8) and values and gradients are unchanged.

    Returns the output of the last layer `[batch, seq, hidden]`.
    """
    k = cfg.offload_every
    inner = remat(layer, cfg)
    if cfg.policy != "offload" or k <= 1:
        return jax.lax.scan(inner, x, stacked)[0]

    cast = group_params or (lambda p: p)

    def group(carry, params):
        carry = checkpoint_name(carry, GROUP_INPUT)
        return jax.lax.scan(inner, carry, cast(params))[0], None

    outer = jax.checkpoint(group, policy=_offload_only(GROUP_INPUT), prevent_cse=False)
    n = jax.tree.leaves(stacked)[0].shape[0]
    groups, rest = divmod(n, k)
    if groups:
        if rest:
            head = jax.tree.map(lambda a: a[: groups * k], stacked)
        else:
            head = stacked
        head = jax.tree.map(lambda a: a.reshape(groups, k, *a.shape[1:]), head)
        x = jax.lax.scan(outer, x, head)[0]
    if rest:
        x = outer(x, jax.tree.map(lambda a: a[groups * k:], stacked))[0]
    return x
