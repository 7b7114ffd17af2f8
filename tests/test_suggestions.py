"""A suggestion is a value that passes: every refusal of the config (`jaxlong.config.validate`), of a recipe's stages
(`jaxlong.recipes.recipe.expand`) and of the evaluation's flags (`jaxlong.evaluation.checkpoint.check_flags`) that
suggests settings suggests ones the whole validation accepts with the rest unchanged. Random configs across
meshes, model shapes and options (seeded, a fixed number of draws), then the cases users met. Nothing compiles:
validation is arithmetic on the config."""

from __future__ import annotations

import copy
import random
import re
from pathlib import Path

import pytest
import yaml

from jaxlong.config import Config, ConfigError, changed_keys, load_config, refusal, validate, with_settings

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "recipes" / "tiny_extension.yaml"

# option -> the values a draw picks from: valid ones, and ones that break a rule alone or together
OPTIONS = {
    "mesh.num_devices": [1, 2, 4, 6, 8, 8, 12, 16],
    "mesh.data": [1, 1, 2, -1],
    "mesh.fsdp": [-1, -1, 1, 2, 3, 4],
    "mesh.ring": [1, 1, 2, 4],
    "mesh.context": [1, 2, 3, 4, 4, 8, -1],
    "model.heads": [4, 6, 8, 12, 16, 32],
    "model.kv_heads": [1, 2, 3, 4, 8],
    "model.head_dim": [16, 48, 64, 128],
    "model.layers": [1, 2, 4, 6],
    "seq_len": [64, 256, 1000, 1024, 4096, 4098, 4100, 8192, 12288, 4194304, 0],
    "global_batch": [1, 2, 3, 4, 6, 8, 16],
    "grad_accum": [1, 1, 2, 3, 4],
    "attention.impl": ["ulysses", "upipe"],
    "attention.heads_per_stage": [0, 0, 1, 2, 4, 8, 12, -1],
    "attention.block_q": [16, 48, 64, 100, 256, 1024, 0],
    "attention.block_k": [16, 64, 96, 256, 512],
    "attention.backend": ["auto", "auto", "blockwise", "cudnn", "pallas"],
    "compute_dtype": ["float32", "bfloat16"],
    "data.packing": ["documents", "concat"],
    "tiling.loss_tile": [0, 0, 3, 16, 64, 512],
    "tiling.mlp_tiles": [0, 0, 2, 3, 8],
    "remat.policy": ["none", "full", "offload"],
    "remat.offload_every": [1, 1, 2, 4, 8],
    "remat.keep_attention": [0, 0, 1, 4, 8],
}


def _draw(rng: random.Random, share: float = 0.4) -> dict:
    """Settings of a random share of `OPTIONS`, in a random order (the order a user typed them)."""
    keys = [k for k in OPTIONS if rng.random() < share]
    rng.shuffle(keys)
    return {k: rng.choice(OPTIONS[k]) for k in keys}


def _assert_one_line_naming(e: ConfigError) -> None:
    text = str(e)
    assert "\n" not in text, text
    if e.key is not None and e.key != "mesh.num_devices":  # the mesh's rules name the device count in words
        assert e.key.split("].")[-1] in text and str(e.value) in text, text


def _passes(cfg: Config, platform: str | None) -> ConfigError | None:
    try:
        validate(cfg, platform=platform)
    except ConfigError as e:
        return e
    return None


def test_every_suggestion_of_a_random_config_passes_validation():
    """Draws over meshes, model shapes and options (the drawn options are the user's, `changed`), each validated
    for an unknown platform, the CPU or a GPU (where `attention.backend=auto` may run the Pallas or cuDNN kernel
    and their size limits apply): each suggestion of each refusal, applied, passes `validate`."""
    rng = random.Random(20240607)
    refused, advised, together = 0, 0, 0
    for _ in range(300):
        settings = _draw(rng)
        platform = rng.choice([None, "cpu", "gpu"])
        cfg = with_settings(Config(), settings)
        try:
            validate(cfg, platform=platform, changed=changed_keys(settings))
            continue
        except ConfigError as e:
            error = e
        refused += 1
        _assert_one_line_naming(error)
        advised += bool(error.suggestions)
        together += any(len(s) > 1 for s in error.suggestions)
        for s in error.suggestions:
            left = _passes(with_settings(cfg, s), platform)
            assert left is None, f"{settings} on {platform}: {error} -> {s} -> {left}"
        preferred = [k for k in changed_keys(settings) if k in (error.key, *error.keys) and k != "mesh.num_devices"]
        single = {k for s in error.suggestions if len(s) == 1 for k in s}
        if preferred and single:  # the option the user set gets the advice when a value of it passes
            assert single <= set(preferred) or not any(
                _passes(with_settings(cfg, {preferred[0]: v}), platform) is None
                for v in OPTIONS.get(preferred[0], [])), (settings, str(error))
    assert refused > 150 and advised > 100 and together > 0, (refused, advised, together)


def _set_in_stage(cfg: Config, key: str, value) -> None:
    """Apply a recipe suggestion `stages[i].KEY = value` to the recipe `cfg`."""
    i, rest = re.fullmatch(r"stages\[(\d+)\]\.(.+)", key).groups()
    cfg.stages[int(i)][rest] = value


def test_every_suggestion_of_a_recipe_stage_passes():
    """The tiny recipe with one stage's keys drawn: a refused stage's suggestions, set in that stage, make the
    whole recipe expand."""
    from jaxlong.recipes import expand

    base = load_config(RECIPE)
    rng = random.Random(7)
    advised = 0
    for _ in range(60):
        cfg = copy.deepcopy(base)
        stage = rng.randrange(len(cfg.stages))
        cfg.stages[stage].update({k: rng.choice(OPTIONS[k]) for k in
                                  rng.sample(["seq_len", "attention.block_q", "global_batch", "mesh.context",
                                              "grad_accum", "tiling.mlp_tiles"], 2)})
        try:
            expand(cfg)
            continue
        except ConfigError as e:
            error = e
        assert not error.errors and error.key.startswith(f"stages[{stage}].") and "\n" not in str(error), error
        assert str(error).startswith(f"stage {stage} ("), error
        advised += bool(error.suggestions)
        for s in error.suggestions:
            fixed = copy.deepcopy(cfg)
            for key, value in s.items():
                _set_in_stage(fixed, key, value)
            expand(fixed)  # raises if the suggestion does not pass
    assert advised > 15, advised


def test_every_suggestion_of_the_eval_flags_passes(tmp_path):
    """`python -m jaxlong.eval`'s flags checked against random valid runs' configs: a refused length or count is
    followed by lengths or counts that pass, put in its place."""
    from jaxlong.eval.__main__ import parse_args
    from jaxlong.evaluation.checkpoint import check_flags

    rng = random.Random(11)
    flags_of = {"--lengths": "lengths", "--ruler-lengths": "ruler_lengths", "--batches": "batches",
                "--per-cell": "per_cell", "--ruler-cases": "ruler_cases", "--digits": "digits"}
    advised, runs = 0, 0
    while runs < 40:
        settings = _draw(rng, share=0.3)
        settings["seq_len"] = rng.choice([1024, 4096, 8192])
        cfg = with_settings(Config(), settings)
        if refusal(cfg) is not None:
            continue
        runs += 1
        flag = rng.choice(list(flags_of))
        value = rng.choice([0, 63, 100, 1000, 1024, 2050, 4000]) if "lengths" in flag else rng.choice([0, -1, 3])
        argv = [str(tmp_path), "--ruler", f"{flag}={value}"]
        try:
            check_flags(cfg, parse_args(argv))
            continue
        except ConfigError as e:
            error = e
        assert error.key == flag and "\n" not in str(error), error
        advised += bool(error.suggestions)
        for s in error.suggestions:
            check_flags(cfg, parse_args([str(tmp_path), "--ruler", f"{flag}={s[flag]}"]))
    assert advised > 10, advised


def test_the_recipe_users_last_stage_of_4098_tokens_gets_lengths_that_pass():
    """The report: the tiny recipe's last stage at 4098 tokens, then 4100. Both get the nearest lengths every rule
    takes (the stage set seq_len), not a multiple of mesh.context nor a divisor of the attention block."""
    from jaxlong.recipes import expand

    for bad in (4098, 4100):
        cfg = load_config(RECIPE)
        cfg.stages[2]["seq_len"] = bad
        with pytest.raises(ConfigError) as info:
            expand(cfg)
        assert str(info.value).startswith("stage 2 (4k): ") and str(info.value).endswith("; use seq_len=4096 or 4352")
        assert info.value.suggestions == ({"stages[2].seq_len": 4096}, {"stages[2].seq_len": 4352})
        for s in info.value.suggestions:
            fixed = copy.deepcopy(cfg)
            _set_in_stage(fixed, *next(iter(s.items())))
            expand(fixed)


def test_a_recipes_base_config_is_not_judged_alone(tmp_path):
    """Every stage of the tiny recipe sets its seq_len, so a top-level seq_len no stage uses is not refused (no run
    uses the base config alone); a stage that inherits a bad one is refused with the stage's name."""
    from jaxlong.recipes import expand

    data = yaml.safe_load(RECIPE.read_text())
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({**data, "seq_len": 1000}))
    assert len(expand(load_config(path))) == 3
    data["stages"][0].pop("seq_len")
    path.write_text(yaml.safe_dump({**data, "seq_len": 1000}))
    with pytest.raises(ConfigError, match=r"^stage 0 \(.*\): .*seq_len=1000"):
        expand(load_config(path))


def test_a_block_the_user_set_gets_blocks_and_a_length_gets_lengths():
    with pytest.raises(ConfigError, match=r"use attention.block_q=64 or 128$"):
        load_config(None, ["attention.block_q=100"])
    with pytest.raises(ConfigError, match=r"attention.block_q=256 must divide seq_len=4100 .*use seq_len=4096 or "
                                          r"4352$"):
        load_config(None, ["seq_len=4100"])


def test_six_devices_on_the_default_config_name_the_options_to_change_together():
    """No single option fits the default config to 6 devices (the device count is the hardware's, never
    suggested): context 4 does not divide 6, and a context that does leaves FSDP a degree the batch of 2 cannot
    be split over."""
    with pytest.raises(ConfigError) as info:
        load_config(None, ["mesh.num_devices=6"])
    e = info.value
    assert "no single option fixes it: change mesh.context=2 and global_batch=3 together" in str(e), e
    assert e.suggestions and all(len(s) == 2 and "mesh.num_devices" not in s for s in e.suggestions)
    for s in e.suggestions:
        validate(with_settings(load_config(None, []), {"mesh.num_devices": 6, **s}))


def test_the_gpu_kernels_size_limit_is_a_validation_rule_where_the_platform_is_known():
    """The Pallas kernel's int32 offsets (checked while tracing) are checked by `validate` where the kernel runs:
    `attention.backend=auto` with packed documents in bfloat16 on GPUs. Llama-3.1-8B at 4M tokens over 8-way
    Ulysses gives it 4 heads of 4M tokens: past the limit; U-Pipe with one head per device per stage is not."""
    cfg = load_config(ROOT / "configs" / "llama3_1_8b.yaml", ["seq_len=4194304", "data.packing=documents"])
    validate(cfg)  # the platform unknown: auto's kernel is not known
    validate(cfg, platform="cpu")  # the blockwise kernel
    with pytest.raises(ConfigError, match=r"attention.backend=auto runs the pallas kernel on q of \[1, 4194304, 4, "
                                          r"128\] .*; use attention.backend=blockwise") as info:
        validate(cfg, platform="gpu")
    for s in info.value.suggestions:
        validate(with_settings(cfg, s), platform="gpu")
    validate(with_settings(cfg, {"attention.impl": "upipe", "attention.heads_per_stage": 8}), platform="gpu")


def test_two_problems_get_their_own_advice_and_the_objective_is_never_suggested(tmp_path):
    """DPO on text data with a model whose 9 heads the default context of 4 does not divide (a model the file
    gives): the data problem keeps its own advice, the heads problem follows with its own, and no advice tells the
    user to train another objective."""
    (tmp_path / "m.yaml").write_text(yaml.safe_dump({"model": {"heads": 9, "kv_heads": 3, "head_dim": 16}}))
    with pytest.raises(ConfigError) as e:
        load_config(str(tmp_path / "m.yaml"), ["objective=dpo"])
    first, _, second = str(e.value).partition("; also, ")
    assert first.startswith("objective=dpo trains on preference pairs: set data.format=preference")
    assert second.startswith("model.heads=9 is not divisible by mesh.context=4") and "mesh.context=1" in second
    assert "objective=lm" not in str(e.value) and e.value.key == "objective"
