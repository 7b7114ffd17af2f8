"""Ring attention's blocks on the kernel `attention.backend` resolves to (`jaxlong.parallel.ring.BlockKernel`).

On the CPU the GPU kernels are swapped for checking fakes that record each call and compute it exactly (the
blockwise kernel; a dense masked softmax for the Pallas kernel's `kv_starts`): the ring calls the diagonal block
causal and each off-diagonal one as one unmasked call (cuDNN), or with `kv_starts` from the run ids and the block's
chunk positions (Pallas, packed documents), and its forward and gradients, computed from those blocks with the global (out, lse)
in every backward, equal the dense reference (float32, rtol 1e-5). The Pallas kernel's own `kv_starts` mask is
tested against the blockwise kernel in `tests/kernels/test_pallas_attention.py`. On compile-only H100s the whole
train step of Ulysses x ring and U-Pipe x ring runs its attention through cuDNN or Triton calls only.
"""

import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import RING_SEQ, ring_mesh, tiny_cfg
from jax.sharding import NamedSharding
from test_ring_segments import _qkv, _segments

from jaxlong.kernels import blockwise as K
from jaxlong.kernels import cudnn as cudnn_kernel
from jaxlong.kernels import pallas_gpu as pallas_kernel
from jaxlong.parallel.ring import ring_attention, unzigzag, zigzag
from jaxlong.plan.target import compile_only_devices, cuda_plugin_available, parse_target

TOL = dict(rtol=1e-5, atol=1e-5)
S, B, H, KVH, D = 64, 2, 4, 2, 16
TILES = dict(block_q=4, block_k=4)


def _dense_scores(q, k, kv_starts):
    """Scaled scores `[b, h, sq, sk]` (GQA: KV heads repeated here, in the fake only) and the kv_starts mask."""
    g = q.shape[2] // k.shape[2]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, jnp.repeat(k, g, 2)) / math.sqrt(q.shape[-1])
    mask = jnp.arange(k.shape[1])[None, None, None, :] >= kv_starts[:, None, :, None]
    return s, mask, g


def _dense_kv_starts_fwd(q, k, v, kv_starts):
    s, mask, g = _dense_scores(q, k, kv_starts)
    lse = jax.nn.logsumexp(jnp.where(mask, s, -jnp.inf), axis=-1)  # -inf for a row that sees no key
    p = jnp.where(mask, jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    return jnp.einsum("bhqk,bkhd->bqhd", p, jnp.repeat(v, g, 2)), lse


def _dense_kv_starts_bwd(q, k, v, out, lse, dout, kv_starts):
    """FlashAttention-2's backward from the given (out, lse), densely: `P = exp(S - lse)`, masked."""
    s, mask, g = _dense_scores(q, k, kv_starts)
    p = jnp.where(mask, jnp.exp(s - lse[..., None]), 0.0)
    delta = jnp.einsum("bqhd,bqhd->bhq", dout, out)
    ds = p * (jnp.einsum("bqhd,bkhd->bhqk", dout, jnp.repeat(v, g, 2)) - delta[..., None]) / math.sqrt(q.shape[-1])
    group_sum = lambda x: x.reshape(*x.shape[:2], k.shape[2], g, x.shape[-1]).sum(3)
    dv = group_sum(jnp.einsum("bhqk,bqhd->bkhd", p, dout))
    dk = group_sum(jnp.einsum("bhqk,bqhd->bkhd", ds, q))
    return jnp.einsum("bhqk,bkhd->bqhd", ds, jnp.repeat(k, g, 2)), dk, dv


@pytest.fixture
def fake_kernels(monkeypatch):
    """cuDNN's and Pallas' kernel pairs replaced by exact CPU stand-ins that record `(kernel, pass, causal,
    masking, query length, key length, lse length)` of every call as it is traced."""
    calls = []

    def cudnn_fwd(q, k, v, *, causal=True, segment_ids=None):
        assert segment_ids is None
        calls.append(("cudnn", "fwd", causal, None, q.shape[1], k.shape[1], None))
        return K.blockwise_attention_fwd(q, k, v, causal=causal, **TILES)

    def cudnn_bwd(q, k, v, out, lse, dout, *, causal=True, segment_ids=None):
        calls.append(("cudnn", "bwd", causal, None, q.shape[1], k.shape[1], lse.shape[2]))
        return K.blockwise_attention_bwd(q, k, v, out, lse, dout, causal=causal, **TILES)

    def masking(segment_ids, kv_starts):  # a remote block's ids pair rides with its kv_starts
        return "kv_starts" if kv_starts is not None else "segments" if segment_ids is not None else None

    def pallas_fwd(q, k, v, *, causal=True, segment_ids=None, kv_starts=None, interpret=False, kv_segment_ids=None):
        calls.append(("pallas", "fwd", causal, masking(segment_ids, kv_starts), q.shape[1], k.shape[1], None))
        if kv_starts is None:
            return K.blockwise_attention_fwd(q, k, v, causal=causal, segment_ids=segment_ids, **TILES)
        return _dense_kv_starts_fwd(q, k, v, kv_starts)

    def pallas_bwd(q, k, v, out, lse, dout, *, causal=True, segment_ids=None, kv_starts=None, interpret=False,
                   kv_segment_ids=None):
        calls.append(("pallas", "bwd", causal, masking(segment_ids, kv_starts), q.shape[1], k.shape[1],
                      lse.shape[2]))
        if kv_starts is None:
            return K.blockwise_attention_bwd(q, k, v, out, lse, dout, causal=causal, segment_ids=segment_ids,
                                             **TILES)
        return _dense_kv_starts_bwd(q, k, v, out, lse, dout, kv_starts)

    for module, name, fn in ((cudnn_kernel, "cudnn_attention_fwd", cudnn_fwd),
                             (cudnn_kernel, "cudnn_attention_bwd", cudnn_bwd),
                             (pallas_kernel, "pallas_attention_fwd", pallas_fwd),
                             (pallas_kernel, "pallas_attention_bwd", pallas_bwd)):
        monkeypatch.setattr(module, name, fn)
    return calls


def _ring_matches_reference(ring: int, backend: str, seg=None):
    """Forward and q, k, v gradients of ring attention on `backend`'s blocks equal the dense reference."""
    mesh = ring_mesh(ring, 1)
    q, k, v, ct = _qkv(B, S, H, KVH, D, seed=3)
    put = lambda x: jax.device_put(zigzag(x, ring), NamedSharding(mesh, RING_SEQ))

    def ring_fn(q, k, v):
        ids = None if seg is None else zigzag(seg, ring)
        out = ring_attention(put(q), put(k), put(v), mesh=mesh, segment_ids=ids, backend=backend, **TILES)
        return unzigzag(out, ring)

    ref_fn = lambda q, k, v: K.reference_attention(q, k, v, segment_ids=seg)
    np.testing.assert_allclose(jax.jit(ring_fn)(q, k, v), ref_fn(q, k, v), **TOL)
    grads = lambda f: jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) * ct), argnums=(0, 1, 2))(q, k, v)
    for name, got, want in zip("qkv", jax.jit(lambda: grads(ring_fn))(), grads(ref_fn)):
        np.testing.assert_allclose(got, want, err_msg=f"d{name}", **TOL)


def test_ring_runs_cudnn_causal_on_its_own_block_and_unmasked_on_the_others(fake_kernels):
    """Ring 4 over 64 tokens: each rank's 16-token block is one causal cuDNN call; each remote block is one
    unmasked call, the rank's 16 queries to the first 8-token chunk of an earlier rank's block or its second
    8-token chunk of queries to a later rank's whole block, forward and backward, every backward with the
    queries' global lse."""
    _ring_matches_reference(4, "cudnn")
    c = S // 8
    assert set(fake_kernels) == {
        ("cudnn", "fwd", True, None, 2 * c, 2 * c, None), ("cudnn", "fwd", False, None, 2 * c, c, None),
        ("cudnn", "fwd", False, None, c, 2 * c, None), ("cudnn", "bwd", True, None, 2 * c, 2 * c, 2 * c),
        ("cudnn", "bwd", False, None, 2 * c, c, 2 * c), ("cudnn", "bwd", False, None, c, 2 * c, c)}


def test_ring_runs_pallas_with_documents_and_kv_starts_on_the_remote_blocks(fake_kernels):
    """Packed documents across the chunk boundaries (and a single-token document, and padding): the own block
    is the Pallas kernel's causal document mask, each remote block its `kv_starts` mask, and forward and
    gradients equal the dense reference with the same segment ids."""
    seg, _ = _segments(B)
    _ring_matches_reference(4, "pallas", seg)
    c = S // 8
    assert set(fake_kernels) == {
        ("pallas", "fwd", True, "segments", 2 * c, 2 * c, None),
        ("pallas", "bwd", True, "segments", 2 * c, 2 * c, 2 * c),
        ("pallas", "fwd", False, "kv_starts", 2 * c, c, None), ("pallas", "fwd", False, "kv_starts", c, 2 * c, None),
        ("pallas", "bwd", False, "kv_starts", 2 * c, c, 2 * c), ("pallas", "bwd", False, "kv_starts", c, 2 * c, c)}


def test_explicit_gpu_kernels_under_ring_are_accepted_by_the_config():
    for backend in ("cudnn", "pallas"):
        packing = "concat" if backend == "cudnn" else "documents"
        cfg = tiny_cfg(f"attention.backend={backend}", "compute_dtype=bfloat16", "mesh.fsdp=2", "mesh.ring=2",
                       "mesh.context=2", f"data.packing={packing}")
        assert (cfg.attention.backend, cfg.mesh.ring) == (backend, 2)


# The blockwise kernel's matmuls are einsums over grouped heads (`g`) that nothing else in the model writes; XLA
# keeps each einsum's equation in the `op_name` of the matmul it becomes.
BLOCKWISE_EINSUMS = set(re.findall(r'einsum\("([^"]+)"', Path(K.__file__).read_text()))


def _blockwise_matmuls(hlo: str) -> int:
    """Matmuls (`dot` instructions or cuBLAS calls) of a compiled program that come from the blockwise kernel."""
    return sum(1 for line in hlo.splitlines() if (" dot(" in line or "__cublas" in line)
               and any(f"/{spec}/" in line for spec in BLOCKWISE_EINSUMS))


@pytest.mark.gpu_compile
@pytest.mark.slow
@pytest.mark.skipif(not cuda_plugin_available(), reason="the CUDA plugin (pip install 'jax[cuda12]') is not installed")
@pytest.mark.parametrize("impl,packing", [("ulysses", "concat"), ("upipe", "concat"), ("ulysses", "documents"),
                                          ("upipe", "documents")])
def test_two_node_ring_train_step_runs_attention_only_in_gpu_kernels(impl, packing):
    """`h100:8x2` with mesh.ring=2, mesh.context=8 (Ulysses x ring, U-Pipe x ring): the compiled train step calls
    cuDNN flash attention (concatenated documents) or the Pallas kernels (packed documents) and no matmul of the
    blockwise kernel remains."""
    from jaxlong.core.mesh import build_mesh
    from jaxlong.config import runtime
    from jaxlong.training import step as step_lib

    cfg = tiny_cfg("compute_dtype=bfloat16", "mesh.fsdp=1", "mesh.ring=2", "mesh.context=8", "mesh.num_devices=16",
                   "global_batch=1", "seq_len=256", f"attention.impl={impl}", f"data.packing={packing}")
    mesh = build_mesh(cfg.mesh, devices=compile_only_devices(parse_target("h100:8x2")))
    backend = runtime(cfg, mesh).attention_backend
    assert backend == ("cudnn" if packing == "concat" else "pallas")
    hlo = step_lib.compile_train_step(cfg, mesh).as_text()
    if backend == "cudnn":
        assert "__cudnn$fmha" in hlo and "jaxlong_flash" not in hlo
    else:
        assert {"jaxlong_flash_fwd", "jaxlong_flash_bwd_dkdv", "jaxlong_flash_bwd_dq"} <= set(
            re.findall(r'name = \\?"(jaxlong_flash_[a-z_]+)', hlo))
    assert _blockwise_matmuls(hlo) == 0
    if impl == "ulysses" and packing == "concat":  # the detector finds the blockwise kernel where it runs
        cfg.attention.backend = "blockwise"
        assert _blockwise_matmuls(step_lib.compile_train_step(cfg, mesh).as_text()) >= 4


def _cummax_over_whole_rows(jaxpr, seq: int, in_scan: bool = False, found=None) -> list[bool]:
    """For each `cummax` over rows of `seq` tokens (a document-start computation over the whole sequence) in
    `jaxpr` and its sub-jaxprs: whether it sits inside a `scan` (the layer scan)."""
    found = [] if found is None else found
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "cummax" and eqn.invars[0].aval.shape[-1] == seq:
            found.append(in_scan)
        for sub in jax.core.subjaxprs(eqn.params) if hasattr(jax.core, "subjaxprs") else _subjaxprs(eqn):
            _cummax_over_whole_rows(sub, seq, in_scan or eqn.primitive.name == "scan", found)
    return found


def _subjaxprs(eqn):
    for v in eqn.params.values():
        for x in (v if isinstance(v, (tuple, list)) else (v,)):
            if hasattr(x, "jaxpr") and hasattr(x.jaxpr, "eqns"):
                yield x.jaxpr
            elif hasattr(x, "eqns"):
                yield x


@pytest.mark.parametrize("impl", ["ulysses", "upipe"])
def test_run_ids_are_computed_once_per_step_outside_the_layer_scan(impl):
    """With packed documents under ring, the model turns the gathered segment ids into run ids once, before the
    layer scan; no layer (and no U-Pipe stage) computes them again (traced loss of a 3-layer model)."""
    from helpers import mesh_for, random_batch

    from jaxlong.config import runtime
    from jaxlong.models import llama as model_lib
    from jaxlong.objectives.base import loss_sum
    from jaxlong.training import step as step_lib

    cfg = tiny_cfg("mesh.fsdp=2", "mesh.ring=2", "mesh.context=2", f"attention.impl={impl}", "model.layers=3",
                   "data.packing=documents")
    mesh = mesh_for(cfg, 8)
    seg, pos = _segments(cfg.global_batch, cfg.seq_len)
    batch = {**random_batch(cfg), "segment_ids": np.asarray(seg), "positions": np.asarray(pos)}
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), step_lib.abstract_state(cfg, mesh)["params"])
    graphdef, rt = model_lib.model_graphdef(cfg.model, cfg.param_dtype), runtime(cfg, mesh)
    jaxpr = jax.make_jaxpr(jax.grad(lambda p, b: loss_sum(p, b, graphdef, rt)))(params, batch)
    assert _cummax_over_whole_rows(jaxpr.jaxpr, cfg.seq_len) == [False]


@pytest.mark.parametrize("impl", ["ulysses", "upipe"])
def test_ring_train_step_takes_the_batch_sharded_and_replicates_nothing(impl):
    """Under ring attention the batch arrives in the zigzag layout from the host (`put_batch`), so the compiled
    train step takes every batch array sharded over the sequence, permutes nothing, and XLA's SPMD partitioner
    prints no "involuntary full rematerialization" while compiling it (compiled afresh, not from the cache)."""
    from helpers import mesh_for

    from jaxlong.core import xla_log
    from jaxlong.training import step as step_lib

    cfg = tiny_cfg("mesh.fsdp=2", "mesh.ring=2", "mesh.context=2", f"attention.impl={impl}", "data.packing=documents")
    mesh = mesh_for(cfg, 8)
    lowered = step_lib.make_train_step(cfg, mesh).lower(step_lib.abstract_state(cfg, mesh),
                                                        step_lib.abstract_batch(cfg, mesh))
    cached = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        with xla_log.collecting() as log:
            compiled = xla_log.compile_logged(lowered.compile)
    finally:
        jax.config.update("jax_enable_compilation_cache", cached)
    assert "spmd" not in log.seen, log.summary()
    batch_shardings = compiled.input_shardings[0][1]
    assert set(batch_shardings) >= {"inputs", "targets", "mask", "segment_ids", "positions"}
    for name, sharding in batch_shardings.items():
        assert not sharding.is_fully_replicated, name
