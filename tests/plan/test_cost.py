"""The compiled-cost counter (`jaxlong.plan.cost`) and the roofline estimate.

On the CPU the counter is checked against known matmul counts through `lax.scan` loops and against XLA's own
`cost_analysis()`; on the GPU target (deviceless compile, needs the CUDA plugin) U-Pipe is checked to do the same
attention work and FLOPs as Ulysses, and packed documents' attention counted as the kernels' tile bounds run it.
"""

import jax
import jax.numpy as jnp
import pytest
from helpers import mesh_for, tiny_cfg

from jaxlong.config import ConfigError
from jaxlong.plan.cost import Cost, hlo_cost, roofline
from jaxlong.plan.packing import attention_tile_fraction, document_lengths, pack_rows
from jaxlong.plan.target import cuda_plugin_available, parse_target

needs_plugin = pytest.mark.skipif(not cuda_plugin_available(),
                                  reason="the CUDA plugin (pip install 'jax[cuda12]') is not installed")


def _scan_fn(x, ws):
    def body(x, w):
        return jnp.tanh(x @ w), None

    return jax.lax.scan(body, x, ws)[0].sum()


def test_matmuls_in_a_scan_count_trip_count_times():
    x, ws = jnp.ones((64, 128)), jnp.ones((5, 128, 128))
    matmul = 2 * 64 * 128 * 128
    fwd = jax.jit(_scan_fn).lower(x, ws).compile()
    assert hlo_cost(fwd.as_text()).flops == 5 * matmul
    # the gradient: the forward matmul plus two in the backward (dx, dw) per step, each in its own loop
    grad = jax.jit(jax.grad(_scan_fn, argnums=1)).lower(x, ws).compile()
    assert hlo_cost(grad.as_text()).flops == 3 * 5 * matmul

    def nested(x, wss):  # a scan of scans: 3 x 5 matmuls
        return jax.lax.scan(lambda x, ws: (x + _scan_fn(x, ws), None), x, wss)[0].sum()

    both = jax.jit(nested).lower(x, jnp.ones((3, 5, 128, 128))).compile()
    c = hlo_cost(both.as_text())
    assert c.flops == 15 * matmul and not c.warnings


SLICE_HLO = """HloModule m

%fused_slice (param_0: f32[32,8,1024,128], param_1: s32[]) -> f32[1,8192,128] {
  %param_0 = f32[32,8,1024,128]{3,2,1,0} parameter(0)
  %bitcast.1 = f32[32,8192,128]{2,1,0} bitcast(%param_0)
  %param_1 = s32[] parameter(1)
  %constant.0 = s32[] constant(0)
  ROOT %dynamic-slice.1 = f32[1,8192,128]{2,1,0} dynamic-slice(%bitcast.1, %param_1, %constant.0, %constant.0), \
dynamic_slice_sizes={1,8192,128}
}

ENTRY %main (p0: f32[32,8,1024,128], p1: s32[]) -> f32[1,8192,128] {
  %p0 = f32[32,8,1024,128]{3,2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  ROOT %fusion = f32[1,8192,128]{2,1,0} fusion(%p0, %p1), kind=kLoop, calls=%fused_slice
}
"""


def test_a_slice_read_through_a_bitcast_counts_the_slice():
    """One layer's slice of a stacked `[layers, ...]` buffer, read through a bitcast inside the fusion (as the
    decode step reads its layer's KV cache): the fusion moves the slice in and out, not the whole stack."""
    layer = 8192 * 128 * 4
    assert hlo_cost(SLICE_HLO).hbm_bytes == 2 * layer + 4  # the slice read and written, and the s32 index
    # the bitcast also read whole (its root): the whole stack counts
    whole = SLICE_HLO.replace("ROOT %dynamic-slice.1", "%dynamic-slice.1").replace(
        "dynamic_slice_sizes={1,8192,128}\n}", "dynamic_slice_sizes={1,8192,128}\n  ROOT %t = "
        "(f32[1,8192,128], f32[32,8192,128]) tuple(%dynamic-slice.1, %bitcast.1)\n}")
    assert "ROOT %t" in whole
    assert hlo_cost(whole).hbm_bytes >= 32 * layer


def test_cpu_train_step_matmul_flops_match_xla_cost_analysis(default_emitters):
    """One layer (no loop: XLA's CPU `cost_analysis()` counts a loop body once, so it is comparable only without
    loops) with the reference attention (plain dots). XLA counts every elementwise op as FLOPs too (about 2% of
    this step: optimizer update, softmax, norms) while the counter counts matmuls only, so the counter is at most
    XLA's number and within 5% of it."""
    cfg = tiny_cfg("attention.backend=reference", "model.layers=1", "seq_len=256", "model.hidden=256",
                   "model.mlp_hidden=1024", "model.head_dim=64")
    from jaxlong.training import step as step_lib

    compiled = step_lib.compile_train_step(cfg, mesh_for(cfg, cfg.mesh.num_devices))
    text = compiled.as_text()
    assert " while(" not in text
    xla = compiled.cost_analysis()["flops"]
    c = hlo_cost(text, cfg.mesh.num_devices)
    assert 0.95 * xla <= c.flops <= xla, (c.flops, xla)
    # context parallelism (all-to-all) and FSDP (all-gather of weights, reduce-scatter or all-reduce of grads)
    assert c.collective_bytes.get("all-to-all", 0) > 0 and c.collective_bytes.get("all-gather", 0) > 0
    assert c.hbm_bytes > 0 and not c.attention_calls


def test_roofline_terms():
    c = Cost(flops=1e15, hbm_bytes=1e12, collective_wire_bytes={"all-to-all": 4.5e9, "all-gather": 4.5e11},
             collective_bytes={"all-to-all": 5e9, "all-gather": 5e11})
    e = roofline(c, peak_flops=1e15, hbm_bandwidth=1e12, link_bandwidth=450e9, network_bandwidth=None,
                 model_flops=5e14, tokens=8000, devices=8, efficiency=0.5)
    assert e["compute_seconds"] == pytest.approx(2.0) and e["memory_seconds"] == pytest.approx(1.0)
    # all-to-all exposed (0.01 s); the FSDP all-gather (1 s) is hidden behind 2 s of compute
    assert e["step_seconds"] == pytest.approx(2.01) and e["bound"] == "compute"
    assert e["tokens_per_s_per_gpu"] == pytest.approx(8000 / 2.01 / 8)
    assert e["mfu"] == pytest.approx(5e14 / 2.01 / 1e15) and e["recompute_factor"] == pytest.approx(2.0)
    assert "Estimate" in e["assumptions"]
    slow = roofline(c, peak_flops=1e15, hbm_bandwidth=1e12, link_bandwidth=45e9, network_bandwidth=None,
                    model_flops=5e14, tokens=8000, devices=8, efficiency=0.5)
    assert slow["step_seconds"] == pytest.approx(2.0 + 0.1 + (10.0 - 2.0))  # the FSDP excess shows


def test_estimate_on_the_cpu_is_a_clear_error():
    from jaxlong.plan import plan

    if jax.default_backend() != "cpu":
        pytest.skip("the CPU refusal is for machines without a GPU")
    with pytest.raises(ConfigError, match="needs a GPU target"):
        plan(tiny_cfg(), None, estimate=True)


@pytest.mark.gpu_compile
@pytest.mark.slow
@needs_plugin
def test_upipe_does_the_attention_work_and_flops_of_ulysses_on_the_gpu_target():
    """Llama-3-8B attention shapes (32 query heads, 8 KV heads, head_dim 128) at 8-way context parallelism, full
    remat, a sequence long enough that attention dominates. U-Pipe (U = C: one head per device per stage) runs
    more, smaller cuDNN calls; the attention work (calls x heads per call) and the step's FLOPs must equal
    Ulysses': one forward, one remat forward and one backward per layer, no recomputed forward in the backward."""
    from jaxlong.plan import plan

    layers, seq, heads, c = 2, 65536, 32, 8
    base = ("compute_dtype=bfloat16", "mesh.fsdp=1", "mesh.context=8", "global_batch=1", f"seq_len={seq}",
            f"model.layers={layers}", "model.hidden=4096", f"model.heads={heads}", "model.kv_heads=8",
            "model.head_dim=128", "model.mlp_hidden=1024", "model.vocab_size=1024", "remat.policy=full",
            "data.packing=concat")
    target = parse_target("h100")
    ul = plan(tiny_cfg(*base, "attention.impl=ulysses"), target, estimate=True)["estimate"]
    up = plan(tiny_cfg(*base, "attention.impl=upipe"), target, estimate=True)["estimate"]
    per_device_heads = heads // c
    assert ul["attention_head_calls"] == {"forward": 2 * layers * per_device_heads,
                                          "backward": layers * per_device_heads}, ul["attention_head_calls"]
    assert up["attention_head_calls"] == ul["attention_head_calls"], (up, ul)
    assert up["attention_calls"]["backward"] == ul["attention_calls"]["backward"]
    assert up["attention_flops"] == pytest.approx(ul["attention_flops"], rel=1e-9)
    assert abs(up["flops"] / ul["flops"] - 1) < 0.02, (up["flops"], ul["flops"])
    for e in (ul, up):
        assert e["step_seconds"] > 0 and 0 < e["mfu"] < 1 and e["recompute_factor"] > 1
        assert e["hbm_bytes"] > 0 and e["collective_bytes"] > 0 and e["model_flops"] > 0


@pytest.mark.gpu_compile
@pytest.mark.slow
@needs_plugin
def test_packed_documents_count_the_pallas_kernels_attention_work_on_the_gpu_target():
    """With `data.packing=documents` the GPU runs the Pallas attention kernels (Triton custom calls, which XLA
    does not cost): their attention FLOPs are counted, dense causal, the same per call as cuDNN's forward (2
    matmuls) and 7 matmuls backward (dK/dV 4, dQ 3) where cuDNN's backward does 5: packed documents' attention
    work is 4.5/3.5 of cuDNN's, never 0 (it was, which made packed runs look several times faster)."""
    from jaxlong.plan import plan

    base = ("compute_dtype=bfloat16", "mesh.fsdp=1", "mesh.context=8", "global_batch=1", "seq_len=16384",
            "model.layers=2", "model.hidden=1024", "model.heads=16", "model.kv_heads=8", "model.head_dim=64",
            "model.mlp_hidden=1024", "model.vocab_size=1024", "remat.policy=none",
            "attention.block_q=128", "attention.block_k=128")
    target = parse_target("h100")
    dense = plan(tiny_cfg(*base, "data.packing=concat"), target, estimate=True)["estimate"]
    packed = plan(tiny_cfg(*base, "data.packing=documents"), target, estimate=True)["estimate"]
    assert packed["attention_head_calls"] == dense["attention_head_calls"], (packed, dense)
    assert packed["attention_flops"] == pytest.approx(dense["attention_flops"] * 4.5 / 3.5, rel=1e-9)
    assert packed["recompute_factor"] > 1 and not packed["warnings"]
    # documents of 1,024 tokens: the kernels skip the tiles between them, and the estimate counts what they run
    short = plan(tiny_cfg(*base, "data.packing=documents", "data.doc_lengths=[1024]"), target, estimate=True)
    short = short["estimate"]
    fraction = attention_tile_fraction([1024], 16384, 128, 128)
    assert short["packed_attention"]["tile_fraction"] == fraction == pytest.approx(16 * 36 / (128 * 129 / 2))
    assert short["attention_flops"] == pytest.approx(packed["attention_flops"] * fraction, rel=1e-9)
    assert short["flops"] == pytest.approx(packed["flops"] - packed["attention_flops"] * (1 - fraction), rel=1e-9)
    assert short["tokens_per_s_per_gpu"] > packed["tokens_per_s_per_gpu"]


def test_the_tiles_packed_documents_skip_are_counted_as_the_kernels_bound_them(tmp_path):
    """`attention_tile_fraction`: one document filling the row runs every causal tile; n equal documents of a
    whole number of tiles run n triangles of (L / b)(L / b + 1) / 2 tiles of the row's (S / b)(S / b + 1) / 2; a
    document longer than the row is cut into pieces of the row; a tile straddling two documents runs from the
    first one's start. A preference file's lengths are measured as two documents per pair."""
    S, b = 1 << 16, 512
    assert attention_tile_fraction([S], S, b, b) == 1.0
    assert attention_tile_fraction([S // 16], S, b, b) == pytest.approx(16 * 8 * 9 / 2 / (128 * 129 / 2))
    assert attention_tile_fraction([3 * S], S, b, b) == 1.0  # pieces of a whole row
    rows = pack_rows([300, 700, 1500], 1024, 4)
    assert len(rows) == 4 and all(sum(r) <= 1024 for r in rows) and 1024 in {n for r in rows for n in r}
    # two documents of 768 and 256 tokens in tiles of 512: tile 1 starts inside the first document, so it runs
    # kv tiles 0-1; tile 0 runs tile 0: all 3 causal tiles
    assert attention_tile_fraction([768, 256], 1024, 512, 512) == 1.0
    assert attention_tile_fraction([512, 512], 1024, 512, 512) == pytest.approx(2 / 3)
    pairs = tmp_path / "p.jsonl"
    pairs.write_text('{"prompt": "ab", "chosen": "cde", "rejected": "f"}\n' * 3)
    cfg = tiny_cfg("model.vocab_size=257", f"data.path={pairs}", "data.format=preference", "objective=dpo",
                   "seq_len=64")
    lengths, where = document_lengths(cfg)
    assert lengths == [6, 4] * 3 and where.startswith("measured from")  # BOS a b c d e EOS: 6 next-token pairs
    assert document_lengths(tiny_cfg("data.doc_lengths=[100, 200]")) == ([100, 200], "data.doc_lengths")
    assert document_lengths(tiny_cfg()) is None  # text: dense causal, a bound
    with pytest.raises(ConfigError, match="data.doc_lengths=.0.: document lengths are positive"):
        tiny_cfg("data.doc_lengths=[0]")


def test_cli_estimate_without_a_gpu_target_is_a_one_line_error(capsys, monkeypatch):
    from jaxlong.memory import __main__ as memory

    monkeypatch.setattr(memory, "_gpu_present", lambda: False)
    assert memory.main(["--estimate", "model.layers=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --estimate needs a GPU target") and "\n" not in err
    assert memory.main(["--target", "h100", "--estimate", "--max-context"]) == 2
