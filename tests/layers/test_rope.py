"""RoPE at long positions: the cos/sin tables equal float64's at every position below 2^25 for every scaling, and
a window's logits do not move when all of its positions move by the same offset (up to 2^25), on one device and
under Ulysses, U-Pipe and ring attention, plain and with llama3 and YaRN scaling, one document or packed
documents each shifted by its own offset (docs/numerics.md)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mesh_for, pairwise, tiny_cfg

from jaxlong.config import RopeScalingConfig
from jaxlong.core.batch import natural_order, put_batch
from jaxlong.layers.blocks import rope_frequencies, rope_tables
from jaxlong.config import runtime
from jaxlong.models.llama import forward, init_params, model_graphdef
from jaxlong.training.step import abstract_state

SCALINGS = {
    "none": RopeScalingConfig(),
    "linear": RopeScalingConfig(type="linear", factor=4.0),
    "llama3": RopeScalingConfig(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                original_max_position_embeddings=8192),
    "yarn": RopeScalingConfig(type="yarn", factor=4.0, original_max_position_embeddings=32768),
    "yarn-factor": RopeScalingConfig(type="yarn", factor=16.0, original_max_position_embeddings=4096,
                                     attention_factor=1.25, truncate=False),
}
# Positions where float32's spacing of p is 0.5 to 2 and the two-node headline lengths.
POSITIONS = np.array([0, 1, 63, 4095, 131071, 2**20 + 7, 2**22 + 1, 2**24 - 1, 2**24, 2**24 + 1, 10_485_760,
                      10_485_761, 20_971_520, 20_971_519, 2**25 - 2, 2**25 - 1], np.int32)


@pytest.mark.parametrize("head_dim, theta", [(128, 500000.0), (64, 10000.0)])
def test_tables_equal_float64_below_2_pow_25(head_dim, theta):
    """cos and sin within 2e-6 of float64's `cos(p * f)` (f: the float32 frequencies, times YaRN's attention
    factor) at every tested position, for every scaling; the float32 product `float32(p) * f` (transformers',
    and jaxlong's before) is off by more than 0.01 at 10,485,760."""
    rng = np.random.default_rng(0)
    pos = np.concatenate([POSITIONS, rng.integers(0, 2**25, 4096, dtype=np.int32)])
    for name, scaling in SCALINGS.items():
        inv, factor = rope_frequencies(head_dim, theta, scaling)
        cos, sin = jax.jit(lambda p, s=scaling: rope_tables(p, head_dim, theta, s))(pos)
        angle = pos.astype(np.float64)[:, None] * inv.astype(np.float64)
        for got, want in ((cos, np.cos(angle)), (sin, np.sin(angle))):
            err = np.abs(np.asarray(got, np.float64) - factor * want).max(axis=1)
            assert err.max() <= 2e-6, (name, pos[err.argmax()], err.max())
        old = np.cos((pos.astype(np.float32)[:, None] * inv).astype(np.float64))
        assert np.abs(old - np.cos(angle))[list(POSITIONS).index(10_485_760)].max() > 0.01, name


def test_tables_are_exact_for_every_int32():
    """The integer reduction has no largest position: int32's extremes and negative positions too."""
    pos = np.array([2**31 - 1, 2**30 + 3, -1, -(2**31), -12_345_678], np.int32)
    inv, _ = rope_frequencies(128, 500000.0)
    cos, sin = jax.jit(lambda p: rope_tables(p, 128, 500000.0))(pos)
    angle = pos.astype(np.float64)[:, None] * inv.astype(np.float64)
    np.testing.assert_allclose(cos, np.cos(angle), atol=2e-6, rtol=0)
    np.testing.assert_allclose(sin, np.sin(angle), atol=2e-6, rtol=0)


# ---------------------------------------------------------------------------------------------- shift invariance

SEQ = 64
MESHES = {  # name: (overrides, devices); every method on its documented mesh axes, in miniature
    "one-device": (["mesh.fsdp=1", "mesh.context=1", "mesh.num_devices=1"], 1),
    "ulysses": (["mesh.fsdp=2", "mesh.context=4"], 8),
    "upipe": (["mesh.fsdp=2", "mesh.context=4", "attention.impl=upipe", "attention.heads_per_stage=4"], 8),
    "ring": (["mesh.fsdp=2", "mesh.ring=2", "mesh.context=2"], 8),  # U-Pipe/Ulysses x ring, zigzag positions
}
MODEL_SCALINGS = ("none", "llama3", "yarn")
# theta and head_dim of the item's user check would need a bigger model; head_dim 16 keeps frequency 1 (the
# one float32's rounding moves most) and a spread of slow ones. init_std 0.2 makes attention peaked, so a
# wrong rotation moves the logits (the float32 product moves them by 0.1 to 1 at 10M; experiments/rope_shift.py).
MODEL = ["model.rope_theta=500000", "model.init_std=0.2", "data.packing=documents"]
OFFSETS = (2**20, 10_485_760, 20_971_520, 2**25 - SEQ)
_PROGRAMS: dict = {}
_PARAMS: dict = {}


def _scaling_overrides(name: str) -> list[str]:
    s = SCALINGS[name]
    if s.type == "none":
        return []
    keys = ["type", "factor", "original_max_position_embeddings"] + (
        ["low_freq_factor", "high_freq_factor"] if s.type == "llama3" else [])
    return [f"model.rope_scaling.{k}={getattr(s, k)}" for k in keys]


def _logits_fn(mesh_name: str, scaling: str, dtype: str):
    """A jitted `(tokens, positions, segment_ids) -> float32 logits` for the tiny model on `mesh_name`, compiled
    once per (mesh, scaling, dtype): positions and segment ids are data, so every shift reuses it."""
    key = (mesh_name, scaling, dtype)
    if key not in _PROGRAMS:
        overrides, n = MESHES[mesh_name]
        cfg = tiny_cfg(*MODEL, *overrides, *_scaling_overrides(scaling), f"compute_dtype={dtype}")
        mesh = mesh_for(cfg, n)
        if "params" not in _PARAMS:  # one set of weights for every mesh (the shapes do not depend on it)
            one = tiny_cfg(*MODEL, *MESHES["one-device"][0])
            _PARAMS["params"] = jax.tree.map(np.asarray, init_params(one.model, mesh_for(one, 1), one.seed, one.param_dtype))
        shardings = jax.tree.map(lambda a: a.sharding, abstract_state(cfg, mesh)["params"])
        params = jax.tree.map(jax.device_put, _PARAMS["params"], shardings)
        rt, graphdef = runtime(cfg, mesh), model_graphdef(cfg.model, cfg.param_dtype)

        @jax.jit
        def run(p, x):
            hidden, head = forward(graphdef, p, x["t"], rt, x["positions"], x["segment_ids"])
            return jnp.einsum("bsh,hv->bsv", hidden.astype(jnp.float32), head.astype(jnp.float32))

        def logits(tokens, positions, segment_ids):
            batch = put_batch({"t": tokens, "positions": positions, "segment_ids": segment_ids}, mesh)
            return natural_order(np.asarray(run(params, batch)), mesh)

        _PROGRAMS[key] = logits
    return _PROGRAMS[key]


def _windows(rng):
    """Tokens `[2, SEQ]` and, per case, (positions, segment ids) of the unshifted and the shifted batch: row 0
    one document (a common offset), row 1 two packed documents of 40 and 24 tokens, each shifted by its own
    offset (document masking: each document's logits depend on its own positions only)."""
    tokens = rng.integers(0, 128, (2, SEQ), dtype=np.int32)
    seg = np.stack([np.ones(SEQ), np.r_[np.ones(40), np.full(SEQ - 40, 2)]]).astype(np.int32)
    base = np.stack([np.arange(SEQ), np.r_[np.arange(40), np.arange(SEQ - 40)]]).astype(np.int32)
    cases = []
    for off in OFFSETS:
        second = min(off // 2 + 12345, 2**25 - 40)  # the first packed document moves less than the second
        shift = np.stack([np.full(SEQ, off), np.r_[np.full(40, second), np.full(SEQ - 40, off)]]).astype(np.int32)
        cases.append((off, base + shift))
    return tokens, seg, base, cases


def _max_shift_diff(mesh_name, scaling, dtype):
    """max over offsets of max |logits(shifted) - logits(unshifted)|, and the unshifted logits."""
    logits = _logits_fn(mesh_name, scaling, dtype)
    tokens, seg, base, cases = _windows(np.random.default_rng(3))
    ref = logits(tokens, base, seg)
    return {off: float(np.abs(logits(tokens, pos, seg) - ref).max()) for off, pos in cases}, ref, (tokens, seg, base)


@pytest.mark.parametrize(*pairwise(
    {"mesh_name": list(MESHES), "scaling": list(MODEL_SCALINGS)},
    fast=[("one-device", "none"), ("one-device", "llama3"), ("one-device", "yarn"), ("ulysses", "llama3"),
          ("upipe", "yarn"), ("ring", "llama3")]))
def test_logits_invariant_to_a_common_shift_float32(mesh_name, scaling):
    """float32 compute: shifted by up to 2^25 - 64 (the window's last position 2^25 - 1), the logits stay
    within 1e-4 of the unshifted ones (1.7e-5 measured; the float32 product moved them by 0.8 at 10M). The
    fast tier runs every method and every scaling (the scaling changes only the frequencies, each checked at
    every position by the table tests), sharing its programs with the bf16 test; the slow tier the rest."""
    diffs, ref, _ = _max_shift_diff(mesh_name, scaling, "float32")
    assert np.abs(ref).max() > 1.0  # logits that a wrong rotation would move
    assert max(diffs.values()) <= 1e-4, diffs


@pytest.mark.parametrize("mesh_name, scaling", [("one-device", "none"), ("ulysses", "llama3"),
                                                ("upipe", "yarn"), ("ring", "llama3")])
def test_logits_invariant_to_a_common_shift_bfloat16(mesh_name, scaling):
    """bf16 compute: the shift changes the float32 tables by rounding only (3e-7), which flips roundings to bf16
    of q and k, so the shifted run is another bf16 run of the same logits. Bound: the bf16 noise of the
    unshifted run, `noise = max |bf16 - float32|` of its logits (0.2 here, logits up to 6.6). Each shifted run is
    within 2 noise of the float32 logits (as accurate as a bf16 run is, with the spread of the max of rounding
    errors: 1.6 measured) and so, by the triangle inequality, within 2 noise of the unshifted bf16 logits
    (1.0 measured). The float32 product (before) gives 4 noise at 10M and 38 at 20M."""
    diffs, ref, (tokens, seg, base) = _max_shift_diff(mesh_name, scaling, "bfloat16")
    exact = _logits_fn(mesh_name, scaling, "float32")(tokens, base, seg)
    noise = float(np.abs(ref - exact).max())
    assert 0 < noise < 0.5, noise
    assert max(diffs.values()) <= 2 * noise, (diffs, noise)
    logits = _logits_fn(mesh_name, scaling, "bfloat16")
    for off, pos in _windows(np.random.default_rng(3))[3]:
        assert float(np.abs(logits(tokens, pos, seg) - exact).max()) <= 2 * noise, off
