"""Planning on XLA's GPU compiler without a GPU: targets, the deviceless compile, offload on the GPU target,
U-Pipe's memory on the GPU target, and clear errors for incomplete target specs.

The deviceless tests need the CUDA plugin (`jax[cuda12]`, installed by the test extra); where it is absent they
skip and say so. Nothing is allocated: every number comes from `compile().memory_analysis()`.
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from helpers import tiny_cfg
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlong.config import ConfigError
from jaxlong.plan.target import SPEC_DIR, TARGETS, compile_only_devices, cuda_plugin_available, load_spec, parse_target

needs_plugin = pytest.mark.skipif(not cuda_plugin_available(),
                                  reason="the CUDA plugin (pip install 'jax[cuda12]') is not installed")


def test_shipped_targets_parse_with_memory_and_name():
    sizes = {"h100": 84_942_979_072, "h200": 151_397_597_184, "a100": 85_100_068_864}
    for name in TARGETS:
        t = parse_target(name)
        assert t.device_memory == sizes[name] and t.devices == 8 and t.topology == "1x1x8"
        assert "NVIDIA" in t.device_name and t.peak_flops > 1e14
    t = parse_target("h100:4x2")
    assert (t.devices_per_node, t.nodes, t.devices, t.topology) == (4, 2, 8, "1x2x4")


def test_spec_missing_a_required_field_is_an_error_naming_it(tmp_path):
    text = (SPEC_DIR / "h100_sxm_80gb.txtpb").read_text()
    broken = "\n".join(line for line in text.splitlines() if "threads_per_warp" not in line)
    with pytest.raises(ConfigError, match="threads_per_warp"):
        load_spec(broken, "my.txtpb")
    path = tmp_path / "partial.txtpb"
    path.write_text("gpu_device_info {\n  device_memory_size: 1000\n  cuda_compute_capability { major: 9 }\n}\n")
    with pytest.raises(ConfigError, match="core_count"):
        parse_target(str(path))


def test_bad_target_names_are_errors():
    with pytest.raises(ConfigError, match="unknown GPU"):
        parse_target("v100000")
    with pytest.raises(ConfigError, match="does not exist"):
        parse_target("missing.txtpb")


def test_unsupported_field_is_dropped():
    text = (SPEC_DIR / "h100_sxm_80gb.txtpb").read_text().replace(
        "ecc_enabled: true", "ecc_enabled: true\n  collective_memory_granularity: 2097152")
    assert "collective_memory_granularity:" not in load_spec(text)


@pytest.mark.gpu_compile
@needs_plugin
def test_deviceless_gpu_compile_of_a_small_config():
    """The train step compiles for 8 compile-only H100s; `auto` attention resolves to cuDNN from the mesh's
    devices (the process's default backend is the CPU), and the plan adds its GPU-only rows."""
    from jaxlong.core.mesh import build_mesh
    from jaxlong.config import runtime
    from jaxlong.plan import plan

    cfg = tiny_cfg("compute_dtype=bfloat16", "mesh.fsdp=2", "mesh.context=4", "data.packing=concat")
    target = parse_target("h100")
    assert jax.default_backend() == "cpu"
    mesh = build_mesh(cfg.mesh, devices=compile_only_devices(target))
    assert runtime(cfg, mesh).attention_backend == "cudnn"
    p = plan(cfg, target)
    assert p["source"].startswith("GPU compile") and p["device_memory"] == target.device_memory
    assert p["workspace"] > 0 and p["collectives"] > 0 and p["headroom"] == int(target.device_memory * 0.02)
    assert p["total"] == p["peak"] + p["workspace"] + p["collectives"] + p["headroom"]
    assert p["activations"] > 0 and p["host"] == 0


@pytest.mark.gpu_compile
@pytest.mark.slow
@needs_plugin
def test_offload_puts_exactly_the_layer_inputs_in_host_memory_on_the_gpu_target():
    from jaxlong.plan import plan

    base = ("compute_dtype=bfloat16", "mesh.fsdp=1", "mesh.context=8", "global_batch=1", "seq_len=8192",
            "model.layers=4", "model.hidden=256", "model.kv_heads=8")
    target = parse_target("h100")
    full = plan(tiny_cfg(*base, "remat.policy=full"), target)
    off = plan(tiny_cfg(*base, "remat.policy=offload"), target)
    layer_inputs = 4 * (8192 // 8) * 256 * 2  # layers x [S/C, hidden] bf16 per device
    assert off["host"] == layer_inputs and full["host"] == 0
    assert off["host_per_node"] == 8 * layer_inputs
    assert off["activations"] < full["activations"]


@pytest.mark.gpu_compile
@pytest.mark.slow
@needs_plugin
def test_upipe_offload_keeps_its_output_buffer_on_the_host_on_the_gpu_target():
    """With remat.policy=offload, U-Pipe's output buffer `[S/C, H, d]` waits for its backward in host memory:
    the compiled host bytes are the layer inputs plus one such buffer (one layer's backward at a time)."""
    from jaxlong.plan import plan

    base = ("compute_dtype=bfloat16", "mesh.fsdp=1", "mesh.context=8", "global_batch=1", "seq_len=8192",
            "model.layers=4", "model.hidden=256", "model.kv_heads=8", "remat.policy=offload")
    target = parse_target("h100")
    cfg = tiny_cfg(*base, "attention.impl=upipe", "attention.heads_per_stage=0")
    p = plan(cfg, target)
    layer_input = (8192 // 8) * 256 * 2  # [S/C, hidden] bf16 per device
    out_buffer = (8192 // 8) * cfg.model.heads * cfg.model.head_dim * 2  # [S/C, H, d] bf16
    assert p["host"] == 4 * layer_input + out_buffer


@pytest.mark.gpu_compile
@pytest.mark.slow
@needs_plugin
def test_grouped_offload_host_bytes_and_recompute_on_the_gpu_target():
    """remat.offload_every=k over 8 layers: the compiled host memory falls from L layer inputs to at most
    ceil(L/k) + k (the group inputs and the group being recomputed), at least ceil(L/k) + 1; the compiled FLOPs
    grow by one forward per layer, at most 1.25x offload's (1% for the counted non-layer work of this tiny model).
    """
    from jaxlong.layers.remat import host_layer_inputs
    from jaxlong.plan import plan

    base = ("compute_dtype=bfloat16", "mesh.fsdp=1", "mesh.context=8", "global_batch=1", "seq_len=8192",
            "model.layers=8", "model.hidden=256", "model.kv_heads=8", "remat.policy=offload")
    target = parse_target("h100")
    layer_input = (8192 // 8) * 256 * 2  # [S/C, hidden] bf16 per device
    plans = {k: plan(tiny_cfg(*base, f"remat.offload_every={k}"), target, estimate=True) for k in (1, 2, 4)}
    assert plans[1]["host"] == 8 * layer_input
    for k in (2, 4):
        host = plans[k]["host"]
        assert (-(-8 // k) + 1) * layer_input <= host <= host_layer_inputs(8, k) * layer_input < plans[1]["host"]
        ratio = plans[k]["estimate"]["recompute_factor"] / plans[1]["estimate"]["recompute_factor"]
        assert 1.1 < ratio <= 1.25 * 1.01, ratio


S, C = 65536, 8


@functools.cache
def _upipe_layer_memory(u: int, dump_root: str) -> tuple[int, int, int, int]:
    """(allocated temp bytes, live bytes at the device peak from XLA's buffer assignment, argument bytes, output
    bytes) of one attention layer's forward + backward (Llama-3-8B head shapes, bf16) on 8 compile-only H100s."""
    from jaxlong.parallel.upipe import attention_layer
    from jaxlong.plan.peak import device_peak

    devices = compile_only_devices(parse_target("h100"))
    mesh = jax.make_mesh((1, 1, C), ("data", "fsdp", "context"), axis_types=(jax.sharding.AxisType.Auto,) * 3,
                         devices=devices)
    heads, kv_heads, d, hidden = 32, 8, 128, 4096
    act, rep = NamedSharding(mesh, P(("data", "fsdp"), "context", None)), NamedSharding(mesh, P())
    x = jax.ShapeDtypeStruct((1, S, hidden), jnp.bfloat16, sharding=act)
    ws = [jax.ShapeDtypeStruct((hidden, n, d), jnp.bfloat16, sharding=rep) for n in (heads, kv_heads, kv_heads)]
    ct = jax.ShapeDtypeStruct((1, S, heads, d), jnp.bfloat16,
                              sharding=NamedSharding(mesh, P(("data", "fsdp"), "context")))
    layer = attention_layer("upipe", mesh, heads_per_stage=u, backend="cudnn")

    def fwd_bwd(x, wq, wk, wv, ct):
        _, vjp = jax.vjp(layer, x, wq, wk, wv)
        return vjp(ct)

    dump = f"{dump_root}/u{u}"
    compiled = jax.jit(fwd_bwd).lower(x, *ws, ct).compile(compiler_options={"xla_dump_to": dump})
    m = compiled.memory_analysis()
    return m.temp_size_in_bytes, device_peak(dump)["bytes"], m.argument_size_in_bytes, m.output_size_in_bytes


@pytest.mark.gpu_compile
@pytest.mark.slow
@needs_plugin
def test_upipe_attention_memory_falls_with_heads_per_stage_on_the_gpu_target(tmp_path_factory):
    """U = C allocates less than U = H (277 against 325 MiB of temp at S = 64K; U = 16 allocates 357: its
    stages' query tensors are twice U = 8's and the weights, not the sequence, dominate at this length) and holds
    less at its peak. `jaxlong.plan.peak`'s live bytes account for the allocation: the temporaries and the
    arguments are live at the peak, at most the outputs besides (XLA's buffer assignment leaves no holes)."""
    root = str(tmp_path_factory.mktemp("upipe_dump"))
    (t32, p32, a32, o32), (t16, p16, a16, o16), (t8, p8, a8, o8) = (_upipe_layer_memory(u, root) for u in (32, 16, 8))
    assert t8 < 0.9 * t32, (t32, t16, t8)
    assert p8 < p32, (p32, p8)
    for t, p, a, o in ((t32, p32, a32, o32), (t16, p16, a16, o16), (t8, p8, a8, o8)):
        assert t + a <= p * 1.02 and p <= t + a + o, (t, p, a, o)
