"""Stateless building blocks of the Llama-3 decoder: RMSNorm and rotary embeddings (RoPE), with the RoPE scaling
section of the config (`model.rope_scaling`, `RopeScalingConfig`) and its checks.

All take and return `[batch, seq, ...]` arrays; norms and the RoPE rotation are computed in float32 and cast
back to the input dtype.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np

from jaxlong.core.errors import ConfigError, check_choice

RopeScaling = Literal["none", "linear", "llama3", "yarn"]  # `model.rope_scaling.type`
ROPE_SCALINGS = get_args(RopeScaling)


@dataclass
class RopeScalingConfig:
    """RoPE frequency scaling for context extension (`rope_scaling` of Hugging Face configs): `type` `none`,
    `linear` (position interpolation, Chen et al. 2023), `llama3` (Llama-3.1) or `yarn` (Peng et al. 2023, YaRN),
    computed by `rope_frequencies` as `transformers` does (how each rescales the frequencies: its docstring).
    """

    type: RopeScaling = "none"
    factor: float = 1.0
    original_max_position_embeddings: int = 0  # pretraining context (llama3, yarn); 0: none given
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn; null: 0.1 * ln(factor) + 1
    truncate: bool = True  # yarn: round the correction range to whole dimensions


def check_rope(theta: float, rs: RopeScalingConfig) -> None:
    """`model.rope_theta` and `model.rope_scaling.*`: a positive base, a scaling type jaxlong computes, a positive
    factor, the pretraining context that llama3 and yarn scale from, and llama3's factors in order.

    Raises:
      ConfigError: naming the option, its value and what would work.
    """
    check_choice("model.rope_scaling.type", rs.type, RopeScaling)
    if not theta > 0:  # NaN too
        raise ConfigError(f"model.rope_theta={theta} must be positive")
    if rs.type != "none" and rs.factor <= 0:
        raise ConfigError(f"model.rope_scaling.factor={rs.factor} must be positive")
    if rs.type in ("llama3", "yarn") and rs.original_max_position_embeddings <= 0:
        raise ConfigError(
            f"model.rope_scaling.type={rs.type} needs model.rope_scaling.original_max_position_embeddings (the "
            f"pretraining context length, e.g. 8192 for Llama-3.1), got {rs.original_max_position_embeddings}"
        )
    if rs.type == "llama3" and rs.high_freq_factor <= rs.low_freq_factor:
        raise ConfigError(
            f"model.rope_scaling.high_freq_factor={rs.high_freq_factor} must exceed "
            f"model.rope_scaling.low_freq_factor={rs.low_freq_factor}"
        )


def inv_rms(x: jax.Array, eps: float) -> jax.Array:
    """RMSNorm's per-token `1 / sqrt(mean(x^2) + eps)` of x `[..., hidden]`: float32 `[..., 1]`."""
    xf = x.astype(jnp.float32)
    return jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm (Zhang & Sennrich 2019): `x / sqrt(mean(x^2) + eps) * scale`. x `[..., hidden]`, scale `[hidden]`.

    Computed in float32, returned in x's dtype. The backward saves only x and the per-token `1/rms`
    `[..., 1]` and recomputes the normalized x: autodiff would keep `x / rms` (float32) as a residual, one more
    `[seq, hidden]` tensor per norm alive through the layer's backward pass.
    """
    return rms_norm_fwd(x, scale, eps)[0]


def rms_norm_fwd(x, scale, eps):
    """RMSNorm forward `x * (r * scale)` in x's dtype, with r the per-token `1/rms` `[..., 1]`, and its residuals
    `(x, scale, r)` (for ops that fuse the norm, e.g. U-Pipe). The product is `x * (r * scale)`, not
    `(x * r) * scale`: no full-size `x * r` exists for the compiler to share with (and keep alive for) another use
    of it."""
    r = inv_rms(x, eps)
    return (x.astype(jnp.float32) * (r * scale.astype(jnp.float32))).astype(x.dtype), (x, scale, r)


def rms_norm_bwd(eps, res, g):
    """RMSNorm backward from the residuals of `rms_norm_fwd`: `(dx, d_scale)`."""
    x, scale, r = res
    xf, gf = x.astype(jnp.float32), g.astype(jnp.float32)
    # With xn = x * r: d_scale = sum(g * xn) and dx = r * (d_xn - xn * mean(d_xn * xn)), written in terms of
    # rms = 1/r and without forming x * r: the compiler would otherwise reuse the forward's product and
    # broadcast of r (full `[..., hidden]` buffers) and keep them alive from the forward to here.
    rms = 1.0 / r
    d_scale = jnp.sum((gf / rms) * xf, axis=tuple(range(x.ndim - 1)))
    d_xn = gf * scale.astype(jnp.float32)
    dx = (d_xn - xf * (jnp.mean(d_xn * xf, axis=-1, keepdims=True) / (rms * rms))) / rms
    return dx.astype(x.dtype), d_scale.astype(scale.dtype)


rms_norm.defvjp(rms_norm_fwd, rms_norm_bwd)


def rope_frequencies(head_dim: int, theta: float, scaling=None) -> tuple[np.ndarray, float]:
    """RoPE inverse frequencies `[head_dim/2]` (float32, numpy, static) and the attention factor (a float that
    multiplies cos and sin; 1 except for YaRN).

    `theta^(-2i/head_dim)` (Su et al. 2021, RoFormer eq. 15), rescaled by `scaling` (a
    `jaxlong.layers.blocks.RopeScalingConfig` or None) as `transformers`' `ROPE_INIT_FUNCTIONS` do:
    `linear` divides every frequency by `factor`; `llama3` (`_compute_llama3_parameters`) divides those with
    wavelength `2 pi / f` above `original_max_position_embeddings / low_freq_factor` by `factor`, keeps those
    below `original_max_position_embeddings / high_freq_factor` and interpolates between; `yarn`
    (`_compute_yarn_parameters`, Peng et al. 2023) blends interpolated and extrapolated frequencies with a
    linear ramp over the dimensions between the `beta_fast` and `beta_slow` correction dimensions and returns
    the attention factor (`attention_factor`, default `0.1 ln(factor) + 1`).

    Raises:
      ValueError: an unknown scaling type.
    """
    f32 = np.float32
    pos_freqs = np.asarray(theta, f32) ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(f32) / f32(head_dim))
    inv_freq = (f32(1.0) / pos_freqs).astype(f32)
    kind = "none" if scaling is None else scaling.type
    if kind == "none":
        return inv_freq, 1.0
    factor = float(scaling.factor)
    if kind == "linear":
        return (inv_freq / f32(factor)).astype(f32), 1.0
    old = float(scaling.original_max_position_embeddings)
    if kind == "llama3":
        low, high = float(scaling.low_freq_factor), float(scaling.high_freq_factor)
        wavelen = f32(2 * math.pi) / inv_freq
        scaled = np.where(wavelen > old / low, inv_freq / f32(factor), inv_freq).astype(f32)
        smooth = ((f32(old) / wavelen - f32(low)) / f32(high - low)).astype(f32)
        smoothed = ((1 - smooth) * scaled / f32(factor) + smooth * scaled).astype(f32)
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        return np.where(medium, smoothed, scaled).astype(f32), 1.0
    if kind == "yarn":
        attention = scaling.attention_factor
        if attention is None:
            attention = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0

        def correction_dim(rotations):
            return head_dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        lo, hi = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
        if scaling.truncate:
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, head_dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = np.clip((np.arange(head_dim // 2, dtype=f32) - f32(lo)) / f32(hi - lo), 0, 1).astype(f32)
        extrapolation = (1 - ramp).astype(f32)
        interpolation = (f32(1.0) / (f32(factor) * pos_freqs)).astype(f32)
        inv = interpolation * (1 - extrapolation) + inv_freq * extrapolation
        return inv.astype(f32), float(attention)
    raise ValueError(f"model.rope_scaling.type={kind!r} is not supported; choose one of: {', '.join(ROPE_SCALINGS)}")


# pi to 50 digits, for the host's exact reduction of the frequencies to turns (`rope_turns`).
_PI = Fraction(31415926535897932384626433832795028841971693993751, 10**49)


def rope_turns(inv_freq: np.ndarray) -> np.ndarray:
    """Each RoPE frequency as a fraction of a turn per position, in 64-bit fixed point: `[4, head_dim/2]` uint32.

    Row i holds bits `16i .. 16i+15` (four 16-bit limbs, least significant first) of `F = round(frac(f / 2 pi)
    * 2^64)` for each frequency f (radians per position, `inv_freq` `[head_dim/2]`, taken exactly as the float32
    it is). Computed on the host with exact rational arithmetic (pi to 50 digits), so F is exact to half a
    unit of 2^-64 turn. `rope_tables` multiplies it by the integer position on the device.
    """
    limbs = np.zeros((4, len(inv_freq)), np.uint32)
    for j, f in enumerate(np.asarray(inv_freq, np.float64)):
        turns = Fraction(float(f)) / (2 * _PI)
        fixed = round((turns - math.floor(turns)) * 2**64) % 2**64
        for i in range(4):
            limbs[i, j] = (fixed >> (16 * i)) & 0xFFFF
    return limbs


def rope_angles(positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """RoPE angles `positions * inv_freq` reduced to `[-pi, pi)`: float32 `[..., seq, head_dim/2]` for integer
    `positions` `[..., seq]` (any int32, negative too), exact to 4e-7 rad at every position.

    The product of a position and a frequency is formed exactly, in integers, as turns modulo 1: with the
    frequency in turns as the 64-bit fixed-point fraction F of `rope_turns` (four 16-bit limbs T3..T0) and the
    position p as uint32 (halves pH, pL of 16 bits), the top 32 bits of `p * F mod 2^64` are

        (p*T3 << 16) + p*T2 + pH*T1 + (pL*T1 >> 16) + (pH*T0 >> 16)     (uint32 arithmetic, wrapping),

    where every product fits 32 bits or is needed only modulo 2^32; the dropped low parts cost under 2
    units of 2^-32 turn (3e-9 rad). Read as int32 this is the angle in `[-2^31, 2^31)` units of 2 pi / 2^32;
    one float32 conversion and one product (each rounded to half an ulp: 1e-7 rad near pi, plus float32's
    2 pi, 9e-8 rad) give the angle in radians. So the only errors are float32's at the reduced angle, whatever
    the position: the angle of position 20,971,520 is as exact as that of position 20.

    Why not float32: `float32(p) * f` rounds the angle itself to half an ulp of `p * f`, 0.25 rad at p = 2^23,
    f = 1, so q and k, rounded independently, stop rotating by their distance alone (docs/numerics.md). Why not
    host tables of cos and sin for a high and a low part of p (combined on the device by the angle-addition
    formulas): for 2^25 positions and head_dim 128 they are two 12,288 x 64 constants (6 MiB) in every
    program and a gather per token, and still end at a fixed largest position; the integer product is a few
    elementwise integer operations that fuse with cos and sin, for any int32 position. No float64 anywhere on
    the device (GPUs run it at a fraction of float32's rate; TPUs lack it).

    Sources: RoPE, Su et al. 2021 (arXiv 2104.09864, section 3.4.2); the reduction modulo 2 pi by a
    fixed-point product with 1 / 2 pi is Payne and Hanek's (1983), here exact because the position is an
    integer; docs/numerics.md (bounds, alternatives, measurements).
    """
    t0, t1, t2, t3 = (jnp.asarray(row) for row in rope_turns(inv_freq))
    signed = positions.astype(jnp.int32)[..., None]
    p = jax.lax.bitcast_convert_type(signed, jnp.uint32)
    ph, pl = p >> 16, p & 0xFFFF
    h = ((p * t3) << 16) + p * t2 + ph * t1 + ((pl * t1) >> 16) + ((ph * t0) >> 16)
    # p < 0 was read as p + 2^32: take 2^32 F back off (its part above 2^-32 turn is F mod 2^32).
    h = jnp.where(signed < 0, h - ((t1 << 16) | t0), h)
    turns = jax.lax.bitcast_convert_type(h, jnp.int32)  # the angle in units of 2 pi / 2^32, in [-pi, pi)
    return turns.astype(jnp.float32) * np.float32(2 * math.pi / 2**32)


def rope_tables(positions: jax.Array, head_dim: int, theta: float, scaling=None) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables `[..., seq, head_dim/2]` (float32) for integer token `positions` `[..., seq]`.

    Frequencies from `rope_frequencies(head_dim, theta, scaling)` (`scaling`: a
    `jaxlong.layers.blocks.RopeScalingConfig` or None); YaRN's attention factor multiplies both tables, as in
    `transformers`. Positions must be *global* token indices: under context parallelism a shard starting at
    token `r*S/C` passes `r*S/C + arange(S/C)`.

    Exact at every int32 position: the angle `position * f` is formed in integer arithmetic and reduced
    modulo 2 pi before it is rounded to float32 (`rope_angles`), so cos and sin are within 5e-7 of the float64
    values of the float32 frequencies f at any position (tests: within 2e-6 below 2^25). Transformers forms
    `float32(position) * f` instead; the two agree to float32 rounding of the angle, 2e-6 rad below position
    64, and differ by up to 0.004 rad at 128K positions, 0.5 rad at 10M (docs/hf-models.md, docs/numerics.md).
    """
    inv_freq, attention_factor = rope_frequencies(head_dim, theta, scaling)
    angles = rope_angles(positions, inv_freq)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos, sin


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate `x` `[batch, seq, heads, head_dim]` by RoPE tables `[batch or 1, seq, head_dim/2]`.

    Uses the "rotate half" pairing of Llama checkpoints in the Hugging Face layout (dimension i pairs with
    i + head_dim/2). The rotation is orthogonal, so its transpose (the backward) is the rotation by -angle.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def gate_activation(name: str):
    """A gated MLP's activation by its name: `silu` (SwiGLU, Llama) or `gelu_tanh` (GeGLU with the tanh GELU,
    transformers' `gelu_pytorch_tanh`: Gemma 3).

    Raises:
      ValueError: another name."""
    if name == "silu":
        return jax.nn.silu
    if name == "gelu_tanh":
        return lambda x: jax.nn.gelu(x, approximate=True)
    raise ValueError(f"activation {name!r} is not supported; choose silu or gelu_tanh")

