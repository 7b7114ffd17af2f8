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

Keeping attention (`remat.keep_attention=N`, with `full` or `offload`): the first N layers also keep their
attention output and its log-sum-exp (the softmax statistic of every query row), in pinned host memory
(`remat.keep_attention_memory=host`) or on the device. Every differentiable attention op (the kernels' own
`custom_vjp`s under Ulysses, ring attention's, U-Pipe's) tags the two tensors of its saved residuals
(`jaxlong.core.kept.keep_attention_residuals`); the policy keeps them, so the backward's recomputation of the
layer finds them and its attention forward (a function of q, k, v whose outputs are all kept) is dead code:
each kept layer runs attention forward once per step instead of twice, and the kernel's backward takes the kept
output and lse (FlashAttention-2, arXiv 2307.08691, Alg. 2 needs only q, k, v, out, lse and dout). The output
is `[b, S/C, heads, head_dim]` per device, the size of the layer input when heads x head_dim = hidden; the lse
is `[b, heads/C, S]` float32. The recomputation still projects q, k, v (cheap, and the backward needs them).
MEMO (arXiv 2407.12117) and FPDT (arXiv 2408.16978) keep attention's results the same way. With U-Pipe the
policy keeps the op's output buffer, so the op does not move it to the host itself (`offloads_attention_output`).

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

import math
from dataclasses import dataclass, field
from typing import Literal, get_args

import jax
from jax.ad_checkpoint import checkpoint_name

from jaxlong.core.errors import ConfigError, check_choice
from jaxlong.core.kept import KEPT_NAMES

RematPolicy = Literal["none", "full", "save_dots", "offload", "custom"]  # `remat.policy`
POLICIES = get_args(RematPolicy)


@dataclass
class RematConfig:
    """Activation checkpointing of the scanned decoder layer."""

    policy: RematPolicy = "none"
    save: list[str] = field(default_factory=list)  # custom: names kept on device
    offload: list[str] = field(default_factory=list)  # custom: names moved to pinned host memory
    offload_every: int = 1  # offload: keep every k-th layer input on host, recompute the groups (grouped checkpointing)
    keep_attention: int = 0  # full/offload: the first N layers keep attention output + lse (forward runs once)
    keep_attention_memory: str = "host"  # where they are kept: "host" (pinned host memory) or "device"


def check_remat(r: RematConfig, layers: int) -> None:
    """The remat section: a policy jaxlong has, and `offload_every` and `keep_attention` within the model's
    `layers` under that policy (`check_offload_every`, `check_keep_attention`).

    Raises:
      ConfigError: naming the `remat.*` option, its value and what would work.
    """
    check_choice("remat.policy", r.policy, RematPolicy)
    check_offload_every(r.offload_every, r.policy, layers)
    check_keep_attention(r.keep_attention, r.keep_attention_memory, r.policy, layers)


LAYER_INPUT = "layer_input"
GROUP_INPUT = "group_input"  # [b, s, hidden] the input of a group of `remat.offload_every` layers
KEEP_MEMORY = ("host", "device")  # `remat.keep_attention_memory`
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


def make_policy(cfg, keep: bool = False):
    """The `jax.checkpoint` policy for `cfg.policy` (`cfg`: a `jaxlong.config.RematConfig`), or None for `none`;
    `keep`: the layer keeps its attention output and lse (`KEPT_NAMES`) in `cfg.keep_attention_memory`.

    Raises:
      ConfigError: unknown policy, or a `custom` name that the layer does not tag.
    """
    policies = jax.checkpoint_policies
    if cfg.policy == "none":
        return None
    if keep:
        host = cfg.keep_attention_memory == "host"
        saved = ([] if host else list(KEPT_NAMES))
        offloaded = (list(KEPT_NAMES) if host else []) + ([LAYER_INPUT] if cfg.policy == "offload" else [])
        return _save_offload(saved, offloaded)
    if cfg.policy == "full":
        return policies.nothing_saveable
    if cfg.policy == "save_dots":
        return policies.checkpoint_dots_with_no_batch_dims
    if cfg.policy == "offload":
        return _save_offload([], [LAYER_INPUT])
    if cfg.policy == "custom":
        for key, names in (("remat.save", cfg.save), ("remat.offload", cfg.offload)):
            unknown = sorted(set(names) - set(NAMES))
            if unknown:
                raise ConfigError(f"{key}: unknown tensor names {unknown}; the layer tags: {', '.join(NAMES)} "
                                  f"(the attention ones with attention.impl=ulysses only)")
        return _save_offload(list(cfg.save), list(cfg.offload))
    raise ConfigError(f"remat.policy={cfg.policy!r}; choose one of: {', '.join(POLICIES)}")


def offloads_attention_output(cfg, keep: bool = False) -> bool:
    """Whether U-Pipe keeps its output buffer (the attention output before W_o, the op's saved residual) in pinned
    host memory from its forward to its backward: with `remat.policy=offload` (`cfg`: a
    `jaxlong.config.RematConfig`), in a layer that does not keep its attention (`keep`; the policy then keeps
    the buffer, where `remat.keep_attention_memory` says)."""
    return cfg.policy == "offload" and not keep


def check_keep_attention(keep: int, memory: str, policy: str, layers: int) -> None:
    """Validate `remat.keep_attention` (layers, from the first, whose attention output and lse are kept) and
    `remat.keep_attention_memory` for `remat.policy` and `model.layers`.

    Raises:
      ConfigError: a count outside [0, layers], an unknown memory, or keeping with a policy that does not
        recompute the layer (only `full` and `offload` rerun attention in the backward).
    """
    at = dict(key="remat.keep_attention", value=keep)
    if not isinstance(keep, int) or isinstance(keep, bool) or not 0 <= keep <= layers:
        raise ConfigError(f"remat.keep_attention={keep!r} must be an integer from 0 (none) to model.layers={layers} "
                          f"(every layer keeps its attention output and log-sum-exp)", **at)
    if memory not in KEEP_MEMORY:
        raise ConfigError(f"remat.keep_attention_memory={memory!r}; choose one of: {', '.join(KEEP_MEMORY)}")
    if keep and policy not in ("full", "offload"):
        raise ConfigError(f"remat.keep_attention={keep} keeps what the backward's recomputation of a layer would "
                          f"run again, and needs remat.policy=full or offload (got {policy!r})", keys=("remat.policy",),
                          **at)


def check_offload_every(offload_every: int, policy: str, layers: int) -> None:
    """Validate `remat.offload_every` (grouped checkpointing) for `remat.policy` and `model.layers`.

    Raises:
      ConfigError: k < 1, k > 1 with a policy other than `offload`, or k larger than the layer count.
    """
    at = dict(key="remat.offload_every", value=offload_every)
    if not isinstance(offload_every, int) or offload_every < 1:
        raise ConfigError(f"remat.offload_every={offload_every!r} must be an integer >= 1 (1: every layer input is "
                          f"offloaded; k: one input per group of k layers, the groups recomputed)", **at)
    if offload_every > 1 and policy != "offload":
        raise ConfigError(f"remat.offload_every={offload_every} groups offloaded layer inputs and needs "
                          f"remat.policy=offload (got {policy!r})", keys=("remat.policy",), **at)
    if offload_every > layers:
        raise ConfigError(f"remat.offload_every={offload_every} exceeds model.layers={layers} (host memory is least "
                          f"near k = sqrt(model.layers))", keys=("model.layers",), **at)


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


def remat(fn, cfg, keep: bool = False):
    """Wrap a scan body `fn(carry, xs)` in `jax.checkpoint` with the configured policy (identity for `none`);
    `keep`: the policy also keeps the attention output and lse (`remat.keep_attention`)."""
    if cfg.policy == "none":
        return fn
    return jax.checkpoint(fn, policy=make_policy(cfg, keep), prevent_cse=False)


def _save_offload(saved: list[str], offloaded: list[str]):
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=saved, names_which_can_be_offloaded=offloaded, offload_src="device",
        offload_dst="pinned_host")


def scan_layers(layer, x: jax.Array, stacked, cfg, group_params=None, keep_layer=None, kinds=None,
                output_offload: bool = False) -> jax.Array:
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

    `keep_layer`: the layer as it runs where it keeps its attention (`cfg.keep_attention` > 0; the model's
    layer with U-Pipe's own output offload off, the policy keeping that buffer instead). The first
    `cfg.keep_attention` layers run `keep_layer` under the policy that also keeps their attention output and
    lse (`make_policy(cfg, keep=True)`), the others `layer`; with grouped checkpointing each part is grouped
    on its own. When only some layers keep, the two parts' parameters are sliced apart (after `group_params`,
    so a copy in the compute dtype).

    `kinds`: each layer's kind (Python ints, `[layers]`) where the layers are of more than one kind; `stacked` is
    then `(params, kinds as int32 [layers])` and the layer switches on its traced kind, or, where it offloads to host
    memory from inside attention, takes its kind as a Python int in a scan over the kinds' period (`_scan_part`).
    `output_offload`: the attention op itself moves its output to host memory under `offload` in layers that do
    not keep their attention (U-Pipe, `offloads_attention_output`).

    Returns the output of the last layer `[batch, seq, hidden]`.
    """
    n = jax.tree.leaves(stacked)[0].shape[0]
    keep = min(cfg.keep_attention, n) if cfg.policy in ("full", "offload") else 0
    if not keep:
        return _scan_part(layer, x, stacked, cfg, group_params, keep=False, kinds=kinds, output_offload=output_offload)
    if keep == n:
        return _scan_part(keep_layer, x, stacked, cfg, group_params, keep=True, kinds=kinds)
    cast = group_params or (lambda p: p)
    params = cast(stacked)
    x = _scan_part(keep_layer, x, jax.tree.map(lambda a: a[:keep], params), cfg, None, keep=True,
                   kinds=kinds and kinds[:keep])
    return _scan_part(layer, x, jax.tree.map(lambda a: a[keep:], params), cfg, None, keep=False,
                      kinds=kinds and kinds[keep:], output_offload=output_offload)


def kind_period(kinds) -> int:
    """The shortest p with `kinds[i] == kinds[i % p]` for every layer i (1 for one kind; Gemma 3's 5:1 pattern: 6)."""
    return next(p for p in range(1, len(kinds) + 1) if all(kinds[i] == kinds[i % p] for i in range(len(kinds))))


def _at(tree, i):
    return jax.tree.map(lambda a: a[i], tree)


def _scan_part(layer, x, stacked, cfg, group_params, keep: bool, kinds=None, output_offload=False) -> jax.Array:
    """`scan_layers` over one part of the stack, every layer keeping its attention or none (`keep`); `kinds`: the
    part's layer kinds (Python ints) where the model mixes them.

    The scan runs over blocks of B layers: one layer (B = 1), or with grouped checkpointing one group of k. Where the
    layers offload to host memory from inside attention (kept attention in host memory; U-Pipe's output buffer under
    `offload`, `output_offload`; a `custom` policy's offloaded names) and the model mixes kinds, each layer's kind
    is a Python int instead (XLA:GPU cannot offload from inside the kind's `lax.switch`): B is then the least common
    multiple of k and the kinds' period, so every block starts at a multiple of the period and its i-th layer is of
    kind `kinds[i]`. A block's layers are unrolled in its body (Gemma 3 with k = 1: 6 layers), and the `n % B`
    layers left over run after the scan as one more, shorter block. Where B > k, XLA:GPU keeps some of what the
    block's groups offload on the device (docs/windows.md)."""
    k = cfg.offload_every if cfg.policy == "offload" else 1
    inner = remat(layer, cfg, keep)
    host_kept = keep and cfg.keep_attention_memory == "host"
    offloads = (host_kept or (output_offload and offloads_attention_output(cfg, keep))
                or (cfg.policy == "custom" and bool(cfg.offload)))
    static = kinds is not None and offloads
    if k == 1 and not static:
        return jax.lax.scan(inner, x, stacked)[0]
    by_kind = {kind: remat(lambda c, xs, kind=kind: layer(c, (xs[0], kind)), cfg, keep)
               for kind in set(kinds)} if static else {}

    # Kept attention under grouping. In host memory: the group keeps its layers' attention output and lse in host
    # memory for the whole step (with its input), so neither the group's recomputation nor a layer's runs the
    # attention forward again. Its k layers are then unrolled in the group (XLA cannot offload a residual that a
    # scan nested in the group's scan stacks), each under the layer's own policy. On the device: the group saves
    # them too, and its inner scan stays.
    def layers(carry, params, first: int):
        """The layers of `params` (leading axis), the first being the block's `first`-th."""
        if not static and not host_kept:  # (here k > 1: one layer per block returned above)
            return jax.lax.scan(inner, carry, params)[0]
        for i in range(jax.tree.leaves(params)[0].shape[0]):
            carry = (by_kind[kinds[first + i]] if static else inner)(carry, _at(params, i))[0]
        return carry

    if host_kept:
        outer_policy = _save_offload([], [GROUP_INPUT, *KEPT_NAMES])
    elif keep:
        outer_policy = _save_offload(list(KEPT_NAMES), [GROUP_INPUT])
    else:
        outer_policy = _save_offload([], [GROUP_INPUT])
    cast = group_params or (lambda p: p)

    def group(carry, params, first: int):
        if k == 1:
            return layers(carry, params, first)

        def body(carry, params):
            return layers(checkpoint_name(carry, GROUP_INPUT), cast(params), first)
        return jax.checkpoint(body, policy=outer_policy, prevent_cse=False)(carry, params)

    def block(carry, params):
        size = jax.tree.leaves(params)[0].shape[0]
        for g in range(0, size, k):
            carry = group(carry, jax.tree.map(lambda a: a[g: g + k], params), g)
        return carry

    n = jax.tree.leaves(stacked)[0].shape[0]
    b = math.lcm(k, kind_period(kinds)) if static else k
    blocks, rest = divmod(n, b)
    if blocks:
        head = jax.tree.map(lambda a: a[: blocks * b].reshape(blocks, b, *a.shape[1:]), stacked)
        x = jax.lax.scan(lambda c, p: (block(c, p), None), x, head)[0]
    if rest:
        x = block(x, jax.tree.map(lambda a: a[blocks * b:], stacked))
    return x
