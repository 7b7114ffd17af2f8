"""Gemma 3 checkpoints in and out, against transformers: tiny random `gemma3_text` and multimodal `gemma3`
checkpoints (tests/fixtures/hf, made by tests/make_hf_fixtures.py with transformers 5.25) give transformers'
logits on one device and on FSDP x Ulysses with 1 KV head: sliding-window and global layers, linear x8 RoPE on the
global layers only, `query_pre_attn_scalar` != head_dim, (1 + w) norms, tied head. The 4.x spelling of the config
reads the same; the multimodal checkpoint's language model is read under both names it is saved with and its
vision tower left out; omitted fields take Gemma 3's defaults; fields that change the math and are not implemented
are refused, each named; export -> import is bit-exact and writes the names transformers reads."""

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import mesh_for

from jaxlong.config import ConfigError, load_config
from jaxlong.models import hf
from jaxlong.models.hf_config import model_settings_from_hf

FIX = Path(__file__).parents[1] / "fixtures" / "hf"
ONE = ["mesh.fsdp=1", "mesh.context=1", "mesh.num_devices=1", "attention.backend=reference"]
ULYSSES = ["mesh.fsdp=2", "mesh.context=4"]


def _cfg(directory, *overrides):
    return load_config(None, [f"model.from_hf={directory}", "seq_len=64", "global_batch=2", "attention.block_q=16",
                              "attention.block_k=16", *overrides])


def _logits(directory, overrides, n):
    from test_hf import jax_logits  # noqa: PLC0415

    g = dict(np.load(FIX / Path(directory).name / "golden.npz")) if (FIX / Path(directory).name).is_dir() else None
    return jax_logits(_cfg(directory, *overrides), n, np.concatenate([g["prompt"]] * 2)), g


@pytest.mark.parametrize("name,setup", [("gemma3_text", "one"), ("gemma3_text", "fsdp2-ulysses4"),
                                        pytest.param("gemma3", "one", marks=pytest.mark.slow)])
def test_logits_equal_transformers(name, setup):
    got, g = _logits(FIX / name, ONE if setup == "one" else ULYSSES, 1 if setup == "one" else 8)
    for row in got:
        diff = float(np.abs(row - g["logits"][0]).max())
        assert diff <= 1e-4, f"{name} {setup}: max |jaxlong - transformers| = {diff}"


def test_the_settings_are_gemma3s():
    m = _cfg(FIX / "gemma3_text").model
    assert (m.family, m.sliding_window, m.query_pre_attn_scalar, m.rope_local_theta, m.rope_theta) == (
        "gemma3", 8, 24.0, 10000.0, 1000000.0)
    assert (m.rope_scaling.type, m.rope_scaling.factor, m.tie_embeddings) == ("linear", 8.0, True)
    assert m.layer_types == ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    assert model_settings_from_hf(FIX / "gemma3") | {"name": "x", "from_hf": "x"} == (
        model_settings_from_hf(FIX / "gemma3_text") | {"name": "x", "from_hf": "x"})


def _spelled_4x(src: Path, dst: Path) -> Path:
    """A copy of `src` whose config.json is spelled as transformers 4.5x wrote it: `rope_theta`,
    `rope_local_base_freq`, `rope_scaling` (the global layers'), `sliding_window_pattern` without `layer_types`."""
    shutil.copytree(src, dst)
    c = json.loads((dst / "config.json").read_text())
    params = c.pop("rope_parameters")
    c.pop("layer_types")
    c.update(rope_theta=params["full_attention"]["rope_theta"], sliding_window_pattern=2,
             rope_local_base_freq=params["sliding_attention"]["rope_theta"],
             rope_scaling={"rope_type": "linear", "factor": params["full_attention"]["factor"]})
    (dst / "config.json").write_text(json.dumps(c))
    return dst


def test_the_4x_spelling_reads_the_same_and_gives_the_same_logits(tmp_path):
    old = _spelled_4x(FIX / "gemma3_text", tmp_path / "gemma3_text")
    new, was = _cfg(FIX / "gemma3_text").model, _cfg(old).model
    assert (was.rope_theta, was.rope_local_theta, was.rope_scaling, was.sliding_window_pattern) == (
        new.rope_theta, new.rope_local_theta, new.rope_scaling, 2)
    got, g = _logits(old, ONE, 1)
    assert float(np.abs(got[0] - g["logits"][0]).max()) <= 1e-4


def test_the_multimodal_checkpoint_under_both_names_loads_its_language_model(tmp_path):
    """transformers 5.25 saves a multimodal checkpoint as the Hub's files hold it (`language_model.model.*`,
    `vision_tower.*`); transformers 4.52 to 4.5x wrote its module names (`model.language_model.*`,
    `model.vision_tower.*`): both load the text model's parameters; the vision tower's tensors are left out."""
    from safetensors.numpy import load_file, save_file  # noqa: PLC0415

    tensors = load_file(str(FIX / "gemma3" / "model.safetensors"))
    assert any(k.startswith("vision_tower.") for k in tensors) and "language_model.model.norm.weight" in tensors
    moved = tmp_path / "gemma3"
    shutil.copytree(FIX / "gemma3", moved)
    renamed = {("model." + k.replace("language_model.model.", "language_model.")
                if not k.startswith("lm_head") else k): v for k, v in tensors.items()}
    assert "model.language_model.norm.weight" in renamed and any(k.startswith("model.vision_tower.") for k in renamed)
    save_file(renamed, str(moved / "model.safetensors"), metadata={"format": "pt"})
    text_cfg = _cfg(FIX / "gemma3_text", *ONE)
    mesh = mesh_for(text_cfg, 1)
    want = hf.load_params(FIX / "gemma3_text", text_cfg.model, mesh)
    for directory in (FIX / "gemma3", moved):
        got = hf.load_params(directory, _cfg(directory, *ONE).model, mesh)
        for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
            assert np.array_equal(np.asarray(x), np.asarray(y)), (directory, jax.tree_util.keystr(path))


def _write(tmp_path, config: dict) -> Path:
    d = tmp_path / "ckpt"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_omitted_fields_take_gemma3s_defaults(tmp_path):
    m = model_settings_from_hf(_write(tmp_path, {"model_type": "gemma3", "text_config": {"num_hidden_layers": 34}}))
    assert (m["hidden"], m["heads"], m["kv_heads"], m["head_dim"], m["mlp_hidden"], m["vocab_size"]) == (
        2304, 8, 4, 256, 9216, 262208)
    assert (m["sliding_window"], m["sliding_window_pattern"], m["query_pre_attn_scalar"], m["norm_eps"]) == (
        4096, 6, 256.0, 1e-6)
    assert (m["rope_theta"], m["rope_local_theta"], m["tie_embeddings"], m["layers"]) == (1e6, 1e4, True, 34)


@pytest.mark.parametrize("field,value,match", [
    ("final_logit_softcapping", 30.0, "final_logit_softcapping=30.0 is not supported"),
    ("attn_logit_softcapping", 50.0, "attn_logit_softcapping=50.0 is not supported"),
    ("attention_bias", True, "attention_bias=True is not supported"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention=True is not supported"),
    ("hidden_activation", "gelu", "hidden_activation='gelu' is not supported"),
    ("model_type", "gemma3n_text", "Gemma 3n is not Gemma 3"),
])
def test_what_changes_the_math_and_is_not_implemented_is_refused_naming_it(tmp_path, field, value, match):
    c = json.loads((FIX / "gemma3_text" / "config.json").read_text()) | {field: value}
    with pytest.raises(ConfigError, match=match) as e:
        model_settings_from_hf(_write(tmp_path, c))
    assert "\n" not in str(e.value)


def test_import_export_import_is_bit_exact_and_writes_what_transformers_reads(tmp_path):
    cfg = _cfg(FIX / "gemma3_text", *ONE)
    mesh = mesh_for(cfg, 1)
    first = hf.load_params(FIX / "gemma3_text", cfg.model, mesh)
    out = hf.save_hf(first, cfg.model, tmp_path / "out", seq_len=cfg.seq_len, param_dtype="float32",
                     source=FIX / "gemma3_text")
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "gemma3_text" and written["layer_types"][1] == "full_attention"
    assert written["rope_parameters"]["full_attention"] == {"rope_type": "linear", "factor": 8.0,
                                                           "rope_theta": 1000000.0}
    second = hf.load_params(out, _cfg(out, *ONE).model, mesh)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(first)[0], jax.tree.leaves(second)):
        assert np.array_equal(np.asarray(a), np.asarray(b)), jax.tree_util.keystr(path)
    from safetensors.numpy import load_file  # noqa: PLC0415

    original, exported = load_file(str(FIX / "gemma3_text" / "model.safetensors")), {}
    for f in out.glob("*.safetensors"):
        exported.update(load_file(str(f)))
    assert set(original) == set(exported)
    assert all(np.array_equal(original[k], exported[k]) for k in original)
