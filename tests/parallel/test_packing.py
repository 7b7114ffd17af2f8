"""Packed documents: document masking in the attention kernels, and a packed batch of several documents against
each document run alone (loss, logits and every gradient), on one device and under FSDP x Ulysses / U-Pipe."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_close, loss_and_grads, mesh_for, pairwise, reference_cfg, tiered, tiny_cfg

from jaxlong.config import runtime
from jaxlong.kernels import backend as B
from jaxlong.kernels import blockwise as K
from jaxlong.models import llama as model_lib
from jaxlong.training import step as step_lib
from jaxlong.core.batch import put_batch

TOL = dict(rtol=1e-5, atol=1e-5)


def _qkvw(b, s, h, kvh, d=8, seed=0):
    rng = np.random.default_rng(seed)
    n = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32))
    return n(b, s, h, d), n(b, s, kvh, d), n(b, s, kvh, d), n(b, s, h, d)


def _segments(lengths_per_row, s):
    """int32 [b, s]: documents 1, 2, ... of the given lengths, then padding (0)."""
    seg = np.zeros((len(lengths_per_row), s), np.int32)
    for r, lengths in enumerate(lengths_per_row):
        start = 0
        for i, n in enumerate(lengths):
            seg[r, start:start + n] = i + 1
            start += n
    return jnp.asarray(seg)


ROWS = [[30, 40, 20], [10, 86]]  # row 0 ends with 6 padding tokens


@pytest.mark.parametrize(*pairwise(
    {"bq,bk": [(32, 32), (16, 48), (48, 16), (96, 96), (8, 8)], "h,kvh": [(4, 4), (4, 2)]},
    fast=[((32, 32), (4, 2)), ((16, 48), (4, 4)), ((48, 16), (4, 2)), ((96, 96), (4, 4)), ((8, 8), (4, 2))]))
def test_blockwise_segments_match_documents_alone(bq, bk, h, kvh):
    """Blockwise attention on packed rows = plain causal attention of each document alone (out and grads)."""
    s = 96
    q, k, v, w = _qkvw(2, s, h, kvh)
    seg = _segments(ROWS, s)
    valid = (seg > 0)[:, :, None, None]

    def packed(q, k, v):
        return jnp.sum(K.blockwise_attention(q, k, v, block_q=bq, block_k=bk, segment_ids=seg) * w * valid)

    def alone(q, k, v):
        total = 0.0
        for r, lengths in enumerate(ROWS):
            start = 0
            for n in lengths:
                sl = lambda x: x[r:r + 1, start:start + n]
                total += jnp.sum(K.reference_attention(sl(q), sl(k), sl(v)) * sl(w))
                start += n
        return total

    np.testing.assert_allclose(jax.jit(packed)(q, k, v), alone(q, k, v), **TOL)
    g1 = jax.jit(jax.grad(packed, (0, 1, 2)))(q, k, v)
    g2 = jax.jit(jax.grad(alone, (0, 1, 2)))(q, k, v)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(a, b, **TOL)
    # and the reference kernel with segment ids agrees with the blockwise one everywhere (padding included)
    out_ref = K.reference_attention(q, k, v, segment_ids=seg)
    np.testing.assert_allclose(K.blockwise_attention(q, k, v, block_q=bq, block_k=bk, segment_ids=seg),
                               out_ref, **TOL)


def test_tiles_of_other_documents_are_skipped():
    """Tiles whose query and key documents differ are not visited, forward or backward: NaNs planted in another
    document's tiles (masking alone would turn them into NaN outputs, 0 * NaN) never reach a result."""
    s, blk = 64, 16
    q, k, v, w = _qkvw(1, s, 2, 2)
    seg = _segments([[32, 32]], s)  # two documents, each exactly two tiles
    nan_first = lambda x: x.at[:, :32].set(jnp.nan)
    out = K.blockwise_attention(q, nan_first(k), nan_first(v), block_q=blk, block_k=blk, segment_ids=seg)
    assert bool(jnp.isfinite(out[:, 32:]).all())
    # backward: kv tiles of document 1 never visit the query tiles of document 2
    nan_second = lambda x: x.at[:, 32:].set(jnp.nan)
    out1, lse = K.blockwise_attention_fwd(q, k, v, block_q=blk, block_k=blk, segment_ids=seg)
    _, dk, dv = K.blockwise_attention_bwd(nan_second(q), k, v, nan_second(out1), nan_second(lse.transpose(0, 2, 1))
                                          .transpose(0, 2, 1), nan_second(w), block_q=blk, block_k=blk,
                                          segment_ids=seg)
    assert bool(jnp.isfinite(dk[:, :32]).all()) and bool(jnp.isfinite(dv[:, :32]).all())
    # without segment ids the same NaNs do reach the outputs (the test can fail)
    out_full = K.blockwise_attention(q, nan_first(k), nan_first(v), block_q=blk, block_k=blk)
    assert not bool(jnp.isfinite(out_full[:, 32:]).all())


def test_segment_errors():
    q, k, v, _ = _qkvw(2, 32, 2, 2)
    seg = _segments([[32], [32]], 32)
    with pytest.raises(ValueError, match="cudnn"):
        B.attention(q, k, v, backend="cudnn", segment_ids=seg)
    with pytest.raises(ValueError, match="causal"):
        K.blockwise_attention(q, k, v, causal=False, segment_ids=seg)
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        K.blockwise_attention(q, k, v, segment_ids=seg[:, :16])
    assert B.resolve_backend("auto", q, seg) == "blockwise"


# ----------------------------------------------------------------------------------------------
# The model: a packed batch against each document alone.

SEQ = 64
DOCS = [[20, 30, 14], [40, 10]]  # row 1 ends with 14 padding tokens


def _packed_and_alone(vocab, seed=3):
    """A packed batch of DOCS (global_batch 2) and the reference batch with each document alone at the start
    of its own row (no segment ids, plain causal; the rest of the row is junk with mask 0)."""
    rng = np.random.default_rng(seed)
    docs = [[rng.integers(0, vocab, n + 1).astype(np.int32) for n in row] for row in DOCS]
    b = len(DOCS)
    packed = {k: np.zeros((b, SEQ), np.int32) for k in ("inputs", "targets", "positions", "segment_ids")}
    packed["mask"] = np.zeros((b, SEQ), np.float32)
    n_docs = sum(len(r) for r in DOCS)
    alone = {"inputs": rng.integers(0, vocab, (n_docs, SEQ)).astype(np.int32),
             "targets": rng.integers(0, vocab, (n_docs, SEQ)).astype(np.int32),
             "mask": np.zeros((n_docs, SEQ), np.float32)}
    where = []  # (row, start, n) of each document in the packed batch, in alone-row order
    for r, row in enumerate(docs):
        start = 0
        for i, d in enumerate(row):
            n = d.size - 1
            sl = slice(start, start + n)
            packed["inputs"][r, sl], packed["targets"][r, sl] = d[:-1], d[1:]
            packed["positions"][r, sl], packed["segment_ids"][r, sl] = np.arange(n), i + 1
            packed["mask"][r, sl] = 1
            a = len(where)
            alone["inputs"][a, :n], alone["targets"][a, :n], alone["mask"][a, :n] = d[:-1], d[1:], 1
            where.append((r, start, n))
            start += n
    return packed, alone, where


def _hidden(cfg, n_devices, batch, params_host):
    mesh = mesh_for(cfg, n_devices)
    params = step_lib.init_state(cfg, mesh)["params"]
    params = jax.tree.map(lambda h, p: jax.device_put(h, p.sharding), params_host, params)
    rt = runtime(cfg, mesh)
    b = put_batch(batch, mesh)
    fwd = jax.jit(lambda p, x: model_lib.forward(model_lib.model_graphdef(cfg.model, cfg.param_dtype), p, x["inputs"], rt,
                                                 x.get("positions"), x.get("segment_ids"))[0])
    return np.asarray(fwd(params, b))


@functools.lru_cache(maxsize=None)
def _reference(kv_heads):
    """Loss, grads, params and hidden states of every document alone (one device, reference attention)."""
    cfg = tiny_cfg(f"model.kv_heads={kv_heads}", f"seq_len={SEQ}")
    packed, alone, where = _packed_and_alone(cfg.model.vocab_size)
    ref = reference_cfg(cfg)
    ref.global_batch = len(where)
    ref.data.packing = "concat"  # no segment ids: plain causal attention of each row
    loss, grads, params = loss_and_grads(ref, 1, alone)
    hidden = _hidden(ref, 1, alone, params)
    return loss, grads, params, hidden


def _check_packed(*overrides, kv_heads=4, n_devices=8):
    cfg = tiny_cfg(f"model.kv_heads={kv_heads}", f"seq_len={SEQ}", "data.packing=documents", *overrides)
    packed, _, where = _packed_and_alone(cfg.model.vocab_size)
    ref_loss, ref_grads, params, ref_hidden = _reference(kv_heads)
    loss, grads, _ = loss_and_grads(cfg, n_devices, packed, params_host=params)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_trees_close(grads, ref_grads, rtol=1e-5, atol=1e-7)
    hidden = _hidden(cfg, n_devices, packed, params)
    for a, (r, start, n) in enumerate(where):  # final hidden states (the logits' input) of every document
        np.testing.assert_allclose(hidden[r, start:start + n], ref_hidden[a, :n], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_packed_model_one_device():
    _check_packed("mesh.fsdp=1", "mesh.context=1", "mesh.num_devices=1", "attention.backend=blockwise",
                  n_devices=1)


@pytest.mark.parametrize(*tiered("overrides,kv_heads", [
    (("mesh.fsdp=2", "mesh.context=4"), 4),  # Ulysses, KV heads split
    (("mesh.fsdp=1", "mesh.context=8", "remat.policy=full", "tiling.loss=true"), 2),  # KV replicated
    (("mesh.fsdp=2", "mesh.context=4", "attention.impl=upipe", "attention.heads_per_stage=4"), 4),
    (("mesh.fsdp=1", "mesh.context=8", "attention.impl=upipe", "remat.policy=full", "tiling.loss=true",
      "tiling.mlp=true"), 2),
    (("mesh.fsdp=2", "mesh.context=4", "attention.impl=upipe", "attention.heads_per_stage=8", "model.kv_heads=2"),
     2),
], ids=["ulysses-c4", "ulysses-c8-kvrep-remat-tiled", "upipe-c4-U=C", "upipe-c8-U=C-kvrep-tiled", "upipe-c4-U=2C-gqa"],
    fast={"ulysses-c4", "upipe-c8-U=C-kvrep-tiled"}))
def test_packed_model_parallel(overrides, kv_heads):
    """FSDP x Ulysses and U-Pipe (context 4 and 8, KV heads split and replicated, remat, tiled loss and MLP)."""
    _check_packed(*overrides, kv_heads=kv_heads)


# ----------------------------------------------------------------------------------------------
# Memory and resume.


@pytest.mark.parametrize(*tiered("impl", ["ulysses", "upipe"], ids=["ulysses", "upipe"], fast={"ulysses"}))
def test_packed_step_adds_no_sequence_squared_memory(impl):
    """The compiled train step with document masking needs no more temporary memory than the unpacked step
    (up to a few O(seq) int32 arrays): nothing [S, S]-shaped or per head is added."""
    from jaxlong.core.memstats import compiled_bytes

    def temp(packing):
        cfg = tiny_cfg("mesh.fsdp=2", "mesh.context=4", "seq_len=4096", "global_batch=2", "attention.block_q=256",
                       "attention.block_k=256", f"attention.impl={impl}", "remat.policy=full",
                       f"data.packing={packing}")
        return compiled_bytes(step_lib.compile_train_step(cfg, mesh_for(cfg, 8)))["temp"]

    packed, unpacked = temp("documents"), temp("concat")
    seq_bytes = 2 * 4096 * 4  # one [batch, seq] int32 array, whole
    assert packed <= unpacked * 1.02 + 4 * seq_bytes, (packed, unpacked)


@pytest.mark.slow
def test_resume_reproduces_next_batches_and_loss(tmp_path):
    """packing=documents, shuffled, over several epochs of a small corpus: 3 steps + --resume 5 steps gives the
    uninterrupted 8-step run's losses exactly (same batches in the same order)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from jaxlong.recipes import train as run

    corpus = tmp_path / "c.jsonl"
    rng = np.random.default_rng(0)
    corpus.write_text("".join('{"text": "%s"}\n' % ("word " * int(n)) for n in rng.integers(2, 30, 12)))
    base = ("mesh.fsdp=2", "mesh.context=4", "seq_len=128", "global_batch=2", f"data.path={corpus}",
            "model.vocab_size=257", f"run_dir={tmp_path}", "optim.decay_steps=8", "checkpoint_every=3")

    def losses(name):
        return [e.value for e in EventAccumulator(str(tmp_path / name)).Reload().Scalars("loss")]

    run(tiny_cfg(*base, "steps=8", "run_name=full"))
    run(tiny_cfg(*base, "steps=3", "run_name=split"))
    run(tiny_cfg(*base, "steps=8", "run_name=split"), resume=True)
    epoch_tokens = sum(5 * int(n) + 2 for n in np.random.default_rng(0).integers(2, 30, 12))
    assert 8 * 2 * 128 > 2 * epoch_tokens  # the run crosses two epoch boundaries
    full, split = losses("full"), losses("split")
    assert len(full) == len(split) == 8
    assert split == full  # bitwise: the same batches, in the same order, after the resume


@pytest.mark.slow
def test_segment_ids_are_gathered_once_per_step():
    """The int32 segment ids reach the head-sharded devices by one all-gather per step (before the layer scan),
    not one per layer or U-Pipe stage: the compiled step of a 3-layer model has exactly one int32 all-gather."""
    import re

    for impl in ("ulysses", "upipe"):
        cfg = tiny_cfg("mesh.fsdp=2", "mesh.context=4", f"attention.impl={impl}", "remat.policy=full",
                       "model.layers=3", "data.packing=documents")
        hlo = step_lib.compile_train_step(cfg, mesh_for(cfg, 8)).as_text()
        gathers = [line for line in hlo.splitlines() if re.search(r"= s32\[[^\]]*\][^ ]* all-gather(-start)?\(", line)]
        assert len(gathers) == 1, (impl, gathers)
