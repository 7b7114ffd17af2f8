"""Sequence tiling: the output projection + cross-entropy, and the SwiGLU MLP, over tiles of tokens.

Both ops keep their largest intermediates for one tile of tokens at a time, in the forward pass *and* in the
backward pass (ALST, arXiv 2506.13996, §3.2-3.3: tiled loss and tiled MLP):

- `tiled_cross_entropy` never materializes `[batch, seq, vocab]` logits: a `lax.scan` over sequence tiles
  projects one tile to float32 logits `[batch, tile, vocab]`, reduces it to per-token log-sum-exp and
  target logit, and moves on. Its `custom_vjp` saves only the inputs and the per-token lse `[batch, seq]`
  (float32); the backward is a second scan that recomputes each tile's logits, forms
  `softmax - onehot(target)` in place and accumulates d_head `[hidden, vocab]` in float32.
  Sources: ALST (Arctic Long Sequence Training, arXiv 2506.13996) §3.2, sequence tiling of the logits and
  loss (its `TiledCompute`); Liger Kernel's chunked fused linear cross-entropy (arXiv 2410.10989).
- `tiled_mlp` runs `(silu(x W_gate) * (x W_up)) W_down` over sequence tiles; a `custom_vjp` saves only x and
  the weights, and its backward scan recomputes one tile's `[batch, tile, mlp_hidden]` intermediates at a
  time, accumulating the weight gradients in float32. Source: ALST §3.3, tiled MLP (default tile count
  `ceil(seq / hidden)`).

Both hand-written backward passes matter: a plain `lax.scan` differentiated by autodiff stacks every tile's
residuals and gives back all the memory tiling saved.

Sharding. With `mesh=None` the ops run on whatever arrays they get (tiles along axis 1). With a mesh (axes
`data`, `fsdp`, `context`), activations `[batch, seq, ...]` are laid out `P(('data', 'fsdp'), 'context')`
and the weights are replicated (gathered); the op runs inside `jax.shard_map`, so tiles are taken along each
device's *local* sequence (`seq / mesh.context` tokens). Replicated weights are marked varying
(`lax.pcast`), so the shard_map transpose sums their per-device cotangents; the backward never sums them
itself (shard_map with `check_vma`: the transpose of a varying use is a `psum`). The loss sum and the
valid-token count are `psum`med over all mesh axes.

Option names used in error messages (suggested config keys): `tiling.loss_tile` (tokens per loss tile) and
`tiling.mlp_tiles` (number of MLP tiles per local sequence).
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxlong.core.errors import ConfigError
from jaxlong.core.mesh import BATCH_AXES, seq_axes, seq_shards
from jaxlong.core.ordering import zeros_after
from jaxlong.core.units import MiB
from jaxlong.layers.blocks import gate_activation, rms_norm
from jaxlong.layers.loss import effective_mask

DEFAULT_LOSS_BUDGET_BYTES = 256 * MiB


@dataclass
class TilingConfig:
    """Sequence tiling (ALST §3.2-3.3): loss and MLP over tiles of the local sequence, recomputed in the
    backward pass, so `[S/C, vocab]` logits and `[S/C, mlp_hidden]` intermediates never exist at once."""

    loss: bool = False
    loss_tile: int = 0  # tokens per loss tile; 0 derives it from a 256 MiB float32 logits budget
    mlp: bool = False
    mlp_tiles: int = 0  # tiles per local sequence; 0 means ceil(S_local / hidden) as in ALST


def check_tiling(t: TilingConfig) -> None:
    """The tiling section's own rule: tile settings >= 0 (0: the derived default). That they divide each device's
    sequence is `jaxlong.config.validate`'s (it knows the mesh).

    Raises:
      ConfigError: a negative `tiling.loss_tile` or `tiling.mlp_tiles`.
    """
    if t.loss_tile < 0 or t.mlp_tiles < 0:
        raise ConfigError("tiling.loss_tile and tiling.mlp_tiles must be >= 0 (0 = derived default)")


def loss_tile(tiling: TilingConfig, seq_local: int, vocab: int, batch_local: int = 1) -> int:
    """Tokens per loss tile of a device's `seq_local` tokens: `tiling.loss_tile` where it divides them, else
    `default_loss_tile` (the 256 MiB float32 logits budget; a training length always takes `tiling.loss_tile`, which
    `jaxlong.config.validate` checks, while evaluation at other lengths falls back). The one choice of loss tiles,
    for training, evaluation and every objective."""
    if tiling.loss_tile and seq_local % tiling.loss_tile == 0:
        return tiling.loss_tile
    return default_loss_tile(seq_local, vocab, batch=batch_local)


# ----------------------------------------------------------------------------------------------
# Validation and defaults (no tracing: callable from config validation).


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _show(values: list[int], limit: int = 16) -> str:
    if len(values) <= limit:
        return str(values)
    half = limit // 2
    return f"[{', '.join(map(str, values[:half]))}, ..., {', '.join(map(str, values[-half:]))}]"


def _positive_divisor(value, n: int) -> bool:
    try:
        v = operator.index(value)
    except TypeError:
        return False
    return not isinstance(value, bool) and v >= 1 and n % v == 0


def _check_divides(key: str, value, seq_local: int) -> None:
    if not _positive_divisor(value, seq_local):
        raise ValueError(f"{key}={value!r} must be a positive integer dividing the local sequence length "
                         f"{seq_local} (seq_len / mesh.context); valid values: {_show(_divisors(seq_local))}")


def validate_loss_tile(seq_local: int, tile: int) -> None:
    """Raise ValueError unless `tile` (tokens per loss tile, option `tiling.loss_tile`) divides `seq_local`
    (the sequence length each device holds: seq_len / mesh.context)."""
    _check_divides("tiling.loss_tile", tile, seq_local)


def default_loss_tile(seq_local: int, vocab: int, budget_bytes: int = DEFAULT_LOSS_BUDGET_BYTES, *,
                      batch: int = 1) -> int:
    """Tokens per loss tile: the largest power of two dividing `seq_local` whose float32 logits tile
    `[batch, tile, vocab]` fits in `budget_bytes` (at least 1).

    The backward holds about two such tiles (logits and their gradient) at once. Example: vocab 128,256 and
    the default 256 MiB give 512 tokens (250.5 MiB per tile).
    """
    max_tokens = max(1, budget_bytes // (4 * vocab * max(batch, 1)))
    tile = 1
    while tile * 2 <= max_tokens and seq_local % (tile * 2) == 0:
        tile *= 2
    return tile


def default_mlp_tiles(seq_local: int, hidden: int) -> int:
    """ALST's tile count `ceil(seq_local / hidden)`, rounded up to the nearest divisor of `seq_local`
    (so each tile holds about `hidden` tokens: its `[tile, mlp_hidden]` intermediates are the size of a
    `[hidden, mlp_hidden]` weight)."""
    want = max(1, -(-seq_local // hidden))
    return next(d for d in _divisors(seq_local) if d >= want)


# ----------------------------------------------------------------------------------------------
# Helpers.


def _tile(x: jax.Array, i, size: int) -> jax.Array:
    """Tile `i` of `size` tokens along the sequence axis (axis 1)."""
    return jax.lax.dynamic_slice_in_dim(x, i * size, size, axis=1)


def _untile(ys: jax.Array) -> jax.Array:
    """Per-tile scan outputs `[n_tiles, batch, tile]` -> `[batch, n_tiles * tile]`."""
    n, b, t = ys.shape
    return jnp.moveaxis(ys, 0, 1).reshape(b, n * t)


def _check_mesh_seq(seq: int, mesh) -> int:
    c = seq_shards(mesh)
    if seq % c:
        raise ValueError(f"sequence length {seq} must be divisible by mesh.context={c}"
                         + ("" if c == mesh.shape["context"] else " (times mesh.ring)"))
    return seq // c


# ----------------------------------------------------------------------------------------------
# Tiled output projection + cross-entropy.


def _tile_logits(h_t: jax.Array, head: jax.Array) -> jax.Array:
    return jnp.einsum("bth,hv->btv", h_t, head, preferred_element_type=jnp.float32)


def _is_target(t_t: jax.Array, vocab: int) -> jax.Array:
    """`[b, t, vocab]` boolean one-hot of the targets (never stored: fused into its consumers)."""
    return jax.lax.broadcasted_iota(jnp.int32, (*t_t.shape, vocab), 2) == t_t[..., None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _ce_sum(hidden, head, targets, mask, tile, axes):
    """`sum(mask * token_loss)` (float32 scalar) over the arrays given, computed over sequence tiles.
    `axes`: the mesh axes of the enclosing shard_map (all inputs vary over them), or ()."""
    return _ce_sum_fwd(hidden, head, targets, mask, tile, axes)[0]


def _tile_ce(hidden, head, targets, i, tile):
    """Tile `i`'s per-token cross-entropy and log-sum-exp, float32 `[b, tile]` each."""
    logits = _tile_logits(_tile(hidden, i, tile), head)
    lse = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.sum(jnp.where(_is_target(_tile(targets, i, tile), head.shape[1]), logits, 0.0), axis=-1)
    return lse - target_logit, lse


def _ce_sum_fwd(hidden, head, targets, mask, tile, axes):
    # Each tile's sum is a scan output, summed once at the end (a reduction tree), not a running float32
    # total: n tiles added one after another would round n times at the size of the whole sum (docs/numerics.md).
    def body(_, i):
        loss, lse = _tile_ce(hidden, head, targets, i, tile)
        return None, (jnp.sum(loss * _tile(mask, i, tile)), lse)

    _, (sums, lse) = jax.lax.scan(body, None, jnp.arange(hidden.shape[1] // tile))
    return jnp.sum(sums), (hidden, head, targets, mask, _untile(lse))


def _ce_sum_bwd(tile, axes, res, g):
    hidden, head, targets, mask, lse = res
    s = hidden.shape[1]
    vocab = head.shape[1]

    def body(carry, i):
        d_hidden, d_head = carry
        h_t, t_t, m_t, lse_t = (_tile(a, i, tile) for a in (hidden, targets, mask, lse))
        logits = _tile_logits(h_t, head)
        is_t = _is_target(t_t, vocab)
        p = jnp.exp(logits - lse_t[..., None])
        d_logits = jnp.where(is_t, p - 1.0, p) * (g * m_t)[..., None]  # d(loss)/d(logits), float32
        d_mask_t = g * (lse_t - jnp.sum(jnp.where(is_t, logits, 0.0), axis=-1))
        dh_t = jnp.einsum("btv,hv->bth", d_logits.astype(head.dtype), head, preferred_element_type=jnp.float32)
        d_hidden = jax.lax.dynamic_update_slice_in_dim(d_hidden, dh_t.astype(hidden.dtype), i * tile, axis=1)
        d_head = d_head + jnp.einsum("bth,btv->hv", h_t, d_logits.astype(hidden.dtype),
                                     preferred_element_type=jnp.float32)
        return (d_hidden, d_head), d_mask_t

    # After the forward's lse, not g: g is known before the forward ends (it only depends on the mask).
    init = (zeros_after(lse, hidden.shape, hidden.dtype, axes), zeros_after(lse, head.shape, jnp.float32, axes))
    (d_hidden, d_head), d_mask = jax.lax.scan(body, init, jnp.arange(s // tile))
    return d_hidden, d_head.astype(head.dtype), None, _untile(d_mask).astype(mask.dtype)


_ce_sum.defvjp(_ce_sum_fwd, _ce_sum_bwd)


def tiled_loss_sum(hidden: jax.Array, head: jax.Array, targets: jax.Array, mask: jax.Array, *, tile: int,
                   mesh: jax.sharding.Mesh | None = None) -> tuple[jax.Array, jax.Array]:
    """Masked cross-entropy *sum* and valid-token count over the global batch, over sequence tiles.

    Args:
      hidden: final hidden states `[batch, seq, hidden]` (any float dtype); with `mesh`, global and laid out
        `P(('data', 'fsdp'), 'context', None)`.
      head: output projection `[hidden, vocab]`, replicated.
      targets: next-token ids `[batch, seq]` int32 in `[0, vocab)`; `IGNORE_INDEX` (-100) is ignored (its mask
        is zeroed), and other ids outside that range are allowed where mask is 0: they contribute nothing.
      mask: loss weights `[batch, seq]` (bool, int or float; 1 = count the token).
      tile: tokens per tile along the (local) sequence: it must divide seq (mesh None) or seq / mesh.context.
        `default_loss_tile` picks one from a byte budget.
      mesh: the `data x fsdp x context` mesh, or None to run on the arrays as given.

    Returns:
      `(loss_sum, count)`: float32 scalars, `sum(token_loss * mask)` in nats and `sum(mask)`; differentiable
      wrt hidden, head and mask (the count's gradient is the usual one of `sum(mask)`).

    Memory: the float32 logits exist for one `[batch, tile, vocab]` tile at a time (forward and backward;
    the backward holds about two: logits and their gradient). Independent of seq, the backward also holds
    a float32 `[hidden, vocab]` d_head accumulator (the output itself for float32 heads) and each tile's
    float32 d_head partial (XLA's CPU backend does not accumulate a matmul into an existing buffer). The
    residuals are the inputs plus the per-token lse `[batch, seq]` float32.

    Raises:
      ValueError: `tile` does not divide the local sequence length (option `tiling.loss_tile`), or seq is not
        divisible by mesh.context.
    """
    mask = effective_mask(targets, mask)
    if mesh is None:
        validate_loss_tile(hidden.shape[1], tile)
        return _ce_sum(hidden, head, targets, mask, int(tile), ()), jnp.sum(mask)
    validate_loss_tile(_check_mesh_seq(hidden.shape[1], mesh), tile)
    tile = int(tile)
    axes = tuple(mesh.axis_names)

    def local(h, w, t, m):
        w = jax.lax.pcast(w, axes, to="varying")  # the shard_map transpose sums d_head over the mesh
        return jax.lax.psum(_ce_sum(h, w, t, m, tile, axes), axes), jax.lax.psum(jnp.sum(m), axes)

    tok = P(BATCH_AXES, seq_axes(mesh))
    return jax.shard_map(
        local, mesh=mesh, in_specs=(P(BATCH_AXES, seq_axes(mesh), None), P(), tok, tok), out_specs=(P(), P()),
        check_vma=True,
    )(hidden, head, targets, mask)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _ce_tokens(hidden, head, targets, tile, axes):
    """Per-token cross-entropy `[b, s]` over sequence tiles; its backward takes a per-token cotangent."""
    return _ce_tokens_fwd(hidden, head, targets, tile, axes)[0]


def _ce_tokens_fwd(hidden, head, targets, tile, axes):
    def body(_, i):
        return None, _tile_ce(hidden, head, targets, i, tile)

    _, (losses, lse) = jax.lax.scan(body, None, jnp.arange(hidden.shape[1] // tile))
    return _untile(losses), (hidden, head, targets, _untile(lse))


def _ce_tokens_bwd(tile, axes, res, g):
    # d(sum_t g_t * loss_t) is the backward of `_ce_sum` with the cotangent as its mask and a unit scale
    hidden, head, targets, lse = res
    d_hidden, d_head, _, _ = _ce_sum_bwd(tile, axes, (hidden, head, targets, g.astype(jnp.float32), lse),
                                         jnp.ones((), jnp.float32))
    return d_hidden, d_head, None


_ce_tokens.defvjp(_ce_tokens_fwd, _ce_tokens_bwd)


def tiled_token_losses(hidden: jax.Array, head: jax.Array, targets: jax.Array, *, tile: int,
                       mesh: jax.sharding.Mesh | None = None) -> jax.Array:
    """Per-token next-token cross-entropy, float32 `[batch, seq]` in nats, over sequence tiles: equal to
    `jaxlong.layers.loss.token_losses` without materializing `[batch, seq, vocab]` logits, forward or backward.

    For losses that are not a masked sum of token losses (DPO's sums per sequence, `jaxlong.objectives.dpo`):
    the backward takes any per-token cotangent `g` and is `tiled_loss_sum`'s backward with `g` as its mask, one
    tile's logits at a time (ALST, arXiv 2506.13996, §3.2). A target outside `[0, vocab)` gives a finite,
    meaningless value: mask it out. Arguments, sharding (the result is laid out like `targets`) and errors as
    `tiled_loss_sum`."""
    if mesh is None:
        validate_loss_tile(hidden.shape[1], tile)
        return _ce_tokens(hidden, head, targets, int(tile), ())
    validate_loss_tile(_check_mesh_seq(hidden.shape[1], mesh), tile)
    tile = int(tile)
    axes = tuple(mesh.axis_names)

    def local(h, w, t):
        w = jax.lax.pcast(w, axes, to="varying")  # the shard_map transpose sums d_head over the mesh
        return _ce_tokens(h, w, t, tile, axes)

    tok = P(BATCH_AXES, seq_axes(mesh))
    return jax.shard_map(local, mesh=mesh, in_specs=(P(BATCH_AXES, seq_axes(mesh), None), P(), tok), out_specs=tok,
                         check_vma=True)(hidden, head, targets)


def _entropies(hidden, head, tile):
    def body(_, i):
        logp = jax.nn.log_softmax(_tile_logits(_tile(hidden, i, tile), head), axis=-1)
        return None, -jnp.sum(jnp.exp(logp) * logp, axis=-1)

    return _untile(jax.lax.scan(body, None, jnp.arange(hidden.shape[1] // tile))[1])


def tiled_token_entropies(hidden: jax.Array, head: jax.Array, *, tile: int,
                          mesh: jax.sharding.Mesh | None = None) -> jax.Array:
    """Entropy of each position's next-token distribution `softmax(hidden @ head)`, float32 `[batch, seq]` in nats,
    one tile's logits at a time, with no gradient (a metric: GRPO's `entropy`); equal to
    `jaxlong.layers.loss.token_entropies`. Arguments, sharding and errors as `tiled_token_losses`."""
    hidden, head = jax.lax.stop_gradient(hidden), jax.lax.stop_gradient(head)
    if mesh is None:
        validate_loss_tile(hidden.shape[1], tile)
        return _entropies(hidden, head, int(tile))
    validate_loss_tile(_check_mesh_seq(hidden.shape[1], mesh), tile)
    tile = int(tile)
    axes = tuple(mesh.axis_names)

    def local(h, w):
        return _entropies(h, jax.lax.pcast(w, axes, to="varying"), tile)

    return jax.shard_map(local, mesh=mesh, in_specs=(P(BATCH_AXES, seq_axes(mesh), None), P()),
                         out_specs=P(BATCH_AXES, seq_axes(mesh)), check_vma=True)(hidden, head)


def tiled_cross_entropy(hidden: jax.Array, head: jax.Array, targets: jax.Array, mask: jax.Array, *, tile: int,
                        mesh: jax.sharding.Mesh | None = None) -> jax.Array:
    """Mean next-token cross-entropy (nats/token, float32 scalar) over the valid tokens of the global batch:
    `loss_sum / max(count, 1)` of `tiled_loss_sum` (same arguments and errors). Equal to
    `jaxlong.layers.loss.cross_entropy(hidden, head, targets, mask)` without materializing `[batch, seq, vocab]`."""
    loss_sum, count = tiled_loss_sum(hidden, head, targets, mask, tile=tile, mesh=mesh)
    return loss_sum / jnp.maximum(count, 1.0)


# ----------------------------------------------------------------------------------------------
# Tiled SwiGLU MLP.


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """Plain SwiGLU `(silu(x W_gate) * (x W_up)) W_down`: `[b, s, hidden]` -> `[b, s, hidden]`
    (the same math as `jaxlong.models.llama.mlp`)."""
    return _gated(x, w_gate, w_up, w_down, jax.nn.silu)


def _mlp_tile(x_t, norms, w_gate, w_up, w_down, eps, act):
    """One tile's output: the gated MLP of `x_t`, or with `norms` = (pre, post) scales (each `[hidden]` or None) the
    sublayer `x_t + post_norm(mlp(pre_norm(x_t)))` (no post-norm where post is None)."""
    fn = gate_activation(act)
    if norms is None:
        return _gated(x_t, w_gate, w_up, w_down, fn)
    pre, post = norms
    out = _gated(rms_norm(x_t, pre, eps), w_gate, w_up, w_down, fn)
    return x_t + (out if post is None else rms_norm(out, post, eps))


def _gated(x, w_gate, w_up, w_down, fn):
    gate = jnp.einsum("bsh,hf->bsf", x, w_gate)
    return jnp.einsum("bsf,fh->bsh", fn(gate) * jnp.einsum("bsh,hf->bsf", x, w_up), w_down)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _mlp_tiled(x, norms, w_gate, w_up, w_down, tile, axes, eps, act):
    """The gated MLP over tiles of `tile` tokens (with `norms`: the normalized, residual sublayer); `axes` as in
    `_ce_sum`."""
    return _mlp_fwd(x, norms, w_gate, w_up, w_down, tile, axes, eps, act)[0]


def _mlp_fwd(x, norms, w_gate, w_up, w_down, tile, axes, eps, act):
    b, s, _ = x.shape
    dtype = jnp.result_type(x, w_gate, w_up, w_down)

    def body(y, i):
        y_t = _mlp_tile(_tile(x, i, tile), norms, w_gate, w_up, w_down, eps, act)
        return jax.lax.dynamic_update_slice_in_dim(y, y_t.astype(dtype), i * tile, axis=1), None

    y0 = zeros_after(x, (b, s, w_down.shape[1]), dtype, axes)
    y, _ = jax.lax.scan(body, y0, jnp.arange(s // tile))
    return y, (x, norms, w_gate, w_up, w_down)


def _mlp_bwd(tile, axes, eps, act, res, dy):
    x, norms, w_gate, w_up, w_down = res
    ws = (norms, w_gate, w_up, w_down)  # the differentiated weights: the norms' scales (a pytree, maybe None) first

    def tile_fn(x_t, norms, *w):
        return _mlp_tile(x_t, norms, *w, eps, act)

    def body(carry, i):
        dx, dws = carry
        _, vjp = jax.vjp(tile_fn, _tile(x, i, tile), *ws)  # recompute this tile's intermediates only
        dx_t, *dws_t = vjp(_tile(dy, i, tile))
        dx = jax.lax.dynamic_update_slice_in_dim(dx, dx_t.astype(x.dtype), i * tile, axis=1)
        return (dx, jax.tree.map(lambda a, d: a + d.astype(jnp.float32), dws, tuple(dws_t))), None

    # After dy and x: under layer remat x is recomputed just before this backward; dy alone is known earlier.
    init = (zeros_after((dy, x), x.shape, x.dtype, axes),
            jax.tree.map(lambda w: zeros_after((dy, x), w.shape, jnp.float32, axes), ws))
    (dx, dws), _ = jax.lax.scan(body, init, jnp.arange(x.shape[1] // tile))
    return (dx, *jax.tree.map(lambda d, w: d.astype(w.dtype), dws, ws))


_mlp_tiled.defvjp(_mlp_fwd, _mlp_bwd)


def tiled_mlp(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, *, tiles: int,
              mesh: jax.sharding.Mesh | None = None, norm_scale: jax.Array | None = None,
              norm_eps: float = 1e-5, post_norm_scale: jax.Array | None = None, activation: str = "silu") -> jax.Array:
    """SwiGLU MLP `(silu(x W_gate) * (x W_up)) W_down` over `tiles` sequence tiles, with recompute.

    With `norm_scale` (the MLP RMSNorm's scale `[hidden]`, replicated), the whole MLP sublayer
    `x + swiglu(rms_norm(x))` over the same tiles: the norm and the residual are token-wise, so each tile
    normalizes its own tokens and its backward returns `dy + d(rms_norm)` for them. Then neither the normalized
    input nor its gradient exists as a `[batch, seq, hidden]` tensor (each would be a full-width buffer alive
    through the MLP's backward: 10 GiB per device at 10M tokens on Llama-3.1-8B, C = 8), and the sublayer's
    input gradient is written once.

    Args:
      x: normalized layer input `[batch, seq, hidden]` (with `norm_scale`: the residual stream before the norm);
        with `mesh`, global and laid out `P(('data', 'fsdp'), 'context', None)`.
      w_gate, w_up: `[hidden, mlp_hidden]`; w_down: `[mlp_hidden, hidden]`; replicated (gathered).
      tiles: number of tiles per (local) sequence; must divide seq (mesh None) or seq / mesh.context.
        `default_mlp_tiles` gives ALST's `ceil(seq_local / hidden)`.
      mesh: the `data x fsdp x context` mesh, or None to run on the arrays as given.

      norm_scale, norm_eps: the RMSNorm to apply first (and the residual to add), or None.
      post_norm_scale: with `norm_scale`, the RMSNorm applied to the MLP's output before the residual (Gemma 3's
        post-MLP norm, `[hidden]`), or None.
      activation: the gate's activation, `silu` (SwiGLU) or `gelu_tanh` (GeGLU; `jaxlong.models.family`).

    Returns:
      `[batch, seq, hidden]` in the promoted dtype of the inputs, equal to `swiglu(x, ...)` (with
      `norm_scale`: `x + swiglu(rms_norm(x, norm_scale, norm_eps), ...)`), sharded like x.

    Memory: the `[batch, seq / tiles, mlp_hidden]` intermediates exist for one tile at a time, forward and
    backward; the backward saves only x and the weights and accumulates weight gradients in float32.
    The layer's `mlp_hidden` checkpoint name is not produced (there is no whole-sequence tensor to save).

    Raises:
      ValueError: `tiles` does not divide the local sequence length (option `tiling.mlp_tiles`), or seq is
        not divisible by mesh.context.
    """
    eps = float(norm_eps)
    norms = None if norm_scale is None else (norm_scale, post_norm_scale)
    if mesh is None:
        _check_divides("tiling.mlp_tiles", tiles, x.shape[1])
        return _mlp_tiled(x, norms, w_gate, w_up, w_down, x.shape[1] // int(tiles), (), eps, activation)
    seq_local = _check_mesh_seq(x.shape[1], mesh)
    _check_divides("tiling.mlp_tiles", tiles, seq_local)
    axes = tuple(mesh.axis_names)

    def local(x, norms, *ws):
        # the shard_map transpose sums the weights' gradients
        norms, ws = jax.tree.map(lambda w: jax.lax.pcast(w, axes, to="varying"), (norms, ws))
        return _mlp_tiled(x, norms, *ws, seq_local // int(tiles), axes, eps, activation)

    act = P(BATCH_AXES, seq_axes(mesh), None)
    norm_specs = jax.tree.map(lambda _: P(), norms)
    return jax.shard_map(local, mesh=mesh, in_specs=(act, norm_specs, P(), P(), P()), out_specs=act,
                         check_vma=True)(x, norms, w_gate, w_up, w_down)
