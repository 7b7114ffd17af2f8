"""Configs the mesh cannot run fail in config validation, before anything is traced or compiled, with the
option, its value and values that work. Also: one dispatch entry per `attention.impl`, and the planner's
multi-node ladder. Nothing here compiles."""

import pytest

from jaxlong.config import ConfigError, load_config, runtime
from jaxlong.parallel.dispatch import IMPLS, METHODS
from jaxlong.parallel.ulysses import context_degrees
from jaxlong.plan.planner import ladder

LLAMA_8B = "configs/llama3_1_8b.yaml"  # 32 query heads, 8 KV heads
NODES_2 = ["mesh.num_devices=16", "mesh.data=1", "mesh.fsdp=1", "data.packing=concat"]


def test_context_degrees_split_or_replicate_kv_heads():
    assert context_degrees(32, 8) == [1, 2, 4, 8, 16, 32]  # 1..8 split KV heads, 16 and 32 replicate them
    assert context_degrees(12, 3) == [1, 3, 6, 12]
    assert context_degrees(24, 4) == [1, 2, 4, 8, 12, 24]


@pytest.mark.parametrize("overrides, match", [
    # Ulysses: heads % context; no context degree alone fits 12 devices with these heads: context and ring together
    (["mesh.num_devices=12", "mesh.context=12", "seq_len=245760"],
     r"model.heads=32 is not divisible by mesh.context=12.*mesh.ring\); no single option fixes it: change "
     r"mesh.context=4 and mesh.ring=-1 together, or mesh.context=4 and mesh.ring=3$"),
    # Ulysses x ring: the same rule for the context part of the hybrid
    (["mesh.num_devices=12", "mesh.ring=2", "mesh.context=6", "seq_len=245760"],
     r"model.heads=32 is not divisible by mesh.context=6.*change mesh.context=4 and mesh.ring=3 together"),
    # KV heads neither split nor replicated: the option set first that can fix it
    (["model.heads=24", "model.kv_heads=6", "mesh.num_devices=4", "mesh.context=4"],
     r"model.kv_heads=6 and mesh.context=4: .*neither holds; use model.kv_heads=4 or 8$"),
    # zigzag: seq % (2 * ring * context), with the nearest lengths that pass (the ring's blocks of 256 too)
    (["mesh.ring=2", "mesh.context=8", "seq_len=1048592"],
     r"seq_len=1048592 is not divisible by 2\*mesh.ring\*mesh.context = 2\*2\*8 = 32.*; use seq_len=1048576 or "
     r"1050624$"),
    # the ring's per-block kernel tile divides seq/(2*ring)
    (["mesh.ring=2", "mesh.context=8", "seq_len=12288", "attention.block_q=2048"],
     r"attention.block_q=2048 must divide ring attention's block of seq_len/\(2\*mesh.ring\) = 3072 tokens"),
    # U-Pipe x ring: heads per stage vs context (a multiple of C dividing H)
    (["mesh.ring=2", "mesh.context=8", "attention.impl=upipe", "attention.heads_per_stage=4"],
     r"attention.heads_per_stage=4 must be a multiple of mesh.context=8 and divide model.heads=32; "
     r"use attention.heads_per_stage=0 or 8$"),
    (["mesh.ring=2", "mesh.context=8", "attention.impl=upipe", "attention.heads_per_stage=24"],
     r"attention.heads_per_stage=24 .*; use attention.heads_per_stage=16 or 32$"),
    # U-Pipe x ring with a context degree the heads cannot split
    (["mesh.num_devices=12", "mesh.ring=2", "mesh.context=6", "seq_len=245760", "attention.impl=upipe"],
     r"model.heads=32 is not divisible by mesh.context=6"),
    # the local sequence the tiled loss splits is seq / (ring * context)
    (["mesh.ring=2", "mesh.context=8", "tiling.loss=true", "tiling.loss_tile=3"],
     r"tiling.loss_tile=3 must divide the local sequence length seq_len/\(mesh.ring\*mesh.context\) = 16384"),
])
def test_unrunnable_hybrid_configs_fail_validation(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(LLAMA_8B, [*NODES_2, *overrides])


@pytest.mark.parametrize("impl", ["ulysses", "upipe"])
@pytest.mark.parametrize("ring, context", [(2, 8), (4, 4), (16, 1)])
def test_runnable_hybrid_configs_validate(impl, ring, context):
    cfg = load_config(LLAMA_8B, [*NODES_2, f"mesh.ring={ring}", f"mesh.context={context}",
                                 f"attention.impl={impl}", "seq_len=1048576"])
    assert (cfg.mesh.ring, cfg.mesh.context) == (ring, context)


def test_every_attention_impl_has_one_dispatch_entry():
    assert set(METHODS) == set(IMPLS)


def test_ladder_adds_hybrid_rungs_when_the_mesh_has_a_ring():
    cfg = load_config(LLAMA_8B, [*NODES_2, "mesh.ring=2", "mesh.context=8"])
    rungs = ladder(cfg)
    names = [name for name, _, _ in rungs]
    assert names[-3:] == ["+ulysses x ring", "+U-Pipe x ring", "+kept attention"]
    assert rungs[0][2].mesh.ring == 1 and rungs[6][2].mesh.context == 16  # single-axis rungs: Ulysses over 16
    for (_, what, c), impl in zip(rungs[-3:-1], ("ulysses", "upipe")):
        assert (c.mesh.ring, c.mesh.context, c.mesh.num_devices, c.attention.impl) == (2, 8, 16, impl)
        assert (c.remat.policy, c.remat.offload_every, c.tiling.loss, c.tiling.mlp) == ("offload", 4, True, True)
        assert "8 devices" in what and "2" in what
    assert rungs[-1][2].remat.keep_attention == 32 and rungs[-1][2].attention.impl == "upipe"  # the speed rung
    assert rungs[-2][2].remat.keep_attention == 0
    one_node = [name for name, _, _ in ladder(load_config(LLAMA_8B, []))]  # one node: no hybrid rungs
    assert one_node[-3:] == ["+U-Pipe", "+grouped offload", "+kept attention"] and len(one_node) == 9


def test_memory_cli_validates_for_the_target_topology(capsys):
    """`--target h100:8x2` gives the config 16 devices before validating it: the error is ring attention's
    zigzag rule for ring 2 x context 8, not a mesh/device-count mismatch."""
    from jaxlong.memory.__main__ import main
    from jaxlong.plan.target import cuda_plugin_available

    if not cuda_plugin_available():
        pytest.skip("GPU targets need the CUDA plugin (jax[cuda12])")
    assert main(["--target", "h100:8x2", "--config", LLAMA_8B, "mesh.ring=2", "mesh.context=8",
                 "data.packing=concat", "seq_len=1048592"]) == 2
    assert "2*mesh.ring*mesh.context = 2*2*8 = 32" in capsys.readouterr().err


def test_ring_meshes_resolve_the_gpu_kernels_on_gpu_targets():
    """Ring attention runs its blocks on the kernel `attention.backend` resolves to: on a GPU target `auto` is
    cuDNN for a ring mesh as for one node of Ulysses, and the Pallas kernel with packed documents. Mesh
    construction only, nothing compiles."""
    from helpers import tiny_cfg

    from jaxlong.core.mesh import build_mesh
    from jaxlong.plan.target import compile_only_devices, cuda_plugin_available, parse_target

    if not cuda_plugin_available():
        pytest.skip("GPU targets need the CUDA plugin (jax[cuda12])")
    devices = compile_only_devices(parse_target("h100:4x2"))
    for overrides, backend in ((["mesh.ring=2", "mesh.context=4", "data.packing=concat"], "cudnn"),
                               (["mesh.context=8", "data.packing=concat"], "cudnn"),
                               (["mesh.ring=2", "mesh.context=4", "data.packing=documents"], "pallas")):
        cfg = tiny_cfg("compute_dtype=bfloat16", "mesh.fsdp=1", *overrides)
        assert runtime(cfg, build_mesh(cfg.mesh, devices=devices)).attention_backend == backend


@pytest.mark.parametrize("argv,message", [
    (["--headroom", "5"], "--headroom '5' has no unit"),
    (["--headroom", "150%"], "a percentage must be between 0 and 50"),
    (["--max-context", "--start", "0"], "--start 0: the first length"),
    (["attention.backend=pallas"], "attention.backend=pallas compiles only for NVIDIA GPUs"),
])
def test_memory_cli_bad_flags_are_one_line_errors(capsys, argv, message):
    """Planner flags and GPU-only kernels on a CPU plan are refused before anything compiles (exit 2)."""
    from jaxlong.memory.__main__ import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
