"""Hugging Face checkpoints in and out: jaxlong's logits on tiny Llama-3.1 and Qwen3 checkpoints equal
`transformers`' (recorded in tests/fixtures/hf by tests/make_hf_fixtures.py) on one device, under FSDP x Ulysses
and under U-Pipe; RoPE scaling; Qwen3's q/k norms inside U-Pipe (forward and gradients); loading reads one
tensor at a time; bad checkpoints fail before compiling; export -> import is bit-exact; a fine-tune run starts
at transformers' loss."""

import json
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import LLAMA31_8B, QWEN3_32B, mesh_for, tiered
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlong.config import ConfigError, RopeScalingConfig, load_config, model_config_from_hf
from jaxlong.core.batch import put_batch
from jaxlong.layers.blocks import rms_norm, rope_frequencies
from jaxlong.models import hf
from jaxlong.config import runtime
from jaxlong.models.llama import forward, model_graphdef


FIX = Path(__file__).parents[1] / "fixtures" / "hf"
MODELS = ("llama31", "qwen3")


def hf_cfg(name: str, *overrides: str, directory: Path | None = None):
    return load_config(None, [f"model.from_hf={directory or FIX / name}", "seq_len=64", "global_batch=2",
                              "attention.block_q=16", "attention.block_k=16", *overrides])


def golden(name: str) -> dict:
    return dict(np.load(FIX / name / "golden.npz"))


def jax_logits(cfg, n_devices: int, tokens: np.ndarray, params=None, positions=None, segment_ids=None) -> np.ndarray:
    """Float32 logits `[b, s, vocab]` of `tokens` under `cfg` on the first `n_devices` devices (with the packed
    batch's `positions` and `segment_ids` when given)."""
    mesh = mesh_for(cfg, n_devices)
    params = hf.load_params(cfg.model.from_hf, cfg.model, mesh, cfg.param_dtype) if params is None else params
    rt = runtime(cfg, mesh)
    graphdef = model_graphdef(cfg.model, cfg.param_dtype)
    extra = {k: v for k, v in (("positions", positions), ("segment_ids", segment_ids)) if v is not None}
    x = put_batch({"t": tokens, **extra}, mesh)

    @jax.jit
    def run(p, x):
        hidden, head = forward(graphdef, p, x["t"], rt, x.get("positions"), x.get("segment_ids"))
        return jnp.einsum("bsh,hv->bsv", hidden, head)

    return np.asarray(run(params, x))


def _upipe(fsdp: int, context: int, u: int) -> list[str]:
    return [f"mesh.fsdp={fsdp}", f"mesh.context={context}", "attention.impl=upipe", f"attention.heads_per_stage={u}"]


SETUPS = {
    # name: (overrides, devices)
    "one-device": (["mesh.fsdp=1", "mesh.context=1", "mesh.num_devices=1", "attention.backend=reference"], 1),
    "fsdp2-ulysses4": (["mesh.fsdp=2", "mesh.context=4"], 8),
    "ulysses8": (["mesh.fsdp=1", "mesh.context=8"], 8),
    "fsdp2-upipe4-U=C": (_upipe(2, 4, 4), 8),
    "fsdp2-upipe4-U=2C": (_upipe(2, 4, 8), 8),
    "upipe8-U=C": (_upipe(1, 8, 8), 8),
    "upipe8-U=2C": (_upipe(1, 8, 16), 8),
}
PACKED_SETUPS = ["one-device", "fsdp2-ulysses4", "fsdp2-upipe4-U=C", "fsdp2-upipe4-U=2C", "upipe8-U=C", "upipe8-U=2C"]


def _heads(name: str) -> tuple[int, int]:
    """(query heads, KV heads) of fixture `name` (its config.json)."""
    c = json.loads((FIX / name / "config.json").read_text())
    return c["num_attention_heads"], c["num_key_value_heads"]


def _fits(name: str, setup: str) -> bool:
    """Whether fixture `name` has enough query heads for `setup`'s U-Pipe stages (U = heads_per_stage divides
    the heads): the Llama fixture's 8 heads cannot make a stage of U = 2C = 16 heads at C = 8; the Qwen3
    fixture's 16 can, so every setup runs on at least one fixture (test_fixtures_cover_every_setup)."""
    u = [int(o.split("=")[1]) for o in SETUPS[setup][0] if o.startswith("attention.heads_per_stage=")]
    return not u or _heads(name)[0] % u[0] == 0


def _cases(setups) -> list:
    return [pytest.param(name, s, id=f"{name}-{s}") for s in setups for name in MODELS if _fits(name, s)]


LOGIT_CASES, PACKED_CASES = _cases(SETUPS), _cases(PACKED_SETUPS)


def test_fixtures_cover_every_setup():
    """Every setup (U-Pipe with U = C and U = 2C at C = 4 and C = 8 included) runs on at least one fixture, for
    the logits and for the packed logits, and the fixtures' KV heads are split over the context axis (H_kv >= C)
    in some context-parallel setup and replicated (H_kv < C) in another."""
    for cases, setups in ((LOGIT_CASES, SETUPS), (PACKED_CASES, PACKED_SETUPS)):
        assert {c.values[1] for c in cases} == set(setups)
    assert ("qwen3", "upipe8-U=2C") in [c.values for c in PACKED_CASES]
    contexts = {4, 8}
    kv = {_heads(name)[1] >= c for name in MODELS for c in contexts}
    assert kv == {True, False}, {name: _heads(name) for name in MODELS}


@pytest.mark.parametrize("name, setup", LOGIT_CASES)
def test_logits_equal_transformers(name, setup):
    overrides, n = SETUPS[setup]
    cfg = hf_cfg(name, *overrides)
    g = golden(name)
    tokens = np.concatenate([g["prompt"], g["prompt"]])
    got = jax_logits(cfg, n, tokens)
    for row in got:
        diff = float(np.abs(row - g["logits"][0]).max())
        assert diff <= 1e-4, f"{name} {setup}: max |jaxlong - transformers| = {diff}"


@pytest.mark.parametrize("name, setup", PACKED_CASES)
def test_packed_logits_equal_transformers(name, setup):
    """Two documents packed in one row (segment ids 1 and 2, positions restarting at 0) give each document the
    logits transformers gives it alone: the recorded prompt's logits cut to each document's length."""
    overrides, n = SETUPS[setup]
    g = golden(name)
    a = 40  # the first document's length; the second takes the rest of the row
    b = g["prompt"].shape[1] - a
    tokens = np.concatenate([g["prompt"][:, :a], g["prompt"][:, :b]], axis=1)
    seg = np.concatenate([np.ones((1, a)), np.full((1, b), 2)], axis=1).astype(np.int32)
    pos = np.concatenate([np.arange(a), np.arange(b)])[None].astype(np.int32)
    rows = [np.concatenate([tokens, tokens]), np.concatenate([seg, seg]), np.concatenate([pos, pos])]
    got = jax_logits(hf_cfg(name, *overrides), n, rows[0], positions=rows[2], segment_ids=rows[1])
    want = np.concatenate([g["logits"][0, :a], g["logits"][0, :b]])
    for row in got:
        diff = float(np.abs(row - want).max())
        assert diff <= 1e-4, f"{name} {setup}: max |jaxlong - transformers| = {diff}"


def test_scaling_matters_and_rope_theta_overrides_the_checkpoint():
    """The llama3 scaling of the Llama-3.1 fixture changes its logits (so the match above tests it), and
    `model.rope_theta` / `model.rope_scaling.*` override config.json's values."""
    one = SETUPS["one-device"][0]
    g = golden("llama31")
    tokens = np.concatenate([g["prompt"], g["prompt"]])
    cfg = hf_cfg("llama31", *one, "model.rope_scaling.type=none", "model.rope_theta=10000.0")
    assert cfg.model.rope_theta == 10000.0 and cfg.model.rope_scaling.type == "none"
    assert float(np.abs(jax_logits(cfg, 1, tokens)[0] - g["logits"][0]).max()) > 1e-2
    base = hf_cfg("llama31")
    assert (base.model.rope_theta, base.model.rope_scaling.type, base.model.rope_scaling.factor) == (500000.0, "llama3", 8.0)
    assert base.model.rope_scaling.original_max_position_embeddings == 256 and not base.model.qk_norm
    q = hf_cfg("qwen3")
    assert q.model.qk_norm and q.model.tie_embeddings and q.model.head_dim == 16 and q.model.hidden == 32
    with pytest.raises(ConfigError, match="model.hidden=128 conflicts with model.from_hf"):
        hf_cfg("qwen3", "model.hidden=128")


def test_rope_frequencies_equal_transformers():
    """linear, llama3 and yarn (with its attention factor) inverse frequencies equal transformers' (rope.npz)."""
    ref = np.load(FIX / "rope.npz")
    cases = json.loads(str(ref["cases"]))
    for i, case in enumerate(cases):
        p = dict(case["params"])
        kind = {"default": "none"}.get(p.pop("rope_type"), case["params"]["rope_type"])
        scaling = RopeScalingConfig(type=kind, **p)
        inv, factor = rope_frequencies(case["head_dim"], case["theta"], scaling)
        np.testing.assert_allclose(inv, ref[f"inv_freq_{i}"], rtol=2e-6, err_msg=str(case))
        np.testing.assert_allclose(factor, float(ref[f"attention_factor_{i}"]), rtol=1e-7, err_msg=str(case))


# ------------------------------------------------------------------------------------------------------
# Qwen3's q/k norms and RoPE scaling inside U-Pipe: forward and every gradient against a dense reference.

UPIPE_CASES = {"gqa4-U=C": (16, 4, 4, 4, 2), "gqa4-U=2C": (16, 4, 4, 8, 2), "kv<C-U=C": (16, 2, 8, 8, 1)}
YARN = RopeScalingConfig(type="yarn", factor=4.0, original_max_position_embeddings=16)


def _dense_sublayer(x, scale, wq, wk, wv, wo, qn, kn, scaling):
    from jaxlong.kernels.blockwise import reference_attention  # noqa: PLC0415
    from jaxlong.layers.blocks import apply_rope, rope_tables  # noqa: PLC0415

    h = rms_norm(x, scale, 1e-6)
    pos = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
    cos, sin = rope_tables(pos, wq.shape[-1], 10000.0, scaling)
    q = apply_rope(rms_norm(jnp.einsum("bsh,hnd->bsnd", h, wq), qn, 1e-6), cos, sin)
    k = apply_rope(rms_norm(jnp.einsum("bsh,hnd->bsnd", h, wk), kn, 1e-6), cos, sin)
    v = jnp.einsum("bsh,hnd->bsnd", h, wv)
    return x + jnp.einsum("bsnd,ndh->bsh", reference_attention(q, k, v), wo)


@pytest.mark.parametrize(*tiered("case", list(UPIPE_CASES), ids=list(UPIPE_CASES), fast={"gqa4-U=2C"}))
def test_upipe_qk_norm_and_yarn_match_dense(case):
    """U-Pipe normalizes each stage's query heads and its KV group's key heads inside the op; the loss and the
    gradients of x, the attention norm, W_q, W_k, W_v, W_o, q_norm and k_norm equal autodiff of the dense
    sublayer (q/k norm, YaRN-scaled RoPE with its attention factor, reference attention)."""
    from jaxlong.parallel.record import SublayerContext, SublayerWeights  # noqa: PLC0415
    from jaxlong.parallel.upipe import upipe_attention  # noqa: PLC0415

    heads, kv, context, u, fsdp = UPIPE_CASES[case]
    mesh = jax.make_mesh((1, fsdp, context), ("data", "fsdp", "context"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    ks = jax.random.split(jax.random.key(3), 9)
    b, s, hidden, d = fsdp, 64, 32, 8
    x = jax.random.normal(ks[0], (b, s, hidden))
    args = (x, 1 + 0.1 * jax.random.normal(ks[1], (hidden,)),
            jax.random.normal(ks[2], (hidden, heads, d)) / hidden**0.5,
            jax.random.normal(ks[3], (hidden, kv, d)) / hidden**0.5,
            jax.random.normal(ks[4], (hidden, kv, d)) / hidden**0.5,
            jax.random.normal(ks[5], (heads, d, hidden)) / (heads * d) ** 0.5,
            1 + 0.3 * jax.random.normal(ks[6], (d,)), 1 + 0.3 * jax.random.normal(ks[7], (d,)))
    ct = jax.random.normal(ks[8], x.shape)
    args = (jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp"), "context", None))),) + args[1:]

    def fused(x, scale, wq, wk, wv, wo, qn, kn):
        ctx = SublayerContext(mesh, heads_per_stage=u, backend="blockwise", block_q=16, block_k=16, norm_eps=1e-6,
                              rope_scaling=YARN)
        y = upipe_attention(x, SublayerWeights(scale, wq, wk, wv, wo, (qn, kn)), ctx)
        return jnp.sum(y * ct)

    def dense(*a):
        return jnp.sum(_dense_sublayer(*a, YARN) * ct)

    np.testing.assert_allclose(jax.jit(fused)(*args), jax.jit(dense)(*args), rtol=1e-5)
    g_fused = jax.jit(jax.grad(fused, argnums=range(8)))(*args)
    g_dense = jax.jit(jax.grad(dense, argnums=range(8)))(*args)
    for name, a, c in zip(("dx", "d_scale", "dWq", "dWk", "dWv", "dWo", "d_q_norm", "d_k_norm"), g_fused, g_dense):
        assert float(jnp.abs(c).max()) > 0, name
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("impl", [["attention.impl=ulysses"], ["attention.impl=upipe", "attention.heads_per_stage=8"]])
def test_qk_norm_and_rope_scaling_model_matches_single_device(impl):
    """A Qwen3-style model (q/k norms, head_dim 16 != hidden/heads) with llama3 RoPE scaling: loss and every
    gradient (q_norm, k_norm included) on 2-way FSDP x 4-way context equal the single-device reference."""
    from helpers import assert_matches_single_device, tiny_cfg  # noqa: PLC0415

    cfg = tiny_cfg("mesh.fsdp=2", "mesh.context=4", "model.kv_heads=2", "model.qk_norm=true",
                   "model.rope_scaling.type=llama3", "model.rope_scaling.factor=8.0",
                   "model.rope_scaling.original_max_position_embeddings=32", *impl)
    assert_matches_single_device(cfg, seed=3)


# ------------------------------------------------------------------------------------------------------
# Loading: one tensor at a time, the plan's bytes, errors before compiling.


class CountingReader(hf.SafetensorsReader):
    """Records every read: (tensor name, bytes)."""

    def __init__(self, directory):
        super().__init__(directory)
        self.reads: list[tuple[str, int]] = []

    def read(self, name, index):
        out = super().read(name, index)
        self.reads.append((name, out.nbytes))
        return out


@pytest.mark.parametrize("name", MODELS)
def test_loading_reads_one_tensor_at_a_time_into_the_planned_shardings(name):
    """Reads come tensor by tensor (no tensor is read again after another one started), the bytes read for
    one tensor never exceed its size (each device reads only its slice; identical slices are read once), and
    every parameter lands in its FSDP sharding with the per-device bytes of the plan."""
    from jaxlong.plan.planner import shard_bytes  # noqa: PLC0415
    from jaxlong.training.step import abstract_state  # noqa: PLC0415

    cfg = hf_cfg(name, "mesh.fsdp=8", "mesh.context=1", "global_batch=8")
    mesh = mesh_for(cfg, 8)
    reader = CountingReader(FIX / name)
    params = hf.load_params(FIX / name, cfg.model, mesh, cfg.param_dtype, reader=reader)
    order = [n for i, (n, _) in enumerate(reader.reads) if i == 0 or reader.reads[i - 1][0] != n]
    assert len(order) == len(set(order)), "a tensor was read again after another one"
    itemsize = {"BF16": 2, "F32": 4}
    for n in order:
        total = sum(b for m, b in reader.reads if m == n)
        full = int(np.prod(reader.shape(n))) * itemsize[reader._slice(n).get_dtype()]
        assert total <= full, (n, total, full)
    assert any(b < int(np.prod(reader.shape(n))) * itemsize[reader._slice(n).get_dtype()] for n, b in reader.reads)
    plan = abstract_state(cfg, mesh)["params"]
    assert shard_bytes(params) == shard_bytes(plan)
    for a, p in zip(jax.tree.leaves(params), jax.tree.leaves(plan)):
        assert a.sharding == p.sharding and a.shape == p.shape and a.dtype == p.dtype


def _rewrite(tmp_path, name, edit) -> Path:
    """A copy of fixture `name` whose tensors are `edit(dict of numpy arrays)`, in one safetensors file."""
    from safetensors.numpy import load_file, save_file  # noqa: PLC0415

    out = tmp_path / name
    shutil.copytree(FIX / name, out)
    tensors = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
        f.unlink()
    (out / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(edit(tensors), str(out / "model.safetensors"))
    return out


def _edit_config(tmp_path, name, **changes) -> Path:
    out = tmp_path / f"{name}-cfg"
    shutil.copytree(FIX / name, out)
    c = json.loads((out / "config.json").read_text())
    c.update(changes)
    (out / "config.json").write_text(json.dumps(c))
    return out


def test_bad_checkpoints_fail_before_compiling(tmp_path):
    def drop(t):
        del t["model.layers.1.self_attn.k_norm.weight"]
        return t

    def add(t):
        t["model.layers.0.self_attn.q_proj.bias"] = np.zeros(128, np.float32)
        return t

    def reshape(t):
        t["model.layers.0.mlp.up_proj.weight"] = np.zeros((65, 32), np.float32)
        return t

    mesh = mesh_for(hf_cfg("qwen3"), 8)
    for edit, match in ((drop, "missing .*model.layers.1.self_attn.k_norm.weight"),
                        (add, "does not have: model.layers.0.self_attn.q_proj.bias"),
                        (reshape, r"model.layers.0.mlp.up_proj.weight has shape \[65, 32\] but config.json implies \[64, 32\]")):
        d = _rewrite(tmp_path / edit.__name__, "qwen3", edit)
        with pytest.raises(ConfigError, match=match):
            hf.load_params(d, hf_cfg("qwen3", directory=d).model, mesh)
    with pytest.raises(ConfigError, match="model_type 'mistral' is not supported"):
        hf_cfg("qwen3", directory=_edit_config(tmp_path / "a", "qwen3", model_type="mistral"))
    rope = {"rope_type": "longrope", "rope_theta": 1e6}
    with pytest.raises(ConfigError, match="rope scaling type 'longrope' is not supported"):
        hf_cfg("qwen3", directory=_edit_config(tmp_path / "b", "qwen3", rope_parameters=rope))
    with pytest.raises(ConfigError, match=r"fields \['moe_experts'\] are not supported"):
        hf_cfg("qwen3", directory=_edit_config(tmp_path / "c", "qwen3", moe_experts=8))
    with pytest.raises(ConfigError, match="attention_bias=True is not supported"):
        hf_cfg("qwen3", directory=_edit_config(tmp_path / "d", "qwen3", attention_bias=True))
    small = _rewrite(tmp_path / "small", "qwen3", lambda t: {
        k: (v[:100] if k == "model.embed_tokens.weight" else v) for k, v in t.items()})
    c = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps(dict(c, vocab_size=100)))
    with pytest.raises(ConfigError, match="tokenizer.json has 1\\d\\d tokens but the embedding has 100 rows"):
        hf.check_checkpoint(small, hf_cfg("qwen3", directory=small).model)


# ------------------------------------------------------------------------------------------------------
# Export and fine-tuning.


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_import_export_import_is_bit_exact(tmp_path, param_dtype):
    from safetensors.numpy import load_file  # noqa: PLC0415

    cfg = hf_cfg("llama31", f"param_dtype={param_dtype}")
    mesh = mesh_for(cfg, 8)
    first = hf.load_params(FIX / "llama31", cfg.model, mesh, cfg.param_dtype)
    out = hf.save_hf(first, cfg.model, tmp_path / "out", seq_len=cfg.seq_len, param_dtype=cfg.param_dtype,
                     source=FIX / "llama31", max_shard_bytes=60_000)
    assert len(list(out.glob("model-*.safetensors"))) > 1 and (out / "tokenizer.json").is_file()
    umask = os.umask(0o022)
    os.umask(umask)
    modes = {f.name: oct(f.stat().st_mode & 0o777) for f in out.iterdir()}
    assert set(modes.values()) == {oct(0o666 & ~umask)}, modes  # as a plain write leaves config.json
    again = hf_cfg("llama31", f"param_dtype={param_dtype}", directory=out)
    second = hf.load_params(out, again.model, mesh, again.param_dtype)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(first)[0], jax.tree.leaves(second)):
        assert np.array_equal(np.asarray(a), np.asarray(b)), jax.tree_util.keystr(path)
    # The exported tensors are the original (bf16) ones, exactly.
    original = {}
    for f in (FIX / "llama31").glob("*.safetensors"):
        original.update(load_file(str(f)))
    exported = {}
    for f in out.glob("*.safetensors"):
        exported.update(load_file(str(f)))
    assert set(original) == set(exported)
    for k in original:
        assert np.array_equal(original[k].astype(np.float32), exported[k].astype(np.float32)), k
    config = json.loads((out / "config.json").read_text())
    assert config["rope_scaling"]["rope_type"] == "llama3" and config["max_position_embeddings"] == 2048


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_fine_tune_starts_at_transformers_loss_and_exports(tmp_path, name):
    """`python -m jaxlong.train model.from_hf=...` on corpus.txt: the model's loss on the fixture's batch equals
    the loss transformers computed on it (golden.npz), and the trainer's first step reports the model's loss on
    its own first batch (the Grain pipeline's, packed documents); `python -m jaxlong.export` writes a checkpoint
    whose logits (read back by jaxlong, and by transformers when it is installed) equal the trained model's."""
    from jaxlong import data as data_lib  # noqa: PLC0415
    from jaxlong.export import __main__ as export_lib  # noqa: PLC0415
    from jaxlong.recipes import train as run  # noqa: PLC0415

    g = golden(name)

    def model_loss(cfg, batch):
        logits = jax_logits(cfg, 1, np.asarray(batch["inputs"]), positions=batch.get("positions"),
                            segment_ids=batch.get("segment_ids")).astype(np.float64)
        lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
        target = np.take_along_axis(logits, np.asarray(batch["targets"])[..., None], -1)[..., 0]
        mask = np.asarray(batch.get("mask", np.ones(target.shape)), np.float64)
        return float(((lse - target) * mask).sum() / mask.sum())

    one = ("mesh.num_devices=1", "mesh.fsdp=1", "mesh.context=1")
    assert abs(model_loss(hf_cfg(name, *one), {"inputs": g["batch_inputs"], "targets": g["batch_targets"]})
               - float(g["batch_loss"])) <= 1e-4
    common = [f"data.path={FIX / 'corpus.txt'}", f"run_dir={tmp_path}", "checkpoint_every=2", "eval_every=0"]
    cfg = hf_cfg(name, *common, "steps=1", "run_name=first")
    batch = next(data_lib.batch_iterator(cfg, data_lib.HFTokenizer(FIX / name)))
    first = run(cfg)["metrics"]["loss"]
    assert abs(first - model_loss(hf_cfg(name, *one), batch)) <= 1e-4, first
    run(hf_cfg(name, *common, "steps=2", "run_name=ft"))
    assert export_lib.main([str(tmp_path / "ft"), "--out", str(tmp_path / "hf")]) == 0
    _, cfg, trained = export_lib.restore_params(tmp_path / "ft")
    cfg = hf_cfg(name, "mesh.fsdp=2", "mesh.context=4")
    tokens = np.concatenate([g["prompt"], g["prompt"]])
    shardings = jax.tree.map(lambda a: a.sharding, hf.load_params(FIX / name, cfg.model, mesh_for(cfg, 8), cfg.param_dtype))
    want = jax_logits(cfg, 8, tokens, params=jax.tree.map(lambda a, s: jax.device_put(np.asarray(a), s), trained,
                                                          shardings))
    assert float(np.abs(want[0] - g["logits"][0]).max()) > 1e-3  # training changed the model
    got = jax_logits(hf_cfg(name, "mesh.fsdp=2", "mesh.context=4", directory=tmp_path / "hf"), 8, tokens)
    np.testing.assert_array_equal(got, want)
    try:
        import torch  # noqa: PLC0415
        import transformers  # noqa: PLC0415
    except ImportError:
        return
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(g["prompt"]).long()).logits.numpy()
    assert float(np.abs(ref[0] - want[0]).max()) <= 1e-4


def test_export_cli_errors(tmp_path, capsys):
    from jaxlong.export import __main__ as export_lib  # noqa: PLC0415

    assert export_lib.main([str(tmp_path / "nothing"), "--out", str(tmp_path / "o")]) == 2
    assert "no checkpoint" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert export_lib.main([str(tmp_path), "--out", str(tmp_path / "full")]) == 2
    assert "not empty" in capsys.readouterr().err


@pytest.mark.parametrize("hf_json, yaml", [(LLAMA31_8B, "llama3_1_8b.yaml"), (QWEN3_32B, "qwen3_32b.yaml")])
def test_released_configs_read_as_the_shipped_configs(tmp_path, hf_json, yaml):
    """The released checkpoints' config.json files give the architecture of configs/*.yaml, and the export
    writes the same architecture back."""
    from jaxlong.models.hf_config import hf_config_dict  # noqa: PLC0415

    (tmp_path / "config.json").write_text(json.dumps(hf_json))
    got = model_config_from_hf(tmp_path)
    want = load_config(Path(__file__).parents[2] / "configs" / yaml).model
    fields = ("vocab_size", "hidden", "layers", "heads", "kv_heads", "head_dim", "mlp_hidden", "rope_theta",
              "norm_eps", "tie_embeddings", "qk_norm", "rope_scaling")
    assert {f: getattr(got, f) for f in fields} == {f: getattr(want, f) for f in fields}
    back = hf_config_dict(got, model_type=hf_json["model_type"], context=got.max_position_embeddings)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                "max_position_embeddings", "vocab_size", "rms_norm_eps", "tie_word_embeddings"):
        assert back[key] == hf_json[key], key
    assert back.get("rope_scaling") == (dict(hf_json["rope_scaling"]) if hf_json["rope_scaling"] else None)


def test_transformers5_config_imports_and_computation_fields_are_refused(tmp_path):
    """A config.json as transformers 5.25's save_pretrained writes it (SmolLM2-135M: `_model_name_or_path`,
    `unk_token_id`, `dtype`, `rope_parameters`) and the fields `PretrainedConfig` adds for every model read as
    the architecture; a field that changes the computation is still refused, naming it."""
    import smollm2  # noqa: PLC0415

    every_model = {"_name_or_path": "x", "_commit_hash": None, "id2label": {"0": "LABEL_0"},
                   "label2id": {"LABEL_0": 0}, "problem_type": None, "output_hidden_states": False,
                   "return_dict": True, "is_encoder_decoder": False, "chunk_size_feed_forward": 0,
                   "torch_dtype": "bfloat16", "sep_token_id": None, "pruned_heads": {}}
    (tmp_path / "config.json").write_text(json.dumps({**smollm2.CONFIG, **every_model}))
    got = model_config_from_hf(tmp_path)
    assert (got.vocab_size, got.hidden, got.layers, got.heads, got.kv_heads, got.head_dim, got.mlp_hidden) == \
        (49152, 576, 30, 9, 3, 64, 1536)
    assert (got.rope_theta, got.tie_embeddings, got.norm_eps, got.rope_scaling.type) == \
        (100000.0, True, smollm2.CONFIG["rms_norm_eps"], "none")
    for field, value, match in (("pruned_heads", {"0": [1]}, "pruned_heads=.* is not supported"),
                                ("is_encoder_decoder", True, "is_encoder_decoder=True is not supported"),
                                ("num_experts", 8, r"fields \['num_experts'\] are not supported"),
                                ("hidden_act", "gelu", "hidden_act='gelu' is not supported")):
        (tmp_path / "config.json").write_text(json.dumps({**smollm2.CONFIG, field: value}))
        with pytest.raises(ConfigError, match=match):
            model_config_from_hf(tmp_path)


def test_rope_scaling_options_are_validated():
    from helpers import tiny_cfg  # noqa: PLC0415

    with pytest.raises(ConfigError, match="model.rope_scaling.type='ntk' is not allowed; choose one of: none, linear"):
        tiny_cfg("model.rope_scaling.type=ntk")
    with pytest.raises(ConfigError, match="needs model.rope_scaling.original_max_position_embeddings"):
        tiny_cfg("model.rope_scaling.type=yarn", "model.rope_scaling.factor=4.0")
    with pytest.raises(ConfigError, match="model.rope_scaling.factor=0.0 must be positive"):
        tiny_cfg("model.rope_scaling.type=linear", "model.rope_scaling.factor=0")
    cfg = tiny_cfg("model.rope_scaling.type=yarn", "model.rope_scaling.factor=4",
                   "model.rope_scaling.original_max_position_embeddings=4096", "model.rope_scaling.attention_factor=1.2")
    assert cfg.model.rope_scaling == RopeScalingConfig(type="yarn", factor=4.0, original_max_position_embeddings=4096,
                                                       attention_factor=1.2)


# A chat template as transformers 5 writes it beside the tokenizer (chat_template.jinja).
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.mark.slow
def test_run_directory_stands_alone(tmp_path, capsys):
    """A run trained from a Hugging Face directory keeps its tokenizer files in RUN_DIR/imported/ (their sha256 in
    the saved config). Once the directory is moved away, `python -m jaxlong.eval`, `python -m jaxlong.export` (the
    tokenizer, chat template, generation config and token ids included) and `--resume` with the same command line
    work, and so does a recipe's next stage; a changed copy is refused in one line; a run from before copies were kept names the override that works,
    and with it evaluates into the same setup directory."""
    import hashlib  # noqa: PLC0415

    from tokenizers import Tokenizer  # noqa: PLC0415

    from jaxlong.eval import __main__ as eval_cli  # noqa: PLC0415
    from jaxlong.export import __main__ as export_cli  # noqa: PLC0415
    from jaxlong.training.checkpoint import saved_config  # noqa: PLC0415
    from jaxlong.recipes import train as run  # noqa: PLC0415
    from jaxlong.recipes import expand, run_recipe  # noqa: PLC0415

    imp, moved, run_dir = tmp_path / "imp", tmp_path / "moved", tmp_path / "runs" / "ft"
    shutil.copytree(FIX / "llama31", imp)
    (imp / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    text = (FIX / "corpus.txt").read_text()
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": text[i:i + 300]}) + "\n"
                                              for i in range(0, len(text), 300)))
    args = [f"model.from_hf={imp}", f"data.path={tmp_path / 'c.jsonl'}", f"run_dir={tmp_path / 'runs'}", "run_name=ft",
            "seq_len=64", "global_batch=2", "attention.block_q=16", "attention.block_k=16", "mesh.num_devices=2",
            "mesh.context=1", "checkpoint_every=1", "eval_every=0", "eval_fraction=0.2"]
    run(load_config(None, [*args, "steps=1"]))
    copied = sorted(p.name for p in (run_dir / "imported").iterdir())
    assert copied == ["chat_template.jinja", "config.json", "generation_config.json", "tokenizer.json",
                      "tokenizer_config.json"]
    recorded = saved_config(run_dir / "checkpoints", 1)["imported"]
    assert recorded == {n: hashlib.sha256((imp / n).read_bytes()).hexdigest() for n in copied}
    imp.rename(moved)
    evaluate = [str(run_dir), "--no-passkey", "--batches", "1"]
    assert eval_cli.main(evaluate) == 0
    assert export_cli.main([str(run_dir), "--out", str(tmp_path / "hf")]) == 0
    for name in ("chat_template.jinja", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "hf" / name).read_bytes() == (moved / name).read_bytes(), name
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert exported["eos_token_id"] == json.loads((moved / "config.json").read_text())["eos_token_id"]
    assert Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json")).encode("hello").ids
    out = run(load_config(None, [*args, "steps=2"]), resume=True)  # the same command line, its directory gone
    assert out["step"] == 2 and saved_config(run_dir / "checkpoints", 2)["imported"] == recorded
    capsys.readouterr()
    assert eval_cli.main([*evaluate, "--step", "2"]) == 0
    setup = [line.split("/step_")[0] for line in capsys.readouterr().out.splitlines() if line.startswith("results in")]
    recipe = load_config(None, [*args, "stages=[{name: a, steps: 2}, {name: b, steps: 1, seq_len: 32}]"])
    assert run_recipe(expand(recipe, []), resume=True)["step"] == 3  # a recipe's next stage, the directory gone
    assert "stage 1 starts from checkpoint 2: steps 3-3" in capsys.readouterr().out

    conf = run_dir / "imported" / "tokenizer_config.json"
    conf.write_text(conf.read_text() + " ")
    assert eval_cli.main(evaluate) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "imported/tokenizer_config.json" in err and "put the original" in err

    shutil.rmtree(run_dir / "imported")  # a run directory from before copies were kept
    for f in (run_dir / "checkpoints").glob("*/config/metadata"):
        saved = json.loads(f.read_text())
        saved.pop("imported")
        f.write_text(json.dumps(saved))
    assert eval_cli.main(evaluate) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"model.from_hf={str(imp)!r}" in err and "model.from_hf=NEW_PATH" in err
    assert eval_cli.main([*evaluate, "--step", "2", f"model.from_hf={moved}"]) == 0
    again = [line.split("/step_")[0] for line in capsys.readouterr().out.splitlines() if line.startswith("results in")]
    assert setup and again == setup  # the same setup directory as with the run's copy
