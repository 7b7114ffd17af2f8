"""Config loading, overrides, and the errors promised before compiling."""

import glob
from pathlib import Path

import pytest

from jaxlong.config import Config, ConfigError, load_config, parse_override
from jaxlong.train.__main__ import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", sorted(glob.glob(str(ROOT / "configs" / "*.yaml"))))
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert cfg.model.heads % cfg.model.kv_heads == 0


def test_default_yaml_equals_builtin_defaults():
    assert load_config(ROOT / "configs" / "default.yaml") == Config()


def test_overrides_are_typed():
    cfg = load_config(None, ["mesh.data=2", "optim.lr=1e-4", "seq_len=16384", "data.path=null",
                             "model.tie_embeddings=true", "remat.save=[query_proj]"])
    assert (cfg.mesh.data, cfg.optim.lr, cfg.seq_len) == (2, 1e-4, 16384)
    assert cfg.data.path is None and cfg.model.tie_embeddings is True and cfg.remat.save == ["query_proj"]
    assert parse_override("optim.lr=3e-4") == ("optim.lr", 3e-4, "3e-4")


def test_string_options_keep_their_text():
    cfg = load_config(None, ["run_name=off", "data.path=2024-01-01.txt", "run_dir=123"])
    assert (cfg.run_name, cfg.data.path, cfg.run_dir) == ("off", "2024-01-01.txt", "123")


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["foo=1"], "unknown config key 'foo'.*allowed: attention"),
        (["mesh.contxt=2"], "unknown config key 'mesh.contxt'.*allowed: context"),
        (["seq_len=abc"], "'seq_len' must be of type int"),
        (["model.kv_heads=3"], "model.heads=4 must be a multiple of model.kv_heads=3"),
        (["mesh.context=8", "model.heads=4"], "model.heads=4 is not divisible by mesh.context=8"),
        (["model.heads=12", "model.kv_heads=3"], "kv_heads=3 and mesh.context=4"),
        (["seq_len=8190"], "seq_len=8190 is not divisible by mesh.context=4.*8192"),
        (["global_batch=3"], "global_batch=3 is not divisible by mesh.data\\*mesh.fsdp=2"),
        (["mesh.fsdp=3"], "data\\*fsdp\\*ring\\*context = 1\\*3\\*1\\*4 = 12, but there are 8 devices"),
        (["mesh.ring=2", "mesh.fsdp=1", "seq_len=8200", "data.packing=concat"],
         "seq_len=8200 is not divisible by 2\\*mesh.ring\\*mesh.context = 2\\*2\\*4 = 16 .*; use seq_len=8192 or 9216$"),
        (["mesh.ring=2", "mesh.fsdp=1", "seq_len=96", "attention.block_q=16", "data.packing=concat"],
         "attention.block_q=16 must divide ring attention's block of seq_len/\\(2\\*mesh.ring\\) = 24 tokens"),
        (["attention.impl=ring"], "attention.impl='ring' is not allowed; choose one of: ulysses, upipe"),
        (["attention.impl=upipe", "mesh.context=2", "mesh.fsdp=4", "model.heads=24", "model.kv_heads=4",
          "global_batch=4", "attention.heads_per_stage=8"],
         "U/C=4 and query heads per KV head 6 must divide one another; use attention.heads_per_stage=6 or 12$"),
        (["attention.impl=upipe", "remat.policy=custom", "remat.save=[attn_out]"],
         "\\['attn_out'\\], which attention.impl=upipe computes inside its op"),
        (["compute_dtype=fp8"], "compute_dtype='fp8' is not allowed"),
        (["remat.policy=some"], "remat.policy='some' is not allowed"),
        (["attention.impl=upipe", "attention.heads_per_stage=2"], "heads_per_stage=2 must be a multiple of mesh.context=4"),
        (["mesh", "=1"], "not of the form key=value"),
        (["data.path="], "data.path is empty"),
        (["data.tokenizer=gpt2"], "data.tokenizer='gpt2' is not allowed; choose one of: byte"),
        (["data.max_tokens=0"], "data.max_tokens=0 must be positive"),
        (["data.read_threads=-1"], "data.read_threads=-1 must be >= 0"),
        (["data.read_buffer=0"], "data.read_buffer=0 must be >= 1 document"),
        (["seed=-1"], "seed=-1 must be >= 0"),
        (["ruler_tasks=[vt, vt]"], "ruler_tasks=\\['vt', 'vt'\\]: a task is listed twice"),
        (["ruler_tasks=vt"], "'ruler_tasks' must be of type list, got 'vt'"),
        (["ruler_tasks=[vt]", "ruler_lengths=[512, 0]"], "ruler_lengths=\\[512, 0\\]: lengths must be positive"),
        (["ruler_tasks=[vt]", "ruler_cases=0"], "ruler_cases=0 must be positive"),
        (["ruler_tasks=[vt]", "eval_every=0"], "ruler_tasks=\\['vt'\\] runs with validation, which eval_every=0 "
                                               "disables"),
    ],
)
def test_bad_configs_raise_clear_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_cli_reports_config_errors_without_compiling(capsys):
    assert main(["model.kv_heads=3"]) == 2
    assert "error: model.heads=4 must be a multiple" in capsys.readouterr().err


@pytest.mark.parametrize("overrides,match", [
    (["attention.backend=cudnn", "data.packing=concat"], r"attention.backend=cudnn needs compute_dtype=bfloat16"),
    (["attention.backend=cudnn", "data.packing=concat", "compute_dtype=bfloat16", "model.head_dim=12"],
     r"cudnn needs model.head_dim a multiple of 8 and <= 256, got 12"),
    (["attention.backend=pallas", "model.head_dim=48"], r"pallas needs model.head_dim a power of two .*got 48"),
    (["attention.backend=cudnn", "compute_dtype=bfloat16", "mesh.ring=2", "mesh.context=4", "mesh.fsdp=1"],
     r"attention.backend=cudnn cannot mask packed documents"),  # under ring as without it
])
def test_explicit_attention_kernel_the_config_cannot_use_is_an_error_before_compiling(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


@pytest.mark.parametrize("overrides,match", [
    (["prefill_chunk=-8"], r"prefill_chunk=-8: give 0 \(the whole prompt in one forward\) or the tokens per chunk"),
    (["prefill_chunk=1002"], r"prefill_chunk=1002 must be a multiple of the sequence shards mesh.ring x mesh.context "
                             r"= 4 \(each holds an equal slice of every chunk\); use prefill_chunk=768 or 1024"),
    (["prefill_chunk=2560"], r"prefill_chunk=2560: each sequence shard's slice of a chunk \(prefill_chunk / "
                             r"\(mesh.ring x mesh.context\) = 640 tokens\) must be a multiple of "
                             r"attention.block_k=256 or shorter"),
])
def test_a_prefill_chunk_the_mesh_cannot_split_is_an_error_before_compiling(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)
