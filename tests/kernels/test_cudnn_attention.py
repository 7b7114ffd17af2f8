"""cuDNN attention with lse in and out (`jaxlong.kernels.cudnn`), checked in the deviceless GPU compile.

cuDNN cannot run on a CPU, so these tests compile for compile-only H100s (sm_90, `jaxlong.plan.target`) and
read the compiled HLO: the kernels compile inside `jax.shard_map` as Ulysses and U-Pipe call them (bf16, GQA,
head_dim 64 and 128), the backward is one `__cudnn$fmhaSoftmaxBackward` call with no forward, and U-Pipe's
layer and whole train step call no more cuDNN forwards than Ulysses'. The numerical comparison with the
blockwise kernel (forward, lse, gradients) runs on a GPU: `experiments/gpu_check.py`, section "kernel".
"""

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import axes_mesh

from jaxlong.config import ConfigError, load_config
from jaxlong.kernels import backend as B
from jaxlong.kernels import cudnn as CU
from jaxlong.plan.target import compile_only_devices, cuda_plugin_available, parse_target

needs_plugin = pytest.mark.skipif(not cuda_plugin_available(),
                                  reason="the CUDA plugin (pip install 'jax[cuda12]') is not installed")

C = 8


def cudnn_calls(compiled) -> tuple[int, int]:
    """(forward, backward) cuDNN fused-attention custom calls in a compiled program's HLO."""
    calls = re.findall(r'custom_call_target="(__cudnn\$fmha[A-Za-z0-9]*)"', compiled.as_text())
    backward = sum(c.endswith("Backward") for c in calls)
    return len(calls) - backward, backward


@functools.cache
def _devices():
    return compile_only_devices(parse_target("h100"))


def _mesh():
    return axes_mesh(_devices(), data=1, fsdp=1, context=C)


def _sds(shape, mesh, spec, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


@pytest.mark.gpu_compile
@pytest.mark.slow
@needs_plugin
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(32, 8), (16, 16)])
def test_kernel_pair_compiles_for_sm90_inside_shard_map(d, heads, kv_heads):
    """Heads split over the context axis as after Ulysses' all-to-all: the forward returns a float32 lse
    `[b, heads, s]`, the backward from (out, lse) is one backward call and no forward, and the custom_vjp of
    `attention(backend='cudnn')` compiles to exactly one of each."""
    mesh, s = _mesh(), 4096
    spec, lse_spec = P(None, None, "context", None), P(None, "context", None)
    q, k = _sds((1, s, heads, d), mesh, spec), _sds((1, s, kv_heads, d), mesh, spec)
    lse = _sds((1, heads, s), mesh, lse_spec, jnp.float32)
    opts = dict(backend="cudnn", causal=True)

    def sm(f, n_in, outs):
        return jax.shard_map(f, mesh=mesh, in_specs=n_in, out_specs=outs, check_vma=True)

    fwd = sm(functools.partial(B.attention_fwd_with_lse, **opts), (spec,) * 3, (spec, lse_spec))
    out_t, lse_t = jax.eval_shape(fwd, q, k, k)
    assert out_t.shape == q.shape and out_t.dtype == jnp.bfloat16
    assert lse_t.shape == (1, heads, s) and lse_t.dtype == jnp.float32
    assert cudnn_calls(jax.jit(fwd).lower(q, k, k).compile()) == (1, 0)

    bwd = sm(functools.partial(B.attention_bwd, **opts), (spec,) * 4 + (lse_spec, spec), (spec,) * 3)
    grads = jax.eval_shape(bwd, q, k, k, q, lse, q)
    assert [g.shape for g in grads] == [q.shape, k.shape, k.shape]  # GQA: dk, dv keep kv_heads
    local = heads // C  # query heads per device; the backward runs one call per head (head chunks)
    assert cudnn_calls(jax.jit(bwd).lower(q, k, k, q, lse, q).compile()) == (0, local // CU.BWD_HEADS_PER_CALL)

    def loss(q, k, v, w):
        return jnp.sum(B.attention(q, k, v, backend="cudnn").astype(jnp.float32) * w)

    grad = sm(jax.grad(loss, argnums=(0, 1, 2)), (spec,) * 4, (spec,) * 3)
    assert cudnn_calls(jax.jit(grad).lower(q, k, k, q).compile()) == (1, local // CU.BWD_HEADS_PER_CALL)


@pytest.mark.gpu_compile
@pytest.mark.slow
@needs_plugin
def test_custom_vjp_saves_only_q_k_v_out_lse():
    """The residuals of `attention(backend='cudnn')` are q, k, v, out (bf16) and the float32 lse: no score
    tiles, nothing of size [S, S] (traced abstractly; nothing runs)."""
    s = 2048
    q, k = jax.ShapeDtypeStruct((1, s, 4, 128), jnp.bfloat16), jax.ShapeDtypeStruct((1, s, 2, 128), jnp.bfloat16)
    res = jax.eval_shape(lambda q, k, v: jax.tree.leaves(
        jax.vjp(lambda *a: B.attention(*a, backend="cudnn"), q, k, v)[1]), q, k, k)
    got = sorted((tuple(r.shape), str(r.dtype)) for r in res)
    want = sorted([(q.shape, "bfloat16"), (k.shape, "bfloat16"), (k.shape, "bfloat16"), (q.shape, "bfloat16"),
                   ((1, 4, s), "float32")])
    assert got == want


def _layer_calls(impl: str, u: int | None = None) -> tuple[int, int]:
    """cuDNN calls of one attention layer's forward + backward (Llama-3.1-8B head shapes, bf16, C = 8)."""
    from jaxlong.parallel.upipe import attention_layer

    mesh, s = _mesh(), 8192
    heads, kv_heads, d, hidden = 32, 8, 128, 4096
    act = P(("data", "fsdp"), "context", None)
    x = _sds((1, s, hidden), mesh, act)
    ws = [_sds((hidden, n, d), mesh, P()) for n in (heads, kv_heads, kv_heads)]
    ct = _sds((1, s, heads, d), mesh, P(("data", "fsdp"), "context"))
    layer = attention_layer(impl, mesh, heads_per_stage=u, backend="cudnn")

    def fwd_bwd(x, wq, wk, wv, ct):  # the output is used (as by the next layer): the forward stays live
        out, vjp = jax.vjp(layer, x, wq, wk, wv)
        return out, vjp(ct)

    return cudnn_calls(jax.jit(fwd_bwd).lower(x, *ws, ct).compile())


@pytest.mark.gpu_compile
@pytest.mark.slow
@needs_plugin
@pytest.mark.parametrize("u", [8, 32])
def test_upipe_layer_backward_does_not_rerun_the_forward(u):
    """U-Pipe's stage scans hold one forward call site, as Ulysses' layer does, and a backward call per head
    of a stage (Ulysses: per local head); before the lse-returning kernel the backward scan held a second
    forward (a `jax.vjp` recompute): (2, 1)."""
    ulysses = _layer_calls("ulysses")
    assert ulysses == (1, 32 // C)
    assert _layer_calls("upipe", u) == (1, u // C)


@pytest.mark.gpu_compile
@pytest.mark.slow
@needs_plugin
def test_8b_train_step_upipe_calls_no_more_attention_kernels_than_ulysses():
    """The whole Llama-3.1-8B train step (2 layers to keep the compile short) at 1M tokens on 8 compile-only
    H100s, offload remat and tiling on: U-Pipe's compiled step has as many cuDNN forward and backward calls as
    Ulysses' (2 forwards -- the forward and the remat recompute -- and 1 backward; U-Pipe had 3 forwards)."""
    from jaxlong.core.mesh import build_mesh
    from jaxlong.training import step as step_lib

    counts = {}
    for impl in ("ulysses", "upipe"):
        cfg = load_config("configs/llama3_1_8b.yaml", [
            "model.layers=2", "seq_len=1048576", "remat.policy=offload", "tiling.loss=true", "tiling.mlp=true",
            f"attention.impl={impl}", "attention.backend=auto", "data.packing=concat"])  # no segment ids: cuDNN
        mesh = build_mesh(cfg.mesh, devices=_devices())
        counts[impl] = cudnn_calls(step_lib.compile_train_step(cfg, mesh))
    assert counts["ulysses"][0] >= 1 and counts["ulysses"][1] >= 1, counts  # auto resolved to cuDNN
    assert counts["upipe"][0] <= counts["ulysses"][0] and counts["upipe"][1] <= counts["ulysses"][1], counts


def _window_lengths(compiled) -> list[tuple[str, int, str]]:
    """(target, sliding_window_length, mask_type) of every cuDNN fused-attention call in a compiled program."""
    found = []
    for line in compiled.as_text().splitlines():
        target = re.search(r'custom_call_target="(__cudnn\$fmha[A-Za-z0-9]*)"', line)
        if target:
            window = re.search(r'"sliding_window_length": ?"?(\d+)', line)
            mask = re.search(r'"mask_type": ?"(\w+)"', line)
            found.append((target.group(1), int(window.group(1)) if window else -1, mask.group(1) if mask else ""))
    return found


@pytest.mark.gpu_compile
@needs_plugin
def test_a_window_reaches_the_forward_and_backward_calls_of_the_sm90_program():
    """`attention(backend='cudnn', window=W)` and its gradient, compiled for one compile-only H100 (bf16, 4 query
    heads over 1 KV head, Gemma 3 270M's): the forward call and each backward call (one per query head) carry
    `sliding_window_length` W with the causal mask in their backend config (cuDNN's window `(pos - W, pos]` is the
    blockwise kernel's `t - W + 1 .. t`); a window as long as the sequence masks nothing and is not passed. The
    numbers against the blockwise kernel come from a GPU (experiments/gpu_check.py)."""
    dev = _devices()[0]
    s, w = 1024, 100
    q = jax.ShapeDtypeStruct((1, s, 4, 64), jnp.bfloat16, sharding=jax.sharding.SingleDeviceSharding(dev))
    k = jax.ShapeDtypeStruct((1, s, 1, 64), jnp.bfloat16, sharding=q.sharding)

    def grads(window):
        def loss(q, k, v, dout):
            return jnp.sum(B.attention(q, k, v, backend="cudnn", window=window).astype(jnp.float32) * dout)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, k, q).compile()

    calls = _window_lengths(grads(w))
    assert calls == [("__cudnn$fmhaSoftmax", w, "CAUSAL")] + [("__cudnn$fmhaSoftmaxBackward", w, "CAUSAL")] * 4
    assert {c[1] for c in _window_lengths(grads(s))} == {0}
    fwd = jax.jit(functools.partial(B.attention_fwd_with_lse, backend="cudnn", window=w)).lower(q, k, k).compile()
    assert _window_lengths(fwd) == [("__cudnn$fmhaSoftmax", w, "CAUSAL")]


def test_a_window_with_documents_or_without_the_causal_mask_is_refused_in_one_line():
    q = jax.ShapeDtypeStruct((1, 256, 4, 64), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((1, 256), jnp.int32)
    with pytest.raises(ValueError, match="segment ids .*with a sliding window.*attention.backend=pallas") as e:
        jax.eval_shape(functools.partial(CU.cudnn_attention, segment_ids=seg, window=64), q, q, q)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="sliding window needs causal=True"):
        jax.eval_shape(functools.partial(CU.cudnn_attention_fwd, causal=False, window=64), q, q, q)
    with pytest.raises(ValueError, match="window=-1"):
        jax.eval_shape(functools.partial(CU.cudnn_attention_bwd, window=-1), q, q, q, q,
                       jax.ShapeDtypeStruct((1, 4, 256), jnp.float32), q)


def test_bad_inputs_are_clear_errors_before_compiling(monkeypatch):
    q = jax.ShapeDtypeStruct((1, 256, 4, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((1, 256), jnp.int32)
    with pytest.raises(ValueError, match="segment ids.*attention.backend=blockwise"):
        jax.eval_shape(functools.partial(CU.cudnn_attention_fwd, segment_ids=seg), q, k, k)
    f32 = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        jax.eval_shape(CU.cudnn_attention, f32, f32, f32)
    odd = jax.ShapeDtypeStruct((1, 256, 4, 60), jnp.bfloat16)
    with pytest.raises(ValueError, match="model.head_dim"):
        jax.eval_shape(CU.cudnn_attention, odd, odd, odd)
    with pytest.raises(ValueError, match="lse"):
        bad_lse = jax.ShapeDtypeStruct((1, 256, 4), jnp.float32)
        jax.eval_shape(CU.cudnn_attention_bwd, q, k, k, q, bad_lse, q)
    # 2**24 tokens of one 128-dim head is 2**31 elements: refused before tracing into cuDNN, naming the keys.
    big = jax.ShapeDtypeStruct((1, 2**24, 1, 128), jnp.bfloat16)
    with pytest.raises(ConfigError, match=r"2,147,483,648 elements.*seq_len"):
        jax.eval_shape(CU.cudnn_attention, big, big, big)
    just_fits = jax.ShapeDtypeStruct((1, 2**24 - 8, 1, 128), jnp.bfloat16)
    CU._check(just_fits, just_fits, just_fits, None)
    # Several heads past the limit are split into calls under it (forward), one head per call (backward).
    many = jax.ShapeDtypeStruct((1, 2**22, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 2**22, 2, 128), jnp.bfloat16)
    assert CU._forward_heads_per_call(many, kv) == 2
    assert CU._calls(many, kv, 2) == [(0, 2, 0, 1), (2, 4, 0, 1), (4, 6, 1, 2), (6, 8, 1, 2)]
    # A JAX without the private module's names: a clear error naming the checked versions.
    monkeypatch.setattr(CU, "_NAMES", CU._NAMES + ("_no_such_function",))
    with pytest.raises(RuntimeError, match=r"_no_such_function.*checked with JAX 0\.10\.2.*blockwise"):
        CU._api()
