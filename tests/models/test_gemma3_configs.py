"""The shipped Gemma 3 configs (`configs/gemma3_*.yaml`) load, validate at their full size, and their train step
builds on the CPU in miniature: the file's mesh axes, attention, remat, tiling, data and dtype options, with the
model shrunk (hidden 64, head_dim 16, a vocabulary of 1,024, one period of the file's layer pattern) and a sequence
of twice the longer of its window and attention blocks (1,024 or 2,048 tokens), so that a broken shipped config (an
unknown key, a mesh that does not divide the heads, an option the windows refuse) fails here. The shrunk model keeps
the file's query and KV heads, window, layer pattern, `query_pre_attn_scalar`, RoPE bases and scaling, on 8
simulated devices (a file for more devices gives up FSDP first: the 27B's FSDP 2 x Ulysses 8 on 16 becomes
Ulysses 8).

Fast tier: the train step traced and lowered with its shardings (`jax.jit(...).lower`: shapes, shardings,
collectives and the config's checks); slow tier: also compiled by XLA."""

from pathlib import Path

import pytest

from jaxlong.config import load_config
from jaxlong.core.mesh import build_mesh
from jaxlong.training import step as step_lib

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("gemma3_*.yaml"))
SHIPPED = {"gemma3_270m.yaml", "gemma3_4b.yaml", "gemma3_12b.yaml", "gemma3_27b.yaml"}
DEVICES = 8  # the test process's simulated CPU devices (tests/conftest.py)


def small_overrides(path: Path) -> list[str]:
    """`key=value` overrides that shrink the config at `path` to a model and mesh that compile in seconds on 8 CPU
    devices, keeping its heads, window, layer pattern, options and mesh axes (FSDP given up first when the file asks
    for more than 8 devices; the global batch scaled with it, at least one sequence per data x FSDP replica); the
    sequence is twice the longer of the window and the attention blocks (tokens).

    Raises:
      AssertionError: the file asks for devices that dropping FSDP does not bring to 8.
    """
    cfg = load_config(path)
    m, mesh = cfg.model, cfg.mesh
    fsdp = mesh.fsdp
    if mesh.num_devices > DEVICES:
        others = mesh.num_devices // max(mesh.fsdp, 1)
        assert DEVICES % others == 0, f"{path.name}: {mesh.num_devices} devices do not shrink to {DEVICES}"
        fsdp = DEVICES // others
    batch = max(cfg.global_batch * fsdp // max(mesh.fsdp, 1), mesh.data * fsdp)
    return ["model.vocab_size=1024", "model.hidden=64", "model.head_dim=16", "model.mlp_hidden=128",
            f"model.layers={max(m.sliding_window_pattern, 1)}", f"mesh.fsdp={fsdp}",
            f"mesh.num_devices={min(mesh.num_devices, DEVICES)}", f"global_batch={batch}",
            f"seq_len={2 * max(m.sliding_window, cfg.attention.block_q, cfg.attention.block_k)}"]


def test_every_shipped_gemma3_config_is_checked():
    assert {p.name for p in CONFIGS} >= SHIPPED, sorted(p.name for p in CONFIGS)


FAST_CONFIGS = {"gemma3_270m.yaml", "gemma3_27b.yaml"}  # the smallest and the largest (62 layers, 168 / 128 scale)


@pytest.mark.parametrize("path", [pytest.param(p, marks=() if p.name in FAST_CONFIGS else pytest.mark.slow)
                                  for p in CONFIGS], ids=[p.name for p in CONFIGS])
def test_the_shipped_config_loads_at_full_size_and_lowers_small(path):
    """The file validates as shipped (its own device count, heads against its mesh, its window and kernels), and
    its train step, shrunk, traces and lowers on 8 CPU devices with the file's axes and options."""
    full = load_config(path)
    assert full.model.family == "gemma3" and full.model.sliding_window > 0, path.name
    cfg = load_config(path, small_overrides(path))
    for section in ("attention", "remat", "tiling", "data"):
        assert getattr(cfg, section) == getattr(full, section), section  # only the model and the mesh shrink
    assert (cfg.model.heads, cfg.model.kv_heads, cfg.mesh.context, cfg.mesh.ring, cfg.compute_dtype) == \
        (full.model.heads, full.model.kv_heads, full.mesh.context, full.mesh.ring, full.compute_dtype)
    mesh = build_mesh(cfg.mesh)
    lowered = step_lib.make_train_step(cfg, mesh).lower(step_lib.abstract_state(cfg, mesh),
                                                        step_lib.abstract_batch(cfg, mesh))
    assert "all_to_all" in lowered.as_text() or cfg.mesh.context == 1


@pytest.mark.slow
@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_the_shipped_config_compiles_small(path):
    """The shrunk train step of each file compiles with XLA on 8 CPU devices (slow tier)."""
    cfg = load_config(path, small_overrides(path))
    compiled = step_lib.compile_train_step(cfg, build_mesh(cfg.mesh))
    assert compiled.memory_analysis() is not None
