"""Gemma 3 as a family on the one decoder layer: the layer's math against a forward written out here in numpy from
transformers' `Gemma3TextModel` (not the package's code), sliding-window and global layers in one scan, on one
device and on the meshes that run windows (FSDP, Ulysses with 1 KV head), forward and gradients against the dense
single-device reference, with the memory techniques; and the one-line refusals of what does not run windows yet."""

from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import assert_matches_single_device, mesh_for, reference_cfg, tiny_cfg
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlong.config import runtime, validate
from jaxlong.core.errors import ConfigError
from jaxlong.models import llama as model_lib
from jaxlong.models.family import LOCAL, layer_kinds
from jaxlong.plan.target import cuda_plugin_available

# 4 layers, local-global-local-global (pattern 2), a window of 8 positions inside the 16-token tiles, 4 query heads
# and 1 KV head (Gemma 3 270M's), an attention scalar of 24 with head_dim 16, tied embeddings, RoPE bases 1M / 10K.
GEMMA = ["model.family=gemma3", "model.layers=4", "model.sliding_window_pattern=2", "model.sliding_window=8",
         "model.heads=4", "model.kv_heads=1", "model.query_pre_attn_scalar=24", "model.tie_embeddings=true",
         "model.rope_theta=1000000", "model.rope_local_theta=10000"]


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + w)


def _rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = pos[..., None].astype(np.float64) * inv  # [b, s, d/2]
    c, s = np.cos(ang)[:, :, None], np.sin(ang)[:, :, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def gemma3_logits(p, tokens, positions, ids, m):
    """Gemma 3's forward as transformers writes it (`Gemma3TextModel`, `Gemma3DecoderLayer`), float64 numpy: the
    embeddings times sqrt(hidden); per layer `x + post_norm(attn(norm(x)))`, `x + post_norm(mlp(norm(x)))` with
    RMSNorm `(1 + w)`, QK-norm before RoPE (base 10K on local layers, 1M on global ones), scores times
    `query_pre_attn_scalar ** -0.5`, a local layer's query seeing itself and the window - 1 keys before it, no key of
    another document; GeGLU with the tanh GELU; the final norm; tied head."""
    f = lambda a: np.asarray(a, np.float64)
    eps, g = m.norm_eps, m.heads // m.kv_heads
    x = f(p["embed"])[tokens] * np.sqrt(m.hidden)
    s = tokens.shape[1]
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    same = ids[:, :, None] == ids[:, None, :]
    for layer, kind in enumerate(layer_kinds(m)):
        w = jax.tree.map(lambda a: f(a[layer]), p["layers"])
        h = _rms(x, w["attn_norm"], eps)
        q = np.einsum("bsh,hnd->bsnd", h, w["wq"])
        k = np.einsum("bsh,hnd->bsnd", h, w["wk"])
        v = np.einsum("bsh,hnd->bsnd", h, w["wv"])
        theta = m.rope_local_theta if kind == LOCAL else m.rope_theta
        q, k = _rope(_rms(q, w["q_norm"], eps), positions, theta), _rope(_rms(k, w["k_norm"], eps), positions, theta)
        k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
        sc = np.einsum("bqnd,bknd->bnqk", q, k) * m.query_pre_attn_scalar ** -0.5
        mask = (j <= i) & ((i - j < m.sliding_window) if kind == LOCAL else True)
        sc = np.where((mask[None] & same)[:, None], sc, -np.inf)
        pr = np.exp(sc - sc.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        o = np.einsum("bnqk,bknd,ndh->bqh", pr, v, w["wo"])
        x = x + _rms(o, w["post_attn_norm"], eps)
        h = _rms(x, w["mlp_norm"], eps)
        y = (_gelu_tanh(h @ w["w_gate"]) * (h @ w["w_up"])) @ w["w_down"]
        x = x + _rms(y, w["post_mlp_norm"], eps)
    return _rms(x, f(p["final_norm"]), eps) @ f(p["embed"]).T


def _packed(cfg, seed=0):
    """Two rows of packed documents (20 + 44 and 64 tokens), positions restarting at each."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.model.vocab_size, (2, cfg.seq_len)).astype(np.int32)
    ids = np.ones((2, cfg.seq_len), np.int32)
    ids[0, 20:] = 2
    positions = np.stack([np.r_[np.arange(20), np.arange(44)], np.arange(64)]).astype(np.int32)
    return tokens, positions, ids


def _params(cfg, mesh, seed=0):
    """Initial parameters with every norm weight drawn (so that `1 + w` differs from `w`), on `mesh`."""
    params = model_lib.init_params(cfg.model, mesh, 0)
    rng = np.random.default_rng(seed)

    def draw(path, a):
        if "norm" not in jax.tree_util.keystr(path):
            return a
        return jax.device_put(0.3 * rng.standard_normal(a.shape).astype(np.float32), a.sharding)

    return jax.tree_util.tree_map_with_path(draw, params)


@pytest.mark.parametrize("mesh", [("mesh.fsdp=2", "mesh.context=4")], ids=["fsdp2-ulysses4"])
def test_the_layer_equals_gemma3_written_out_with_windows_and_documents(mesh):
    """Logits of packed documents on one device and on Ulysses 4 x FSDP 2 (1 KV head replicated to the 4 devices)
    equal the numpy forward, within float32's rounding."""
    tokens, positions, ids = None, None, None
    for overrides, n in ((("mesh.fsdp=1", "mesh.context=1", "mesh.num_devices=1"), 1), (mesh, 8)):
        cfg = tiny_cfg(*GEMMA, "data.packing=documents", *overrides)
        dev = mesh_for(cfg, n)
        params = _params(cfg, dev)
        tokens, positions, ids = _packed(cfg)
        rt = runtime(cfg, dev)
        graphdef = model_lib.model_graphdef(cfg.model, cfg.param_dtype)
        put = lambda a: jax.device_put(a, NamedSharding(dev, P(("data", "fsdp"), "context")))

        @jax.jit
        def logits(p, t, pos, seg):
            hidden, head = model_lib.forward(graphdef, p, t, rt, pos, seg)
            return hidden @ head

        got = np.asarray(logits(params, put(tokens), put(positions), put(ids)))
        want = gemma3_logits(jax.tree.map(np.asarray, params), tokens, positions, ids, cfg.model)
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


MESHES = {
    "fsdp2-ulysses4-tiled-full": ("mesh.fsdp=2", "mesh.context=4", "tiling.mlp=true", "tiling.loss=true",
                                  "remat.policy=full"),
    "dp2-fsdp2-ulysses2-offload-kept": ("mesh.data=2", "mesh.fsdp=2", "mesh.context=2", "global_batch=4",
                                        "remat.policy=offload", "remat.offload_every=2", "remat.keep_attention=1"),
    "ring2-ulysses4-documents": ("mesh.fsdp=1", "mesh.ring=2", "mesh.context=4", "data.packing=documents"),
    "ring8-wide-window": ("mesh.fsdp=1", "mesh.ring=8", "mesh.context=1", "attention.block_q=4",
                          "attention.block_k=4"),
    "fsdp2-upipe4-documents-a2a": ("mesh.fsdp=2", "mesh.context=4", "attention.impl=upipe", "data.packing=documents",
                                   "attention.window_exchange=all_to_all"),
    "fsdp4-upipe2-U2-offload-kept-a2a": ("mesh.fsdp=4", "mesh.context=2", "attention.impl=upipe",
                                         "attention.heads_per_stage=2", "global_batch=4", "remat.policy=offload",
                                         "remat.keep_attention=1", "attention.window_exchange=all_to_all"),
    "fsdp4-upipe2-halo": ("mesh.fsdp=4", "mesh.context=2", "attention.impl=upipe", "global_batch=4",
                          "attention.window_exchange=halo"),
    "ring2-upipe2-U2-documents": ("mesh.fsdp=2", "mesh.ring=2", "mesh.context=2", "attention.impl=upipe",
                                  "attention.heads_per_stage=2", "data.packing=documents", "attention.block_q=8",
                                  "attention.block_k=8"),
    "ring4-upipe2-wide-window": ("mesh.fsdp=1", "mesh.ring=4", "mesh.context=2", "attention.impl=upipe",
                                 "attention.block_q=4", "attention.block_k=4", "model.sliding_window=12"),
}
FAST_MESHES = {"ring2-upipe2-U2-documents"}  # Ulysses with a window runs fast in tests/kernels/test_window.py


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in FAST_MESHES else pytest.mark.slow)
                                  for n in MESHES])
def test_every_windowed_mesh_equals_the_dense_single_device_reference(name):
    """Loss and every gradient of the windowed model (local and global layers in one scan) on 8 devices equal the
    dense single-device reference's (materialized attention with the window, no remat, no tiling). Under ring the
    local layers take the halo exchange (`jaxlong.parallel.halo`), the global layers the ring; on ring 8 (half-chunks
    of 4 tokens) and ring 4 x U-Pipe 2 (8 tokens, a window of 12) the halo takes two hops. Without ring the local
    layers take the halo exchange over context (`attention.window_exchange=auto` finds it fewer bytes here) or, with
    `all_to_all`, Ulysses' and U-Pipe's all-to-alls. U-Pipe runs the sandwich norm and the query scale inside its op,
    in one stage of 4 heads or two of 2."""
    cfg = tiny_cfg(*GEMMA, *MESHES[name])
    assert reference_cfg(cfg).attention.backend == "reference"
    # atol 2e-7 on gradients of scale 0.1 to 0.2: float32's rounding of sums taken in another order (every mesh's
    # median error is 1e-6 of the value; its largest relative ones are on elements near 0)
    assert_matches_single_device(cfg, atol=2e-7)


@pytest.mark.parametrize("overrides,match", [
    (("model.family=llama",), "model.family=llama has no sliding-window layers"),
    (("model.layer_types=[full_attention]",), "give model.layers=4 entries"),
])
def test_what_does_not_run_windows_yet_is_refused_in_one_line(overrides, match):
    with pytest.raises(ConfigError, match=match) as e:
        validate(tiny_cfg(*GEMMA, *overrides), 8)
    assert "\n" not in str(e.value)


@pytest.mark.gpu_compile
@pytest.mark.slow
@pytest.mark.skipif(not cuda_plugin_available(), reason="needs the CUDA plugin (pip install 'jax[cuda12]')")
def test_what_offloads_from_inside_attention_compiles_for_the_gpu_as_all_global_does():
    """Kept attention in host memory (the first 4 of 8 layers), and U-Pipe's output buffer under `offload` (the other
    4), move tensors to host memory from inside the attention op. XLA:GPU cannot do that inside the kinds'
    `lax.switch`, so those layers take their kinds as Python ints in a scan over the kinds' period. GPU compile (8
    H100s): the mixed model compiles, offloads as many bytes as the same model all-global, and in both the kept half
    of the layers runs attention's forward once (1.5 forward head-calls per backward one)."""
    from jaxlong.plan import plan
    from jaxlong.plan.target import parse_target

    base = (*GEMMA, "compute_dtype=bfloat16", "mesh.fsdp=2", "mesh.context=4", "global_batch=2", "seq_len=2048",
            "model.hidden=256", "model.head_dim=64", "data.packing=concat", "attention.impl=upipe",
            "remat.policy=offload", "model.layers=8", "remat.keep_attention=4")
    runs = {w: plan(tiny_cfg(*base, f"model.sliding_window={w}"), parse_target("h100"), estimate=True)
            for w in (256, 0)}
    assert runs[256]["host"] == pytest.approx(runs[0]["host"], rel=0.02) and runs[0]["host"] > 0, runs
    for w, run in runs.items():
        calls = run["estimate"]["attention_head_calls"]
        assert calls["backward"] > 0 and calls["forward"] == 1.5 * calls["backward"], (w, calls)
    # (Each part scans 2 periods of 2 layers: XLA:GPU keeps on the device what a one-trip scan offloads, in the
    # all-global model too, docs/windows.md.)


def test_layer_kinds_follow_the_pattern_or_the_listed_types():
    cfg = tiny_cfg(*GEMMA, "model.layers=8", "model.sliding_window_pattern=6")
    assert layer_kinds(cfg.model) == (1, 1, 1, 1, 1, 0, 1, 1)
    cfg = tiny_cfg(*GEMMA, "model.layer_types=[full_attention,sliding_attention,sliding_attention,full_attention]")
    assert layer_kinds(cfg.model) == (0, 1, 1, 0)
    assert layer_kinds(tiny_cfg(*GEMMA, "model.sliding_window=0").model) == (0, 0, 0, 0)


def _decode_setup(*mesh: str):
    """`(cfg, mesh, params, whole_forward)` for decoding the tiny Gemma 3 on `mesh` (overrides): its parameters put
    on the mesh, and `whole_forward(rows) -> logits [rows, longest, vocab]`, one forward of the token rows
    (right-padded, one compile) on one device with materialized attention, the reference of every decode step."""
    from jaxlong.core.mesh import build_mesh

    base = [*GEMMA, "model.vocab_size=257", "global_batch=4", "model.tie_embeddings=true"]
    ref_cfg = tiny_cfg(*base, "mesh.num_devices=1", "mesh.fsdp=1", "mesh.context=1", "attention.backend=reference")
    ref_mesh = build_mesh(ref_cfg.mesh, jax.devices()[:1])
    host = jax.tree.map(np.asarray, _params(ref_cfg, ref_mesh))
    graphdef, rt = model_lib.model_graphdef(ref_cfg.model, ref_cfg.param_dtype), runtime(ref_cfg, ref_mesh)
    fwd = jax.jit(lambda p, t: model_lib.forward(graphdef, p, t, rt))

    def whole_forward(rows):
        batch = np.zeros((len(rows), max(map(len, rows))), np.int32)
        for r, row in enumerate(rows):
            batch[r, :len(row)] = row
        hidden, head = fwd(host, batch)
        return np.asarray(hidden @ head)

    cfg = tiny_cfg(*base, *mesh)
    dev = build_mesh(cfg.mesh, jax.devices()[:cfg.mesh.num_devices])
    shardings = jax.tree.map(lambda a: a.sharding, model_lib.init_params(cfg.model, dev, 0))
    return cfg, dev, jax.tree.map(jax.device_put, host, shardings), whole_forward


@pytest.mark.parametrize("mesh", [pytest.param(("mesh.num_devices=1", "mesh.fsdp=1", "mesh.context=1"), id="one"),
                                  pytest.param(("mesh.fsdp=2", "mesh.context=4"), id="fsdp2-ulysses4",
                                               marks=pytest.mark.slow),
                                  pytest.param(("mesh.fsdp=1", "mesh.ring=2", "mesh.context=4", "attention.block_q=8",
                                                "attention.block_k=8"), id="ring2-ulysses4", marks=pytest.mark.slow),
                                  pytest.param(("mesh.num_devices=1", "mesh.fsdp=1", "mesh.context=1",
                                                "prefill_chunk=4"), id="one-chunks4"),
                                  pytest.param(("mesh.fsdp=1", "mesh.ring=2", "mesh.context=4", "attention.block_q=8",
                                                "attention.block_k=8", "prefill_chunk=16"), id="ring2-ulysses4-chunks16",
                                               marks=pytest.mark.slow)])
def test_greedy_decode_with_windows_equals_the_whole_forward(mesh):
    """Prompts of 37, 20 and 3 tokens (4.6, 2.5 and 0.4 windows) decoded 10 steps from the cache, past the window
    of 8: a local layer's cache is a ring buffer of the window's 8 positions (the prompt's last ones, then each
    generated token over the one leaving the window), the global layers' the whole prompt; with `prefill_chunk` the
    prompts are prefilled in chunks (16: windows straddle two chunks; 4: three), each chunk's local layers seeing
    the cache within their window, their stacks holding only the chunks a window reaches (2 or 3 of 3 or 10), each
    row's window kept after the chunk where it ends (chunks 2, 1 and 0, or 9, 4 and 0). Every step's logits equal a
    whole one-device forward of the sequence so far (materialized attention with the window), and the tokens are its
    argmax; every decode step's cache has window-sized local stacks."""
    from jaxlong.data import ByteTokenizer
    from jaxlong.generation.generate import Generator

    cfg, dev, params, whole_forward = _decode_setup(*mesh)
    prompts = [np.arange(3, 40), np.arange(60, 80), np.array([256, 72, 105])]
    steps: list = []
    gen = Generator(cfg, dev, params, ByteTokenizer(), max_new_tokens=11)
    shapes, step = [], gen.step
    gen.step = lambda w, cache, *a: (shapes.append(jax.tree.map(np.shape, cache)), step(w, cache, *a))[1]
    out = gen(prompts, logits=steps)
    assert len(shapes) == 10 and all(s == shapes[0] for s in shapes)
    rows, prompt = shapes[0].valid
    assert shapes[0].win_k == shapes[0].win_v == (2, rows, 1, 8, 16)  # 2 local layers, the window's 8 slots
    assert shapes[0].k == (2, rows, 1, prompt, 16) and prompt >= 37 and shapes[0].new_k == (2, rows, 1, 11, 16)
    if cfg.prefill_chunk:  # the window layers' stacks while the chunks run: the 2 or 3 chunks a window reaches
        held = {16: 32, 4: 12}[cfg.prefill_chunk]
        assert gen.chunked.stacks(rows, prompt)[2].shape == (2, rows, 1, held, 16), gen.chunked.stacks(rows, prompt)
    # by causality the whole forward's logits at the prompt's last position + t are the ones that chose token t
    whole = whole_forward([np.concatenate([p, o.tokens]) for p, o in zip(prompts, out)])
    for r, prompt in enumerate(prompts):
        for t, token in enumerate(out[r].tokens):
            want = whole[r, len(prompt) - 1 + t]
            np.testing.assert_allclose(steps[t][r], want, rtol=0, atol=2e-5, err_msg=f"row {r}, step {t}")
            assert token == int(np.argmax(want))


@pytest.mark.slow
def test_a_group_of_samples_with_windows_decodes_from_one_prompt_cache():
    """GRPO's rollouts on a model with windows (`Sampling.n` 3, sampled): each prompt's window buffers are
    repeated for its 3 rows, which then write their own tokens into them, past the window of 8; every row's logits
    at every step equal a whole one-device forward of its prompt and its tokens, on ring 2 x Ulysses 4 (the prompt
    cache split by sequence, once per prompt)."""
    from jaxlong.data import ByteTokenizer
    from jaxlong.generation.decode import Sampling
    from jaxlong.generation.generate import Generator

    cfg, dev, params, whole_forward = _decode_setup("mesh.fsdp=1", "mesh.ring=2", "mesh.context=4",
                                                    "attention.block_q=8", "attention.block_k=8")
    prompts = [np.arange(3, 40), np.array([256, 72, 105])]
    steps: list = []
    gen = Generator(cfg, dev, params, ByteTokenizer(), max_new_tokens=11, sampling=Sampling(1.0, 0, 1.0, n=3))
    out = gen(prompts, seed=1, logits=steps)
    whole = whole_forward([np.concatenate([prompts[r // 3], o.tokens]) for r, o in enumerate(out)])
    for r, o in enumerate(out):
        assert len(o.tokens) == 11
        for t in range(len(o.tokens)):
            np.testing.assert_allclose(steps[t][r], whole[r, len(prompts[r // 3]) - 1 + t], rtol=0, atol=2e-5,
                                       err_msg=f"row {r}, step {t}")
    assert len({tuple(o.tokens) for o in out[:3]}) > 1


@pytest.mark.slow
def test_chunked_prefill_with_the_pallas_kernel_equals_the_whole_forward(monkeypatch):
    """The chunked prefill's GPU path on a model with windows, run on one device with the Pallas kernel in its
    interpreter: the global layers' chunk attention by the Pallas kernel with `kv_starts`, the local layers' with
    `kv_starts` and `kv_ends`, switched per layer in one scan; greedy decoding equals the whole forward as in
    `test_greedy_decode_with_windows_equals_the_whole_forward`."""
    from jaxlong.generation import chunked

    monkeypatch.setattr(chunked, "chunk_kernel", lambda cfg, mesh: "pallas-interpret")
    test_greedy_decode_with_windows_equals_the_whole_forward(("mesh.num_devices=1", "mesh.fsdp=1", "mesh.context=1",
                                                               "prefill_chunk=16"))


def test_the_window_slots_invert_the_prefills_layouts():
    """`zigzag_slot` and `chunk_slot` (the window gather's prompt index -> cache slot) invert ring attention's zigzag
    order and the chunked prefill's order."""
    from jaxlong.core.batch import zigzag_order
    from jaxlong.generation.chunked import chunk_order, chunk_slot
    from jaxlong.generation.decode import zigzag_slot

    for n, ring in ((48, 1), (48, 2), (64, 4)):
        np.testing.assert_array_equal(np.asarray(zigzag_slot(np.arange(n), n, ring)),
                                      np.argsort(zigzag_order(n, ring)))
    for n, chunk, devices in ((48, 16, 8), (64, 16, 4), (32, 32, 1)):
        np.testing.assert_array_equal(np.asarray(chunk_slot(np.arange(n), n, chunk, devices)),
                                      np.argsort(chunk_order(n, chunk, devices)))


def test_a_window_layers_cache_is_window_sized_at_any_prompt_length():
    """Gemma 3 12B on 8 devices (`configs/gemma3_12b.yaml`), shapes only: the 40 window layers' cache is their 1,024
    positions, replicated over the sequence axes, at 128K and 1M prompt tokens; the 8 global layers' is the prompt,
    split over the 8 devices; all-global (`model.sliding_window=0`), every layer's is the prompt."""
    from jaxlong.config import load_config
    from jaxlong.core.mesh import build_mesh
    from jaxlong.generation.decode import cache_bytes, cache_shapes

    gemma_12b = Path(__file__).parents[2] / "configs" / "gemma3_12b.yaml"
    for n in (1 << 17, 1 << 20):
        cfg = load_config(gemma_12b, [f"seq_len={n}"])
        mesh = build_mesh(cfg.mesh, jax.devices()[:8])
        c = cache_shapes(cfg, mesh, 1, n, 16)
        assert c.win_k.shape == c.win_v.shape == (40, 1, 8, 1024, 256)
        assert c.k.shape == (8, 1, 8, n, 256) and c.k.sharding.shard_shape(c.k.shape)[3] == n // 8
        assert cache_bytes(c)["win_k"] == 40 * 8 * 1024 * 256 * 2  # bfloat16, whole on every device
        flat = cache_shapes(load_config(gemma_12b, [f"seq_len={n}", "model.sliding_window=0"]),
                            mesh, 1, n, 16)
        assert flat.k.shape == (48, 1, 8, n, 256) and flat.win_k.shape[0] == 0
