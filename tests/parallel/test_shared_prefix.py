"""Shared-prefix rows (`jaxlong.core.segments`, `jaxlong.data.groups`): one prompt and its G completions in one run
of a row equal G separate prompt + completion rows. The kernels (forward and every gradient), then the model on
every mesh (loss, gradients and the final hidden states of every completion token), with a group packed beside
ordinary documents and padding, straddling the ring's chunks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_close, loss_and_grads, mesh_for, reference_cfg, tiered, tiny_cfg

from jaxlong.config import runtime
from jaxlong.core import segments
from jaxlong.core.batch import natural_order, put_batch
from jaxlong.data.groups import IGNORE, group_length, group_row
from jaxlong.kernels import blockwise as K
from jaxlong.layers.loss import IGNORE_INDEX
from jaxlong.models import llama as model_lib
from jaxlong.training import step as step_lib

TOL = dict(rtol=1e-5, atol=1e-5)
SEQ = 64
# Per row: ("doc", n) an ordinary document of n tokens, ("group", prompt, [completions]) a shared-prefix group.
ROWS = [[("doc", 7), ("group", 13, [5, 9, 3]), ("doc", 9)],  # 7 + 32 + 9 = 48, then 16 of padding
        [("group", 20, [11, 0, 6]), ("group", 4, [6, 2])]]  # 19 + 12 + 1 + 7 = 39, then 3 + 7 + 3 = 13: 52


def test_segment_ids_encode_documents_and_branches():
    ids = segments.encode(np.array([1, 1, 1, 2]), np.array([0, 1, 2, 0]))
    np.testing.assert_array_equal(segments.documents(ids), [1, 1, 1, 2])
    np.testing.assert_array_equal(segments.branches(ids), [0, 1, 2, 0])
    seen = np.asarray(segments.visible(ids[:, None], ids[None, :]))  # [query, key]
    np.testing.assert_array_equal(seen, [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 1]])
    np.testing.assert_array_equal(K.segment_starts(jnp.asarray(ids)[None]), [[0, 0, 0, 3]])
    assert IGNORE == IGNORE_INDEX
    assert group_length(3, [2, 1]) == 2 + 3 + 2
    with pytest.raises(ValueError, match="branches must lie in"):
        segments.encode(np.array([1]), np.array([segments.MAX_BRANCHES]))
    with pytest.raises(ValueError, match="at least one token"):
        group_row([], [[1]], 1)


def _layout(rows, s=SEQ, seed=0, vocab=128):
    """A packed batch of `rows` and the separate rows: each ordinary document alone, each prompt + completion
    alone. Returns (packed batch, separate batch, pairs): `pairs` lists ((row, index) in the packed batch,
    (row, index) in the separate batch) of every token whose target both score."""
    rng = np.random.default_rng(seed)
    keys = ("inputs", "targets", "positions", "segment_ids")
    packed = {k: np.zeros((len(rows), s), np.int32) for k in keys}
    packed["mask"] = np.zeros((len(rows), s), np.float32)
    alone, pairs = [], []
    for r, row in enumerate(rows):
        at = 0
        for doc, item in enumerate(row, start=1):
            if item[0] == "doc":
                toks = rng.integers(0, vocab, item[1] + 1)
                part = {"inputs": toks[:-1], "targets": toks[1:], "positions": np.arange(item[1]),
                        "segment_ids": np.full(item[1], doc), "completion": np.ones(item[1], np.float32)}
                sep = [(toks[:-1], toks[1:], np.arange(item[1]))]
            else:
                prompt = rng.integers(0, vocab, item[1])
                comps = [rng.integers(0, vocab, n) for n in item[2]]
                part = group_row(prompt, comps, doc)
                sep = [(np.concatenate([prompt, c])[:-1], np.concatenate([prompt, c])[1:], None) for c in comps]
            n = part["inputs"].size
            for k in keys:
                packed[k][r, at:at + n] = part[k]
            packed["mask"][r, at:at + n] = part["completion"]
            for i, (inp, tgt, _) in enumerate(sep):
                a = len(alone)
                alone.append((inp, tgt))
                if item[0] == "doc":
                    pairs += [((r, at + t), (a, t)) for t in range(n)]
                else:  # branch i + 1's tokens: the prompt's last, then the completion's
                    first = at + int(np.argmax(part["branch"] == i + 1))
                    p = item[1]
                    pairs += [((r, first + t), (a, p - 1 + t)) for t in range(len(comps[i]))]
            at += n
    sep = {k: np.zeros((len(alone), s), np.int32) for k in ("inputs", "targets")}
    sep["mask"] = np.zeros((len(alone), s), np.float32)
    for a, (inp, tgt) in enumerate(alone):
        sep["inputs"][a, :inp.size], sep["targets"][a, :tgt.size] = inp, tgt
    for (_, _), (a, t) in pairs:
        sep["mask"][a, t] = 1.0
    return packed, sep, pairs


def _qkv(b, s, h, kvh, d=8, seed=1):
    rng = np.random.default_rng(seed)
    n = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32))
    return n(b, s, h, d), n(b, s, kvh, d), n(b, s, kvh, d), n(b, s, h, d)


def _kernel_case(h=4, kvh=2):
    """Shared rows of ROWS with random q, k, v (gathered from each separate row's own tokens, so that the shared
    prefix's q, k, v are the prompt's), the separate rows' q, k, v, and the index pairs of every token."""
    packed, sep, pairs = _layout(ROWS)
    q, k, v, w = _qkv(len(sep["inputs"]), SEQ, h, kvh)
    # The separate rows' prompt tokens are one token sequence per group: give them the same q, k, v in every
    # sibling by deriving q, k, v from the token id and position.
    emb = jnp.asarray(np.random.default_rng(2).standard_normal((128, SEQ, h + 2 * kvh, 8), np.float32))

    def qkv(tokens, positions):
        x = emb[tokens, positions]
        return x[..., :h, :], x[..., h:h + kvh, :], x[..., h + kvh:, :]

    pos_sep = np.broadcast_to(np.arange(SEQ), sep["inputs"].shape)
    return packed, sep, pairs, qkv(packed["inputs"], packed["positions"]), qkv(sep["inputs"], pos_sep), w


@pytest.mark.parametrize(*tiered("kernel", ["blockwise-8", "blockwise-16x32", "reference"], fast={"blockwise-8"},
                                 ids=["blockwise-8", "blockwise-16x32", "reference"]))
def test_kernels_see_the_prefix_and_their_own_branch(kernel):
    """Attention of the shared rows at every scored token equals the separate rows' (forward), and the gradient
    of a weighted sum of those outputs reaches q, k, v as the separate rows' summed over the siblings."""
    packed, sep, pairs, shared, alone, _ = _kernel_case()
    bq, bk = {"blockwise-8": (8, 8), "blockwise-16x32": (16, 32), "reference": (0, 0)}[kernel]
    seg = jnp.asarray(packed["segment_ids"])
    attend = (functools.partial(K.blockwise_attention, block_q=bq, block_k=bk) if bq
              else K.reference_attention)
    src, dst = (tuple(np.array(ix).T) for ix in zip(*pairs))
    ct = jnp.asarray(np.random.default_rng(3).standard_normal((len(pairs), 4, 8), np.float32))

    def shared_loss(q, k, v):
        return jnp.sum(attend(q, k, v, segment_ids=seg)[src] * ct)

    def alone_loss(q, k, v):
        return jnp.sum(K.reference_attention(q, k, v)[dst] * ct)

    np.testing.assert_allclose(jax.jit(lambda *a: attend(*a, segment_ids=seg)[src])(*shared),
                               K.reference_attention(*alone)[dst], **TOL)
    # gradients w.r.t. the token embeddings both derive q, k, v from
    emb_grads = []
    for loss, ids, pos in ((shared_loss, packed["inputs"], packed["positions"]),
                           (alone_loss, sep["inputs"], np.broadcast_to(np.arange(SEQ), sep["inputs"].shape))):
        q, k, v = shared if loss is shared_loss else alone
        gq, gk, gv = jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)
        g = jnp.zeros((128, SEQ, 8, 8)).at[ids, pos].add(jnp.concatenate([gq, gk, gv], axis=2))
        emb_grads.append(g)
    np.testing.assert_allclose(emb_grads[0], emb_grads[1], **TOL)


# ----------------------------------------------------------------------------------------------
# The model: shared-prefix rows against every prompt + completion alone, on every mesh.


def _hidden(cfg, n_devices, batch, params_host):
    mesh = mesh_for(cfg, n_devices)
    params = step_lib.init_state(cfg, mesh)["params"]
    params = jax.tree.map(lambda h, p: jax.device_put(h, p.sharding), params_host, params)
    rt = runtime(cfg, mesh)
    graphdef = model_lib.model_graphdef(cfg.model, cfg.param_dtype)
    fwd = jax.jit(lambda p, x: model_lib.forward(graphdef, p, x["inputs"], rt, x.get("positions"),
                                                 x.get("segment_ids"))[0])
    return natural_order(np.asarray(fwd(params, put_batch(batch, mesh))), mesh)


@functools.lru_cache(maxsize=None)
def _separate_rows():
    """Loss, gradients, parameters and final hidden states of the separate rows (one device, reference attention,
    plain causal rows)."""
    cfg = tiny_cfg(f"seq_len={SEQ}")
    _, sep, _ = _layout(ROWS)
    ref = reference_cfg(cfg)
    ref.global_batch = len(sep["inputs"])
    ref.data.packing = "concat"
    loss, grads, params = loss_and_grads(ref, 1, sep)
    return loss, grads, params, _hidden(ref, 1, sep, params)


@pytest.mark.parametrize(*tiered("overrides", [
    ("mesh.fsdp=1", "mesh.context=1", "mesh.num_devices=1", "attention.backend=blockwise"),
    ("mesh.fsdp=2", "mesh.context=4"),
    ("mesh.fsdp=1", "mesh.context=8", "attention.impl=upipe", "remat.policy=full", "tiling.loss=true",
     "tiling.mlp=true"),
    ("mesh.fsdp=1", "mesh.ring=2", "mesh.context=4", "tiling.loss=true", "tiling.loss_tile=4"),
    ("mesh.fsdp=2", "mesh.ring=2", "mesh.context=2", "attention.impl=upipe", "remat.policy=full"),
    ("mesh.fsdp=1", "mesh.ring=8", "mesh.context=1", "remat.policy=offload"),
], ids=["one-device", "ulysses-c4", "upipe-c8-tiled", "ulysses-r2c4-tiled-loss", "upipe-fsdp2-r2c2", "ring-r8"],
    fast=set()))  # the fast tier: GRPO's loss on shared-prefix rows against separate rows (tests/training/test_grpo.py)
def test_shared_prefix_rows_equal_separate_rows_on_every_mesh(overrides):
    """Loss and every gradient of the completions' targets, and the final hidden states (the log-probs' input) of
    every scored token: the packed shared-prefix rows under `overrides` equal the separate rows on one device."""
    n_devices = 1 if "mesh.num_devices=1" in overrides else 8
    cfg = tiny_cfg(*overrides, f"seq_len={SEQ}", "data.packing=documents")
    packed, _, pairs = _layout(ROWS)
    ref_loss, ref_grads, params, ref_hidden = _separate_rows()
    loss, grads, _ = loss_and_grads(cfg, n_devices, packed, params_host=params)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_trees_close(grads, ref_grads, rtol=1e-5, atol=1e-7)
    hidden = _hidden(cfg, n_devices, packed, params)
    src, dst = (tuple(np.array(ix).T) for ix in zip(*pairs))
    np.testing.assert_allclose(hidden[src], ref_hidden[dst], rtol=1e-5, atol=1e-5)


def test_rows_that_share_a_prompt_are_refused_where_they_cannot_run():
    """One line before anything compiles: a shared prompt without preference pairs, without segment ids, or with a
    sliding-window model."""
    from jaxlong.config import ConfigError, validate

    pairs = ("data.format=preference", "objective=dpo", "data.shared_prompt=true",
             "data.path=configs/data/stdlib_preference.jsonl", "data.chat_template=configs/chat_templates/chatml.jinja")
    cases = [(("data.shared_prompt=true",), "set data.format=preference"),
             ((*pairs, "data.packing=concat"), "packs each conversation as its own document"),
             ((*pairs, "model.family=gemma3", "model.sliding_window=16"), "model.sliding_window=16 counts positions")]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            validate(tiny_cfg(*overrides), 8)


@pytest.mark.slow
def test_the_pallas_kernels_mask_branches_as_the_blockwise_kernel_does():
    """The Pallas kernel pair in its interpreter (float32) on shared-prefix rows: causal with segment ids, and
    ring attention's off-diagonal form (keys of the row's first half for queries of its second, `kv_starts` with
    the (query, key) run ids): forward, lse and the backward equal the blockwise kernel's, itself equal to the
    separate rows (above)."""
    from jaxlong.kernels import pallas_gpu as PG
    from jaxlong.parallel.ring import kv_starts_of_chunks, run_ids

    packed, _, _ = _layout(ROWS)
    seg = jnp.asarray(packed["segment_ids"])
    q, k, v, do = _qkv(len(ROWS), SEQ, 4, 2, d=16)
    half = SEQ // 2
    runs = run_ids(seg, 1)
    cases = [(dict(causal=True, segment_ids=seg), (q, k, v, do), {}),
             (dict(causal=False, segment_ids=runs[:, half:], kv_segment_ids=runs[:, :half]),
              (q[:, half:], k[:, :half], v[:, :half], do[:, half:]),
              dict(kv_starts=kv_starts_of_chunks(runs[:, half:], (0,), half)))]
    for opts, (q_, k_, v_, do_), pallas_only in cases:
        out, lse = PG.pallas_attention_fwd(q_, k_, v_, block_q=16, block_k=16, interpret=True, **opts, **pallas_only)
        ref_out, ref_lse = K.blockwise_attention_fwd(q_, k_, v_, block_q=8, block_k=8, **opts)
        np.testing.assert_allclose(out, ref_out, **TOL)
        np.testing.assert_allclose(lse, ref_lse, **TOL)
        lse_ = jnp.where(jnp.isfinite(ref_lse), ref_lse, 0.0)  # as ring's global lse: finite where a block sees none
        grads = PG.pallas_attention_bwd(q_, k_, v_, ref_out, lse_, do_, block_q=16, block_k=16, interpret=True,
                                        **opts, **pallas_only)
        for got, want in zip(grads, K.blockwise_attention_bwd(q_, k_, v_, ref_out, lse_, do_, block_q=8,
                                                              block_k=8, **opts)):
            np.testing.assert_allclose(got, want, **TOL)
