"""Bad input ends as a one-line error naming the option (CLI exit code 2), never a traceback or a wrong run;
the loss stays finite for any target at a masked position and ignores -100 targets, tiled and untiled."""

from __future__ import annotations

import re
import shlex

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tiny_cfg

from jaxlong.config import Config, ConfigError, load_config, to_dict
from jaxlong.layers.loss import IGNORE_INDEX, cross_entropy
from jaxlong.layers.tiled import tiled_cross_entropy
from jaxlong.train.__main__ import main
from jaxlong.training.checkpoint import config_changes
from jaxlong.optim.adamw import make_optimizer


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["mesh.num_devices=0"], "mesh.num_devices=0 must be a positive device count"),
        (["mesh.num_devices=-8"], "mesh.num_devices=-8 must be a positive device count"),
        (["optim.lr=-1"], "optim.lr=-1.0 must be positive"),
        (["optim.lr=0"], "optim.lr=0.0 must be positive"),
        (["optim.clip_norm=0"], "optim.clip_norm=0 must be a positive .* or null to disable clipping"),
        (["optim.clip_norm=-1"], "optim.clip_norm=-1 must be a positive"),
        (["optim.warmup_steps=-3"], "optim.warmup_steps=-3 must be >= 0"),
        (["optim.warmup_steps=10", "optim.decay_steps=5"], "optim.decay_steps=5 must be >= optim.warmup_steps=10"),
        (["optim.decay_steps=-1"], "optim.decay_steps=-1 must be >= optim.warmup_steps"),
        (["optim.min_lr_ratio=2"], "optim.min_lr_ratio=2.0 must be in \\[0, 1\\]"),
        (["optim.b2=1"], "optim.b2=1.0 must be in \\[0, 1\\)"),
        (["optim.eps=0"], "optim.eps=0.0 must be positive"),
        (["optim.weight_decay=-0.1"], "optim.weight_decay=-0.1 must be >= 0"),
        (["attention.block_q=0"], "attention.block_q=0 must be a positive tile length; use attention.block_q=256$"),
        (["attention.block_k=-16"], "attention.block_k=-16 must be a positive tile length"),
        (["seq_len=8192", "attention.block_q=48"], "attention.block_q=48 must divide seq_len=8192 .*; use seq_len=7680 or 8448$"),
        (["seq_len=192", "attention.block_k=128"], "attention.block_k=128 must divide seq_len=192 .*; use seq_len=128 or 256$"),
        (["attention.heads_per_stage=-4"], "attention.heads_per_stage=-4 must be >= 0"),
        (["profile_steps=0"], "profile_steps=0 must be positive"),
        (["model.norm_eps=0"], "model.norm_eps=0.0 must be positive"),
    ],
)
def test_out_of_range_options_are_refused_by_name(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_accepted_edge_values():
    cfg = load_config(None, ["optim.clip_norm=null", "optim.warmup_steps=0", "attention.block_q=100000",
                             "optim.decay_steps=5", "optim.warmup_steps=5"])
    assert cfg.optim.clip_norm is None and cfg.attention.block_q == 100000  # a block >= seq_len is clamped to it


def test_training_without_clipping_runs():

    c = tiny_cfg("optim.clip_norm=null")
    tx, _ = make_optimizer(c.optim, c.steps)
    grads = {"w": jnp.full((3,), 100.0)}
    updates, _ = tx.update(grads, tx.init(grads), {"w": jnp.zeros(3)})
    assert np.all(np.isfinite(np.asarray(updates["w"])))


def _cli(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--config", "/nonexistent/run.yaml"], "error: --config /nonexistent/run.yaml: no such file"),
        (["mesh.num_devices=0"], "error: mesh.num_devices=0 must be a positive device count"),
        (["mesh.num_devices=-8"], "error: mesh.num_devices=-8 must be a positive device count"),
        (["optim.lr=-1"], "error: optim.lr=-1.0 must be positive"),
        (["optim.clip_norm=0"], "error: optim.clip_norm=0 must be a positive"),
        (["optim.warmup_steps=-3"], "error: optim.warmup_steps=-3 must be >= 0"),
        (["attention.block_q=0"], "error: attention.block_q=0 must be a positive"),
    ],
)
def test_cli_errors_are_one_line_with_exit_code_2(capsys, argv, match):
    code, err = _cli(capsys, argv)
    assert code == 2 and err.startswith(match) and "\n" not in err, err


COMMAND_ERRORS = {  # command: [(argv, the message's start after "error: ")]
    "train": [(["--config", "/nonexistent/run.yaml"], "--config /nonexistent/run.yaml: no such file"),
              (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
              (["--resume", "run_dir={tmp}"], "--resume: no checkpoint found in")],
    "eval": [(["{tmp}/missing"], "{tmp}/missing: no checkpoint found"),
             (["{tmp}", "--step", "x"], "argument --step: invalid int value: 'x'")],
    "memory": [(["model.heads=3"], "model.heads=3 must be a multiple of model.kv_heads=2"),
               (["--fit", "--config", "/nonexistent/run.yaml"], "--config /nonexistent/run.yaml: no such file"),
               (["--budget"], "argument --budget: expected one argument")],
    "export": [(["{tmp}/missing", "--out", "{tmp}/hf"], "RUN_DIR {tmp}/missing: no checkpoint"),
               (["{tmp}"], "the following arguments are required: --out")],
}


@pytest.mark.parametrize("command, argv, start", [(c, a, m) for c, cases in COMMAND_ERRORS.items() for a, m in cases],
                         ids=[f"{c}-{i}" for c, cases in COMMAND_ERRORS.items() for i in range(len(cases))])
def test_every_command_reports_bad_input_in_one_form(command, argv, start, tmp_path, capsys):
    """`python -m jaxlong.train`, `.eval`, `.memory` and `.export`: bad input, the command's own checks and
    argparse's alike, is one line on stderr, `error: ...`, and exit code 2 (docs/reliability.md)."""
    import importlib

    main_of = importlib.import_module(f"jaxlong.{command}.__main__").main
    try:
        code = main_of([a.format(tmp=tmp_path) for a in argv])
    except SystemExit as e:  # argparse's errors exit
        code = e.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err, err
    assert err.startswith(f"error: {start.format(tmp=tmp_path)}"), err


def test_invalid_yaml_names_line_and_column(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  hidden: [64\n")
    code, err = _cli(capsys, ["--config", str(path)])
    assert code == 2 and "\n" not in err
    assert err.startswith(f"error: --config {path} is not valid YAML at line 3, column 1:"), err
    code, err = _cli(capsys, ["--config", str(tmp_path)])
    assert code == 2 and "is a directory" in err and "\n" not in err
    path.write_bytes(b"seq_len: 64\x00\n")  # a NUL byte: PyYAML's reader error has no line mark of its own
    code, err = _cli(capsys, ["--config", str(path)])
    assert code == 2 and "\n" not in err and "somewhere" not in err
    assert err.startswith(f"error: --config {path} is not valid YAML at line 1, column 12: character U+0000"), err


def test_cudnn_without_a_gpu_is_refused_before_loading_data(tmp_path, capsys, monkeypatch):
    from jaxlong import data as data_lib

    def no_data(*args, **kwargs):
        raise AssertionError("the corpus was loaded")

    monkeypatch.setattr(data_lib, "DocumentSource", no_data)
    code, err = _cli(capsys, ["attention.backend=cudnn", "data.packing=concat", "compute_dtype=bfloat16",
                              f"run_dir={tmp_path}"])
    assert code == 2 and "\n" not in err
    assert err.startswith("error: attention.backend=cudnn needs an NVIDIA GPU, but jax runs on cpu"), err


# ----------------------------------------------------------------------------------------------
# What a resume may change (the trainer-level checks are in test_faults.py).


def test_resume_config_changes_are_deny_by_default():
    defaults = to_dict(Config())
    old = to_dict(load_config(None, ["steps=30"]))
    new = to_dict(tiny_cfg("seed=1", "seq_len=128", "mesh.context=8", "remat.policy=full", "steps=60",
                           "run_name=x", "attention.block_q=64", "tiling.loss=true"))
    changes = config_changes(old, new, defaults)
    assert "seed: 0 -> 1" in changes and f"seq_len: {Config().seq_len} -> 128" in changes
    assert "model.hidden: 256 -> 64" in changes and "global_batch: 2 -> 2" not in changes
    assert not [c for c in changes if c.split(":")[0].split(".")[0] in
                ("mesh", "remat", "tiling", "attention", "steps", "run_name")]
    # steps=30 -> 60 with optim.decay_steps=0 stretches the cosine schedule: refused as its effective length
    assert "optim.decay_steps: 30 -> 60" in changes
    explicit = to_dict(load_config(None, ["steps=60", "optim.decay_steps=30"]))
    assert config_changes(old, explicit, defaults) == []


def _resume_advice(first: list[str], resume: list[str]) -> list[str] | None:
    """What the trainer's config check says to `--resume <resume>` of a checkpoint written by a run of `first`:
    None when it accepts the resume, else the overrides its refusal says to add (as a shell splits them)."""
    from jaxlong.training.resume import check_resume_config

    saved = to_dict(load_config(None, first))
    try:
        check_resume_config(load_config(None, [*first, *resume]), saved, step=4)
    except ConfigError as e:
        match = re.search(r"; add (.+?) to keep the checkpoint's schedule and train on", str(e))
        assert match and "\n" not in str(e), str(e)
        return shlex.split(match.group(1))
    return None


@pytest.mark.parametrize("first, resume, advice", [
    # A 4-step run under the default 5-step warmup has a 6-step schedule: steps=6 keeps it.
    (["steps=4"], ["steps=6"], None),
    (["steps=4"], ["steps=10"], ["optim.decay_steps=6"]),
    (["steps=20"], ["steps=30", "optim.warmup_steps=2"], ["optim.decay_steps=20", "optim.warmup_steps=5"]),
    (["steps=4"], ["steps=10", "data.packing=concat"], ["optim.decay_steps=6", "data.packing=documents"]),
    (["steps=20", "optim.decay_steps=20"], ["steps=30", "optim.decay_steps=0"], ["optim.decay_steps=20"]),
])
def test_resume_advice_is_a_command_that_resumes(first, resume, advice):
    """A refused `--resume steps=N` names the overrides that keep the checkpoint's schedule, and `--resume steps=N`
    with them passes validation and the resume check: the advice never loops (a suggested `optim.decay_steps`
    shorter than the warmup was refused by validation)."""
    assert _resume_advice(first, resume) == advice
    if advice is not None:
        assert _resume_advice(first, [*resume, *advice]) is None


def test_a_decay_shorter_than_the_warmup_is_refused_with_advice_that_resumes():
    """`--resume steps=6 optim.decay_steps=4` after a 4-step run under the 5-step warmup: validation refuses the
    decay, and either value it names (at least the warmup, or 0) resumes."""
    with pytest.raises(ConfigError, match=r"optim.decay_steps=4 must be >= optim.warmup_steps=5 .* or 0 for"):
        load_config(None, ["steps=6", "optim.decay_steps=4"])
    for value in (5, 0):
        assert _resume_advice(["steps=4"], ["steps=6", f"optim.decay_steps={value}"]) is None


def test_keys_unknown_to_an_old_checkpoint_compare_as_defaults_and_new_keys_are_denied():
    defaults = to_dict(Config())
    old = to_dict(Config())
    del old["data"]["packing"]  # a checkpoint written before data.packing existed
    new = to_dict(Config())  # the option at its default
    assert config_changes(old, new, defaults) == []
    new["data"]["packing"] = "concat"
    assert config_changes(old, new, defaults) == ['data.packing: "documents" -> "concat"']


# ----------------------------------------------------------------------------------------------
# The loss at masked positions.


def _loss_inputs(seed=0, b=2, s=32, h=16, v=64):
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.standard_normal((b, s, h)), jnp.float32)
    head = jnp.asarray(rng.standard_normal((h, v)) * 0.3, jnp.float32)
    targets = rng.integers(0, v, (b, s)).astype(np.int32)
    mask = (rng.random((b, s)) > 0.3).astype(np.float32)
    return hidden, head, targets, mask


def _both_losses(hidden, head, targets, mask):
    untiled = jax.value_and_grad(cross_entropy, argnums=(0, 1))(hidden, head, jnp.asarray(targets), jnp.asarray(mask))
    tiled = jax.value_and_grad(lambda x, w, t, m: tiled_cross_entropy(x, w, t, m, tile=8), argnums=(0, 1))(
        hidden, head, jnp.asarray(targets), jnp.asarray(mask))
    return untiled, tiled


@pytest.mark.parametrize("bad", [IGNORE_INDEX, -1, 64, 10**6])
def test_loss_is_finite_for_any_target_at_a_masked_position(bad):
    hidden, head, targets, mask = _loss_inputs()
    (ref, ref_g), _ = _both_losses(hidden, head, targets, mask)
    garbage = np.where(mask == 0, bad, targets).astype(np.int32)
    for loss, grads in _both_losses(hidden, head, garbage, mask):
        assert np.isfinite(float(loss))
        np.testing.assert_allclose(float(loss), float(ref), rtol=1e-6)
        for g, r in zip(grads, ref_g):
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-7)


def test_minus_100_targets_are_ignored_like_masked_positions():
    hidden, head, targets, mask = _loss_inputs(seed=3)
    hf_style = np.where(mask == 0, IGNORE_INDEX, targets).astype(np.int32)  # Hugging Face: -100, mask all ones
    (ref, ref_g), (ref_t, ref_tg) = _both_losses(hidden, head, targets, mask)
    (loss, grads), (loss_t, grads_t) = _both_losses(hidden, head, hf_style, np.ones_like(mask))
    np.testing.assert_allclose([float(loss), float(loss_t)], [float(ref), float(ref_t)], rtol=1e-6)
    for g, r in zip((*grads, *grads_t), (*ref_g, *ref_tg)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------------------------
# Checkpointer: labels from the state, failures reported, no temporary directory left.


def _tiny_state(step: int) -> dict:
    return {"step": jnp.asarray(step, jnp.int32), "w": jnp.arange(8.0)}


def test_checkpoint_label_is_the_state_step_and_leftovers_are_removed(tmp_path):
    from jaxlong.training.checkpoint import Checkpointer, committed_steps, saved_config

    (tmp_path / "5.orbax-checkpoint-tmp-1").mkdir(parents=True)  # left by a killed process
    ckpt = Checkpointer(tmp_path, every=2, keep=5, final_step=7)
    assert not list(tmp_path.glob("*orbax-checkpoint-tmp*"))
    assert ckpt.save(_tiny_state(3), {"seed": 0}) is None  # not due: neither every 2 nor the final step
    assert ckpt.save(_tiny_state(7), {"seed": 0}) == 7  # the final step
    assert ckpt.save(_tiny_state(3), {"seed": 0}, force=True) == 3
    ckpt.close()
    assert committed_steps(tmp_path) == [3, 7] and saved_config(tmp_path, 7) == {"seed": 0}


def test_a_failed_commit_is_reported_and_cleaned(tmp_path, monkeypatch):
    from jaxlong.training.checkpoint import Checkpointer, CheckpointError, committed_steps

    ckpt = Checkpointer(tmp_path, every=1, keep=5)
    ckpt.save(_tiny_state(1), {})
    ckpt.manager.wait_until_finished()
    (tmp_path / "2.orbax-checkpoint-tmp-9").mkdir()  # the background write of step 2 ...

    def fail():
        raise OSError(5, "Input/output error")  # ... fails

    ckpt.pending = 2
    monkeypatch.setattr(ckpt.manager, "wait_until_finished", fail)
    with pytest.raises(CheckpointError, match="could not commit step 2: OSError: .*Input/output error"):
        ckpt.wait()
    assert committed_steps(tmp_path) == [1] and not list(tmp_path.glob("*orbax-checkpoint-tmp*"))
