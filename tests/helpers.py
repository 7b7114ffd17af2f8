"""Shared test helpers: tiny configs, meshes over the 8 simulated devices, loss and gradients of one batch."""

from __future__ import annotations

import copy
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxlong.config import AttentionConfig, MeshConfig, RematConfig, TilingConfig, load_config, to_dict, validate
from jaxlong.core.mesh import build_mesh
from jaxlong.core.batch import put_batch
from jaxlong.config import runtime
from jaxlong.models.llama import model_graphdef
from jaxlong.training import step as step_lib
from jaxlong.objectives.lm import LanguageModeling
from jaxlong.training.accumulate import loss_and_grads as accumulated

TINY = [
    "model.vocab_size=128", "model.hidden=64", "model.layers=2", "model.heads=8", "model.kv_heads=4",
    "model.head_dim=16", "model.mlp_hidden=96", "seq_len=64", "global_batch=2",
    "attention.block_q=16", "attention.block_k=16", "param_dtype=float32", "compute_dtype=float32",
]


def tiny_cfg(*overrides: str):
    return load_config(None, [*TINY, *overrides])


def mesh_for(cfg, n_devices: int):
    return build_mesh(cfg.mesh, devices=jax.devices()[:n_devices])


def reference_cfg(cfg):
    """The same model and batch on one device: reference attention, no remat, no tiling."""
    ref = copy.deepcopy(cfg)
    ref.mesh = MeshConfig(data=1, fsdp=1, context=1, num_devices=1)
    ref.attention = AttentionConfig(impl="ulysses", backend="reference")
    ref.remat = RematConfig(policy="none")
    ref.tiling = TilingConfig()
    validate(ref)
    return ref


def random_batch(cfg, seed: int = 1) -> dict:
    rng = np.random.default_rng(seed)
    shape = (cfg.global_batch, cfg.seq_len)
    tokens = rng.integers(0, cfg.model.vocab_size, size=(shape[0], shape[1] + 1)).astype(np.int32)
    mask = (rng.random(shape) > 0.2).astype(np.float32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}


def loss_and_grads(cfg, n_devices: int, batch: dict, params_host=None):
    """Loss and gradients (as numpy) of `batch` under `cfg` on the first `n_devices` devices."""
    mesh = mesh_for(cfg, n_devices)
    params = step_lib.init_state(cfg, mesh)["params"]
    if params_host is not None:
        params = jax.tree.map(lambda h, p: jax.device_put(h, p.sharding), params_host, params)
    graphdef = model_graphdef(cfg.model, cfg.param_dtype)
    rt = runtime(cfg, mesh)
    b = put_batch(batch, mesh)
    loss, grads = jax.jit(lambda p, x: accumulated(LanguageModeling(), p, x, 1, graphdef, rt)[:2])(params, b)
    return float(loss), jax.tree.map(np.asarray, grads), jax.tree.map(np.asarray, params)


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
    flat_a = jax.tree_util.tree_flatten_with_path(a)[0]
    flat_b = jax.tree.leaves(b)
    assert len(flat_a) == len(flat_b)
    for (path, x), y in zip(flat_a, flat_b):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=jax.tree_util.keystr(path))


def f32(x):
    return jnp.asarray(x, jnp.float32)


_REFERENCES: dict[tuple[str, int], tuple] = {}


def single_device_reference(cfg, seed: int = 1) -> tuple[dict, float, dict, dict]:
    """(batch, loss, gradients, parameters) of `reference_cfg(cfg)` on one device for `random_batch(cfg, seed)`,
    computed once per test process for each reference config and seed: many parallel cases share one model and
    batch, and so one reference. The arrays are numpy and must not be modified."""
    ref = reference_cfg(cfg)
    key = (json.dumps(to_dict(ref), sort_keys=True), seed)
    if key not in _REFERENCES:
        batch = random_batch(cfg, seed=seed)
        _REFERENCES[key] = (batch, *loss_and_grads(ref, 1, batch))
    return _REFERENCES[key]


def assert_matches_single_device(cfg, seed: int = 1, rtol: float = 1e-5, atol: float = 1e-7):
    """Loss and every gradient of `cfg` on 8 devices equal the dense single-device reference of one batch."""
    batch, ref_loss, ref_grads, params = single_device_reference(cfg, seed)
    loss, grads, _ = loss_and_grads(cfg, 8, batch, params_host=params)
    np.testing.assert_allclose(loss, ref_loss, rtol=rtol)
    assert_trees_close(grads, ref_grads, rtol=rtol, atol=atol)


# The sequence split of the ring tests: over ring x context (zigzag over ring), batch over data x fsdp.
RING_SEQ = P(("data", "fsdp"), ("ring", "context"))


def axes_mesh(devices=None, **sizes: int):
    """The one mesh helper of the tests that build a mesh by hand (not from a config, `mesh_for`): the named axes of
    `data x fsdp x ring x context` with their sizes, in that order, Auto axis types, over the first devices (or
    `devices`): `axes_mesh(fsdp=2, context=4)`, `axes_mesh(context=8)`."""
    names = [a for a in ("data", "fsdp", "ring", "context") if a in sizes]
    return jax.make_mesh(tuple(sizes[a] for a in names), tuple(names), axis_types=(AxisType.Auto,) * len(names),
                         **({"devices": devices} if devices is not None else {}))


def ring_mesh(ring: int, context: int):
    """8 simulated devices as `data 1 x fsdp 8/(ring*context) x ring x context` (Auto axes)."""
    return axes_mesh(data=1, fsdp=8 // (ring * context), ring=ring, context=context)


def tiered(argnames: str, cases, fast, ids=None):
    """A parametrization whose cases not in `fast` are marked `slow`: `pytest.mark.parametrize(*tiered(...))`.

    The fast tier runs the cases of `fast` (chosen so that each parametrized dimension is covered: pairwise, not
    the full product); the slow tier (`pytest -m slow`) runs the rest. `cases` are argument tuples when
    `argnames` names several arguments, plain values otherwise; `ids` their test ids (default: pytest's);
    `fast` holds ids, or case indexes when `ids` is None.

    Raises ValueError: a fast case that is not among the cases.
    """
    cases = list(cases)
    keys = list(ids) if ids is not None else list(range(len(cases)))
    unknown = set(fast) - set(keys)
    if unknown:
        raise ValueError(f"tiered: fast cases {sorted(map(str, unknown))} are not among {keys}")
    several = "," in argnames
    params = [pytest.param(*(case if several else (case,)), marks=() if key in fast else (pytest.mark.slow,),
                           id=None if ids is None else str(key))
              for case, key in zip(cases, keys)]
    return argnames, params


def pairwise(dims: dict, fast: list[tuple], ids: dict | None = None, cover: bool = True):
    """The full product of parametrized dimensions as one `tiered` parametrization: the cases of `fast` in the
    fast tier, the rest marked `slow`. `dims` maps a dimension's argument name(s) to its values: `{"ring": [2, 4,
    8], "heads,kv_heads": [(4, 4), (8, 2)]}` (a key naming several arguments takes tuples). `fast` lists whole
    cases (tuples in the order of `dims`) and must use every value of every dimension at least once, so that
    the fast tier covers each dimension and the slow tier the rest of the product. `ids` maps a dimension to
    the id of each of its values (default `str(value)`). `cover=False` lets the fast cases leave values out
    (a matrix whose fast tier is a sample, such as the kill points).

    Returns `(argnames, params)` for `pytest.mark.parametrize(*pairwise(...))`.
    Raises ValueError: a fast case outside the product, or a value that no fast case uses.
    """
    ids = ids or {}
    for d, (dim, vals) in enumerate(dims.items()):
        missing = [v for v in vals if v not in {case[d] for case in fast}]
        if missing and cover:
            raise ValueError(f"pairwise: the fast cases leave {dim}={missing} untested")
    product = list(itertools.product(*dims.values()))

    def flat(case):
        return tuple(a for dim, v in zip(dims, case) for a in (v if "," in dim else (v,)))

    def name(case):
        return "-".join(ids[dim][list(dims[dim]).index(v)] if dim in ids else str(v) for dim, v in zip(dims, case))

    stray = [c for c in fast if c not in product]
    if stray:
        raise ValueError(f"pairwise: fast cases {stray} are not in the product of {list(dims)}")
    return tiered(",".join(dims), [flat(c) for c in product], fast={name(c) for c in fast},
                  ids=[name(c) for c in product])


# The config.json files of the released Llama-3.1-8B and Qwen3-32B (field for field).
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.43.0.dev0",
    "use_cache": True, "vocab_size": 128256,
}
QWEN3_32B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120, "initializer_range": 0.02,
    "intermediate_size": 25600, "max_position_embeddings": 40960, "max_window_layers": 64, "model_type": "qwen3",
    "num_attention_heads": 64, "num_hidden_layers": 64, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}
