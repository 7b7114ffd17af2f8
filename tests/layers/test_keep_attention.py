"""Keeping attention (`remat.keep_attention`): the first N layers keep their attention output and log-sum-exp from
the forward to the backward (pinned host memory or device), so the backward's recomputation of a layer skips the
attention forward. Loss and gradients equal the dense single-device model under every attention method, with
concatenated and packed documents, with and without grouped offload; the kept tensors are the residuals; the GPU
compile runs each kept layer's attention forward once per step."""

import functools

import numpy as np
import pytest
from helpers import assert_trees_close, loss_and_grads, mesh_for, random_batch, reference_cfg, tiered, tiny_cfg

from jaxlong.config import runtime
from jaxlong.config import ConfigError
from jaxlong.models import llama as model_lib
from jaxlong.plan.target import cuda_plugin_available
from jaxlong.training import step as step_lib
from jaxlong.objectives.base import loss_sum

try:  # public in newer JAX; JAX 0.10 exposes only print_saved_residuals publicly
    from jax.ad_checkpoint import saved_residuals
except ImportError:
    from jax._src.ad_checkpoint import saved_residuals

LAYERS = 4
METHODS = {
    "ulysses": ("mesh.fsdp=2", "mesh.context=4"),
    "upipe": ("mesh.fsdp=2", "mesh.context=4", "attention.impl=upipe", "attention.heads_per_stage=4"),
    "ring": ("mesh.fsdp=2", "mesh.ring=4", "mesh.context=1", "attention.block_q=8", "attention.block_k=8"),
    "ulysses-ring": ("mesh.fsdp=2", "mesh.ring=2", "mesh.context=2"),
    "upipe-ring": ("mesh.fsdp=2", "mesh.ring=2", "mesh.context=2", "attention.impl=upipe"),
}
# (method, packing, remat, keep): remat "offload", "full" or "grouped" (offload, offload_every=2); keep "all"
# (every layer, host), "some" (the first 2 of 4, host), "three" (the first 3 of 4, host) or "device" (every layer,
# kept on the device)
CASES = {
    "ulysses-documents-offload-all": ("ulysses", "documents", "offload", "all"),
    "upipe-concat-grouped-some": ("upipe", "concat", "grouped", "some"),
    "ulysses-ring-documents-offload-some": ("ulysses-ring", "documents", "offload", "some"),
    "ulysses-concat-full-device": ("ulysses", "concat", "full", "device"),
    "upipe-documents-offload-all": ("upipe", "documents", "offload", "all"),
    "upipe-concat-grouped-device": ("upipe", "concat", "grouped", "device"),
    "ring-documents-grouped-some": ("ring", "documents", "grouped", "some"),
    "ulysses-ring-concat-grouped-all": ("ulysses-ring", "concat", "grouped", "all"),
    "upipe-ring-concat-offload-all": ("upipe-ring", "concat", "offload", "all"),
    "upipe-ring-documents-grouped-some": ("upipe-ring", "documents", "grouped", "some"),
    # an odd count in pairs (as --fit's 29 of 32 at 4M): a kept pair, a kept layer alone, an unkept layer alone
    "upipe-documents-grouped-three": ("upipe", "documents", "grouped", "three"),
}
FAST = {"ulysses-documents-offload-all", "upipe-concat-grouped-some"}
REMAT = {"offload": ("remat.policy=offload",), "full": ("remat.policy=full",),
         "grouped": ("remat.policy=offload", "remat.offload_every=2")}
KEEP = {"all": (f"remat.keep_attention={LAYERS}",), "some": ("remat.keep_attention=2",),
        "three": ("remat.keep_attention=3",),
        "device": (f"remat.keep_attention={LAYERS}", "remat.keep_attention_memory=device")}
DOCUMENTS = [[20, 30, 10], [40, 24]]  # tokens per document in each row of 64; row 0 ends with 4 padding tokens


def _cfg(method, packing, remat, keep=None):
    return tiny_cfg(*METHODS[method], f"model.layers={LAYERS}", f"data.packing={packing}", *REMAT[remat],
                    *(KEEP[keep] if keep else ()))


def _batch(cfg) -> dict:
    batch = random_batch(cfg, seed=5)
    if cfg.data.packing == "documents":
        seg, pos = np.zeros((2, cfg.seq_len), np.int32), np.zeros((2, cfg.seq_len), np.int32)
        for r, lengths in enumerate(DOCUMENTS):
            start = 0
            for i, n in enumerate(lengths):
                seg[r, start:start + n], pos[r, start:start + n] = i + 1, np.arange(n)
                start += n
        batch.update(segment_ids=seg, positions=pos, mask=batch["mask"] * (seg > 0))
    return batch


@functools.lru_cache(maxsize=None)
def _reference(packing: str):
    """(batch, loss, gradients, parameters) of the dense model on one device (reference attention, no remat)."""
    cfg = reference_cfg(_cfg("ulysses", packing, "offload"))
    batch = _batch(cfg)
    return (batch, *loss_and_grads(cfg, 1, batch))


@pytest.mark.parametrize(*tiered("method,packing,remat,keep", list(CASES.values()), fast=FAST, ids=list(CASES)))
def test_keeping_attention_leaves_loss_and_gradients_unchanged(method, packing, remat, keep):
    """Loss and every gradient with attention kept (all layers or the first half; host or device) equal the dense
    single-device reference in float32 (rtol 1e-5), as the same run without keeping does."""
    batch, ref_loss, ref_grads, params = _reference(packing)
    loss, grads, _ = loss_and_grads(_cfg(method, packing, remat, keep), 8, batch, params_host=params)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_trees_close(grads, ref_grads, rtol=1e-5, atol=1e-7)


def _kept_residuals(*overrides):
    """Residuals of the loss that are stacked over kept layers: [(shape, on_host)] of the scans' outputs."""
    cfg = tiny_cfg("mesh.fsdp=2", "mesh.context=4", f"model.layers={LAYERS}", "data.packing=concat", *overrides)
    mesh = mesh_for(cfg, 8)
    params = step_lib.init_state(cfg, mesh)["params"]
    graphdef, rt = model_lib.model_graphdef(cfg.model, cfg.param_dtype), runtime(cfg, mesh)
    res = saved_residuals(lambda p: loss_sum(p, random_batch(cfg), graphdef, rt), params)
    return cfg, sorted((tuple(a.shape), "<host>" in a.str_short()) for a, d in res if "output of scan" in d and a.ndim >= 4)


@pytest.mark.parametrize("memory", ["host", "device"])
def test_kept_layers_save_their_attention_output_and_lse(memory):
    """With remat.policy=offload the backward keeps every layer input on the host; keeping attention in the first
    2 of 4 layers adds their attention output `[b, S, heads, head_dim]` and lse `[b, heads, S]` (float32), on the
    host or on the device, stacked over those 2 layers, and nothing for the other two."""
    cfg, plain = _kept_residuals("remat.policy=offload")
    b, s, h, d = cfg.global_batch, cfg.seq_len, cfg.model.heads, cfg.model.head_dim
    act = (b, s, cfg.model.hidden)
    assert plain == [((LAYERS, *act), True)]
    _, kept = _kept_residuals("remat.policy=offload", "remat.keep_attention=2", f"remat.keep_attention_memory={memory}")
    assert ((2, *act), True) in kept  # the layer inputs of each part
    extra = sorted((int(np.prod(shape[1:])), shape[0], host) for shape, host in kept if shape[1:] != act)
    assert extra == [(b * h * s, 2, memory == "host"), (b * s * h * d, 2, memory == "host")], kept


def test_keep_attention_is_checked_before_compiling():
    with pytest.raises(ConfigError, match=r"remat.keep_attention=5 must be an integer from 0 .* model.layers=4"):
        tiny_cfg(f"model.layers={LAYERS}", "remat.policy=offload", "remat.keep_attention=5")
    with pytest.raises(ConfigError, match="needs remat.policy=full or offload"):
        tiny_cfg(f"model.layers={LAYERS}", "remat.policy=none", "remat.keep_attention=2")
    with pytest.raises(ConfigError, match="keep_attention_memory='disk'; choose one of: host, device"):
        tiny_cfg(f"model.layers={LAYERS}", "remat.policy=full", "remat.keep_attention=2",
                 "remat.keep_attention_memory=disk")


needs_plugin = pytest.mark.skipif(not cuda_plugin_available(),
                                  reason="needs the CUDA plugin (pip install 'jax[cuda12]') for GPU compiles")


@pytest.mark.gpu_compile
@pytest.mark.slow
@needs_plugin
def test_kept_layers_run_attention_forward_once_on_the_gpu_target():
    """Llama-3-8B attention shapes on 8 H100s (GPU compile), 4 layers, ring 2 x Ulysses 4 (Ulysses runs inside it),
    remat.policy=offload: without keeping, each layer runs the cuDNN forward twice (forward, and the backward's
    recomputation) and the backward once; keeping every layer's attention, forward head-calls equal backward
    head-calls, counted in the compiled HLO; keeping 2 layers, halfway. The kept tensors add to the host bytes.
    (U-Pipe keeping half its layers, all-global and windowed: `tests/models/test_gemma3.py`, the GPU test of what
    offloads from inside attention.)"""
    from jaxlong.plan import plan
    from jaxlong.plan.target import parse_target

    mesh = ("mesh.ring=2", "mesh.context=4")
    base = ("compute_dtype=bfloat16", "mesh.fsdp=1", "global_batch=1", "seq_len=8192", f"model.layers={LAYERS}",
            "model.hidden=4096", "model.heads=32", "model.kv_heads=8", "model.head_dim=128", "model.mlp_hidden=1024",
            "model.vocab_size=1024", "data.packing=concat", "remat.policy=offload", *mesh)
    target = parse_target("h100")
    keeps = (0, 2, 4)
    runs = {keep: plan(tiny_cfg(*base, f"remat.keep_attention={keep}"), target, estimate=True) for keep in keeps}
    calls = {keep: p["estimate"]["attention_head_calls"] for keep, p in runs.items()}
    backward = calls[0]["backward"]
    assert backward > 0 and all(c["backward"] == backward for c in calls.values()), calls
    assert calls[0]["forward"] == 2 * backward and calls[4]["forward"] == backward, calls
    assert calls[2]["forward"] == 1.5 * backward, calls
    factors = [runs[keep]["estimate"]["recompute_factor"] for keep in keeps]
    assert factors == sorted(factors, reverse=True) and factors[0] > factors[-1], factors
    hosts = [runs[keep]["host"] for keep in keeps]
    assert hosts == sorted(hosts) and hosts[0] < hosts[-1], hosts
