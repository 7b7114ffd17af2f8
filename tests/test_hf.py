"""Hugging Face checkpoints in and out: jaxlong's logits on tiny Llama-3.1 and Qwen3 checkpoints equal
`transformers`' (recorded in tests/fixtures/hf by tests/make_hf_fixtures.py) on one device, under FSDP x Ulysses
and under U-Pipe; RoPE scaling; Qwen3's q/k norms inside U-Pipe (forward and gradients); loading reads one
tensor at a time; bad checkpoints fail before compiling; export -> import is bit-exact; a fine-tune run starts
at transformers' loss."""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from helpers import mesh_for
from jaxlong.config import ConfigError, RopeScalingConfig, load_config
from jaxlong.data import put_on_mesh
from jaxlong.layers import rope_frequencies, rms_norm
from jaxlong.mesh import batch_spec
from jaxlong.model import Runtime, forward, model_graphdef
from jaxlong.models import hf
from jaxlong.models.hf_config import model_config_from_hf

FIX = Path(__file__).parent / "fixtures" / "hf"
MODELS = ("llama31", "qwen3")


def hf_cfg(name: str, *overrides: str, directory: Path | None = None):
    return load_config(None, [f"model.from_hf={directory or FIX / name}", "seq_len=64", "global_batch=2",
                              "attention.block_q=16", "attention.block_k=16", *overrides])


def golden(name: str) -> dict:
    return dict(np.load(FIX / name / "golden.npz"))


def jax_logits(cfg, n_devices: int, tokens: np.ndarray, params=None) -> np.ndarray:
    """Float32 logits `[b, s, vocab]` of `tokens` under `cfg` on the first `n_devices` devices."""
    mesh = mesh_for(cfg, n_devices)
    params = hf.load_params(cfg.model.from_hf, cfg, mesh) if params is None else params
    rt = Runtime(mesh=mesh, cfg=cfg)
    graphdef = model_graphdef(cfg)
    x = put_on_mesh({"t": tokens}, NamedSharding(mesh, batch_spec()))["t"]

    @jax.jit
    def run(p, x):
        hidden, head = forward(graphdef, p, x, rt)
        return jnp.einsum("bsh,hv->bsv", hidden, head)

    return np.asarray(run(params, x))


SETUPS = {
    # name: (overrides, devices)
    "one-device": (["mesh.fsdp=1", "mesh.context=1", "mesh.num_devices=1", "attention.backend=reference"], 1),
    "fsdp2-ulysses4": (["mesh.fsdp=2", "mesh.context=4"], 8),
    "ulysses8": (["mesh.fsdp=1", "mesh.context=8"], 8),
    "fsdp2-upipe4-U=C": (["mesh.fsdp=2", "mesh.context=4", "attention.impl=upipe", "attention.heads_per_stage=4"], 8),
    "fsdp2-upipe4-U=2C": (["mesh.fsdp=2", "mesh.context=4", "attention.impl=upipe",
                           "attention.heads_per_stage=8"], 8),
    "upipe8-U=C": (["mesh.fsdp=1", "mesh.context=8", "attention.impl=upipe", "attention.heads_per_stage=8"], 8),
}


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("name", MODELS)
def test_logits_equal_transformers(name, setup):
    overrides, n = SETUPS[setup]
    cfg = hf_cfg(name, *overrides)
    g = golden(name)
    tokens = np.concatenate([g["prompt"], g["prompt"]])
    got = jax_logits(cfg, n, tokens)
    for row in got:
        diff = float(np.abs(row - g["logits"][0]).max())
        assert diff <= 1e-4, f"{name} {setup}: max |jaxlong - transformers| = {diff}"
