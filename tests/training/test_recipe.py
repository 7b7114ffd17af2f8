"""Context-extension recipes (`stages:`, jaxlong.training.recipe), run as a user runs them, `python -m
jaxlong.train --config RECIPE.yaml` in a child process: a three-stage miniature of the shipped recipe's shape
(64 -> 128 -> 256 tokens, RoPE theta raised at each stage, a mixture of short and long documents, long ones
upsampled in the last stage). Fast tier: the expansion into one validated config per stage and every stage's
errors in one line before anything compiles. Slow tier: the recipe end to end with its gates (one run in
TensorBoard, each stage's `seq_len`, its own warmup), the recipe equal to its stages typed by hand as
`--resume-with-changes` runs, and a kill (SIGTERM, SIGKILL) mid-stage or at a stage boundary resumes with
`--resume` to bit-equal final parameters."""
import json
import os
import subprocess
from types import SimpleNamespace
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml
from helpers import TINY
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from xla_flags import user_env

from jaxlong.config import ConfigError, load_config
from jaxlong.core.mesh import build_mesh
from jaxlong.training import step as step_lib
from jaxlong.training.checkpoint import Checkpointer
from jaxlong.training.loop import FAULT_ENV
from jaxlong.recipes import expand, stage_of_step

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [{"path": None, "name": "short", "weight": 0.4, "max_doc_tokens": 2048},
           {"path": None, "name": "long", "weight": 0.6, "min_doc_tokens": 2049}]
# The 8B recipe's shape (configs/recipes/llama3_1_8b_4m.yaml): a stage with Ulysses, full remat, kept attention
# and the tiled loss, then one with U-Pipe, grouped offload, kept attention and tiled loss and MLP.
STAGES = [
    {"name": "64", "steps": 2, "seq_len": 64},
    {"name": "128", "steps": 2, "seq_len": 128, "model.rope_theta": 100000.0,
     "remat": {"policy": "full", "keep_attention": 2}, "tiling": {"loss": True}},
    {"name": "256", "steps": 2, "seq_len": 256, "model": {"rope_theta": 500000.0}, "optim": {"warmup_steps": 1},
     "attention": {"impl": "upipe", "heads_per_stage": 4},
     "remat": {"policy": "offload", "offload_every": 2, "keep_attention": 1}, "tiling": {"loss": True, "mlp": True},
     "data": {"sources": [SOURCES[0], {**SOURCES[1], "upsample_long": 2}]}},
]
BASE = [t for t in TINY if not t.startswith("seq_len=")] + [
    "model.vocab_size=257", "mesh.fsdp=2", "mesh.context=4", "optim.lr=1e-2", "eval_every=0", "checkpoint_every=1",
    "keep_checkpoints=10", "run_name=recipe"]  # on the command line: every stage's (it wins over a stage's keys)


def _recipe(tmp_path: Path, stages=STAGES) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"data": {"sources": SOURCES}, "optim": {"warmup_steps": 2}, "stages": stages}))
    return path


def _train(*args: str, fault: str | None = None) -> subprocess.CompletedProcess:
    env = user_env(dict(os.environ), str(ROOT))
    if fault:
        env[FAULT_ENV] = fault
    return subprocess.run([sys.executable, "-m", "jaxlong.train", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)


def _train_here(capsys, *args: str) -> SimpleNamespace:
    """`python -m jaxlong.train ARGS` in this process (its compiled programs shared with the test's): the exit
    status, stdout and stderr, as `_train` gives them."""
    from jaxlong.train.__main__ import main  # noqa: PLC0415

    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=out, stderr=err)


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"


def _scalars(run: Path, tag: str) -> dict[int, float]:
    out = {}
    for f in sorted(run.glob("events.out.tfevents.*")):  # a killed process's file may hold no scalar
        ea = EventAccumulator(str(f)).Reload()
        if tag in ea.Tags()["scalars"]:
            out.update({e.step: e.value for e in ea.Scalars(tag)})
    return out


def _final_params(tmp_path: Path, recipe: Path, base: list[str] = BASE, name: str = "recipe") -> dict:
    stages = expand(load_config(recipe, [*base, f"run_dir={tmp_path}"]))
    cfg = stages[-1].cfg
    ckpt = Checkpointer(tmp_path / name / "checkpoints", every=1, keep=100)
    try:
        _, state = ckpt.restore(step_lib.abstract_state(cfg, build_mesh(cfg.mesh)), stages[-1].end)
    finally:
        ckpt.manager.close()
    return jax.tree.map(np.asarray, state)


def test_a_recipe_expands_into_one_validated_config_per_stage(tmp_path):
    stages = expand(load_config(_recipe(tmp_path), [*BASE, "optim.lr=2e-3"]), [*BASE, "optim.lr=2e-3"])
    assert [(s.name, s.start, s.end) for s in stages] == [("64", 0, 2), ("128", 2, 4), ("256", 4, 6)]
    c = [s.cfg for s in stages]
    assert [x.seq_len for x in c] == [64, 128, 256] and [x.steps for x in c] == [2, 4, 6]
    assert [x.model.rope_theta for x in c] == [load_config(None, BASE).model.rope_theta, 100000.0, 500000.0]
    assert [x.optim.schedule_start for x in c] == [0, 2, 4] and [x.stage for x in c] == [0, 1, 2]
    assert [x.optim.warmup_steps for x in c] == [2, 2, 1] and {x.optim.lr for x in c} == {2e-3}  # the command line wins
    assert [s.upsample_long for s in c[2].data.sources] == [1.0, 2.0] and not any(x.stages for x in c)
    assert stage_of_step(stages, 0) == 0 and stage_of_step(stages, 2) == 1 and stage_of_step(stages, 6) == 3


def test_every_bad_stage_is_named_in_one_line_before_anything_compiles(tmp_path):
    bad = [{"name": "a", "seq_len": 64},  # no steps
           {"name": "b", "steps": 2, "seq_len": 100},  # not a multiple of the attention block
           {"name": "c", "steps": 2, "modle.rope_theta": 1.0},  # an unknown key
           {"name": "d", "steps": 2, "data.sources": [{"path": None, "weight": 0}]}]
    with pytest.raises(ConfigError) as e:
        expand(load_config(_recipe(tmp_path, bad), BASE), BASE)
    msg = str(e.value)
    assert "\n" not in msg
    for stage in ("stage 0 (a): steps=None", "stage 1 (b): attention.block_q=16 must divide seq_len=100",
                  "stage 2 (c): unknown config key",
                  "stage 3 (d): data.sources[0].weight=0"):
        assert stage in msg, msg
    proc = _train("--config", str(_recipe(tmp_path, bad)), *BASE, f"run_dir={tmp_path}")
    assert proc.returncode == 2 and "compiled" not in proc.stdout
    assert len(proc.stderr.strip().splitlines()) == 1 and "stage 1 (b)" in proc.stderr


def test_what_a_recipe_sets_itself_and_a_later_stage_s_missing_corpus_are_refused_before_training(tmp_path):
    """`steps` outside the stages, and `stage` or `optim.schedule_start` in one, are refused (the recipe sets
    them); a corpus that a later stage names but that does not exist stops the recipe before its first stage
    trains, naming the stage and the source."""
    with pytest.raises(ConfigError, match="a recipe's stages set their own steps"):
        expand(load_config(_recipe(tmp_path), [*BASE, "steps=100"]), [*BASE, "steps=100"])
    with pytest.raises(ConfigError, match=r"stage 0 \(64\): stage is set by the recipe"):
        expand(load_config(_recipe(tmp_path, [{**STAGES[0], "stage": 3}, STAGES[1]]), BASE), BASE)
    missing = [STAGES[0], {**STAGES[1], "data": {"sources": [SOURCES[0], {"path": str(tmp_path / "gone.jsonl")}]}}]
    proc = _train("--config", str(_recipe(tmp_path, missing)), *BASE, f"run_dir={tmp_path}")
    assert proc.returncode == 2 and "done:" not in proc.stdout, proc.stdout[-2000:]
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: stage 1 (128): data.sources[1] (") \
        and "gone.jsonl" in err, err


def test_bad_gates_are_refused_in_one_line_before_anything_compiles(tmp_path):
    """A gate on a RULER task that does not exist, an unknown metric or action, an accuracy outside [0, 1], a
    length the stage's mesh cannot take, a threshold at a length the gate does not evaluate, a RULER length too
    short for its task's prompt (with the stage's tokenizer, before the first stage trains)."""
    def refused(gate: dict, match: str, stage: int = 1) -> None:
        stages = [dict(s) for s in STAGES]
        stages[stage]["gate"] = gate
        with pytest.raises(ConfigError, match=match) as e:
            expand(load_config(_recipe(tmp_path, stages), BASE), BASE)
        assert "\n" not in str(e.value) and f"stage {stage} ({STAGES[stage]['name']}): gate" in str(e.value)

    refused({"min": {"ruler/niah_single_9": 0.5}}, r"RULER has no task 'niah_single_9'; choose from niah_single_1")
    refused({"ruler_tasks": ["vt", "qa"]}, r"gate.ruler_tasks: unknown task\(s\) qa")
    refused({"max": {"los": 3.0}}, r"unknown metric 'los'; the metrics are loss, perplexity")
    refused({"min": {"passkey": 80}}, r"gate.min.passkey=80: passkey scores are accuracies in \[0, 1\]")
    refused({"max": {"loss": 3.0}, "action": "halt"}, r"gate.action='halt'; choose stop")
    refused({"passkey_lengths": [100]}, r"gate.passkey_lengths 100: not a sequence length this mesh takes .*; "
                                         r"nearby lengths it takes: 96 or 112")
    refused({"min": {"passkey/64": 0.5}}, r"a threshold on passkey/64 but the gate evaluates passkey at \[128\]")
    refused({"mni": {"loss": 1}}, r"gate: unknown key\(s\) mni")
    refused({"max": {"loss": 3.0}}, r"a threshold on loss needs documents held out from training, and the stage "
                                     r"has eval_every=0")
    stages = [dict(s) for s in STAGES]
    stages[2]["gate"] = {"min": {"ruler/niah_single_1": 0.5}}  # 256 tokens: too short for the task's prompt
    proc = _train("--config", str(_recipe(tmp_path, stages)), *BASE, f"run_dir={tmp_path}")
    assert proc.returncode == 2 and "compiled" not in proc.stdout, proc.stdout[-2000:]
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: stage 2 (256): gate.ruler_lengths 256: ruler task "
                                                         "niah_single_1: length 256 cannot hold its "
                                                         "template"), err


@pytest.mark.slow
def test_a_recipe_runs_its_stages_in_one_run_and_its_gates_decide(tmp_path, capsys):
    """One command runs the stages: one TensorBoard run with a global step, `seq_len` and `stage` per step, each
    stage warming up from its first step, every stage's checkpoint in one directory. Gates: stage 0's (held-out
    loss below 100) passes and the recipe goes on; stage 1's (passkey accuracy >= 0.5: a tiny model trained a few
    steps retrieves nothing) fails with `action: stop`: one line naming the gate, the metric and its value, exit
    status 3, stage 2 not started. The same recipe with that gate's action set to warn, `--resume`: the gate is
    decided from its record (no second evaluation), warns, and stage 2 runs, with a fresh optimizer state
    (`optim.reset_state`: AdamW's count restarts while the schedule's stays global)."""
    stages = [dict(s) for s in STAGES]
    stages[0]["gate"] = {"max": {"loss": 100.0}}
    stages[1]["gate"] = {"max": {"loss": 100.0}, "min": {"passkey": 0.5}, "per_cell": 2, "depths": [0, 1]}
    stages[2]["optim"] = {**stages[2]["optim"], "reset_state": True}
    base = [t.replace("eval_every=0", "eval_every=1000") for t in BASE]  # documents held out; validated at the ends
    proc = _train_here(capsys, "--config", str(_recipe(tmp_path, stages)), *base, f"run_dir={tmp_path}")
    run = tmp_path / "recipe"
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "gate of stage 0 (64) passed at step 2: loss " in proc.stdout
    err = proc.stderr.strip().splitlines()[-1]  # after the progress bars, one line
    assert proc.stderr.count("error:") == 1 and err.startswith("error: gate of stage 1 (128) failed at step 4: "
                                                               "passkey = 0 (needs >= 0.5); results in "), err
    assert "go on to stage 2 (256)" in err and "--resume" in err and "recipe: stage 2" not in proc.stdout
    assert Checkpointer.latest_in(run / "checkpoints") == 4
    summary = json.loads(next((run / "eval").glob("*/step_4/summary.json")).read_text())
    assert summary["passkey"]["mean"] == 0 and summary["passkey"]["lengths"] == [128]

    stages[1]["gate"]["action"] = "warn"
    proc = _train_here(capsys, "--resume", "--config", str(_recipe(tmp_path, stages)), *base, f"run_dir={tmp_path}")
    _ok(proc)
    assert "gate of stage 1 (128): decided from" in proc.stdout and "python -m jaxlong.eval" not in proc.stdout
    assert "warning: gate of stage 1 (128) failed at step 4: passkey = 0" in proc.stdout
    assert "optim.reset_state: a fresh optimizer state from step 4" in proc.stdout
    assert sorted(_scalars(run, "loss")) == [1, 2, 3, 4, 5, 6]
    assert _scalars(run, "seq_len") == {1: 64, 2: 64, 3: 128, 4: 128, 5: 256, 6: 256}
    assert _scalars(run, "stage") == {1: 0, 2: 0, 3: 1, 4: 1, 5: 2, 6: 2}
    lr = _scalars(run, "lr")
    assert lr[1] == 0 and lr[3] == 0 and lr[5] == 0 and lr[2] > 0 and lr[4] > 0  # each stage's warmup from 0
    assert {k for k in _scalars(run, "data/share/long")} == set(range(1, 7))
    assert Checkpointer.latest_in(run / "checkpoints") == 6
    cfg = expand(load_config(_recipe(tmp_path, stages), [*base, f"run_dir={tmp_path}"]))[2].cfg
    ckpt = Checkpointer(run / "checkpoints", every=1, keep=100)
    try:
        _, state = ckpt.restore(step_lib.abstract_state(cfg, build_mesh(cfg.mesh)), 5)
    finally:
        ckpt.manager.close()
    adam, _, schedule = state["opt_state"][1]
    assert int(adam.count) == 1 and int(schedule.count) == 5  # one step of a fresh AdamW, at global step 5


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Path:
    """The recipe run uninterrupted (the run directory holding run_name `recipe`)."""
    root = tmp_path_factory.mktemp("whole")
    _ok(_train("--config", str(_recipe(root)), *BASE, f"run_dir={root}"))
    return root


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_recipe_equals_its_stages_run_by_hand(tmp_path, whole):
    """The same stages typed by hand, each a `python -m jaxlong.train --resume-with-changes` run with the stage's
    keys (and the `steps`, `optim.schedule_start` and `stage` the recipe sets): the same losses, the same final
    parameters."""
    hand = tmp_path / "hand"
    sources = "data.sources=" + yaml.safe_dump(SOURCES, default_flow_style=True).strip()
    upsampled = "data.sources=" + yaml.safe_dump(STAGES[2]["data"]["sources"], default_flow_style=True).strip()
    _ok(_train(*BASE, f"run_dir={hand}", sources, "optim.warmup_steps=2", "seq_len=64", "steps=2"))
    _ok(_train("--resume-with-changes", *BASE, f"run_dir={hand}", sources, "optim.warmup_steps=2", "seq_len=128",
               "model.rope_theta=100000.0", "remat.policy=full", "remat.keep_attention=2", "tiling.loss=true",
               "steps=4", "optim.schedule_start=2", "stage=1"))
    _ok(_train("--resume-with-changes", *BASE, f"run_dir={hand}", upsampled, "seq_len=256",
               "model.rope_theta=500000.0", "optim.warmup_steps=1", "attention.impl=upipe",
               "attention.heads_per_stage=4", "remat.policy=offload", "remat.offload_every=2",
               "remat.keep_attention=1", "tiling.loss=true", "tiling.mlp=true", "steps=6", "optim.schedule_start=4",
               "stage=2"))
    a, b = _scalars(whole / "recipe", "loss"), _scalars(hand / "recipe", "loss")
    assert sorted(a) == sorted(b) == list(range(1, 7))
    np.testing.assert_allclose([a[s] for s in sorted(a)], [b[s] for s in sorted(b)], rtol=1e-6)
    recipe = _recipe(whole)
    for x, y in zip(jax.tree.leaves(_final_params(whole, recipe)), jax.tree.leaves(_final_params(hand, recipe))):
        np.testing.assert_array_equal(x, y)


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("fault, code", [("end_of_step@3:SIGTERM", 143), ("after_commit@4:SIGKILL", -9)],
                         ids=["sigterm-mid-stage", "sigkill-at-boundary"])
def test_a_killed_recipe_resumes_to_the_same_parameters(tmp_path, whole, fault, code):
    """Killed mid-stage (SIGTERM after step 3, inside the second stage: its checkpoint and data state) or at a
    stage boundary (SIGKILL right after the second stage's last checkpoint committed), `--resume` continues the
    stage of the latest checkpoint or starts the next one, and ends with the parameters of the uninterrupted run,
    bit for bit, and logs the same realised source shares. A SIGKILL mid-stage is the post-training recipe's
    (tests/training/test_dpo.py); each signal at each step of a run, tests/training/test_faults.py."""
    recipe = _recipe(tmp_path)
    proc = _train("--config", str(recipe), *BASE, f"run_dir={tmp_path}", fault=fault)
    assert proc.returncode == code, proc.stderr[-3000:]
    _ok(_train("--resume", "--config", str(recipe), *BASE, f"run_dir={tmp_path}"))
    for x, y in zip(jax.tree.leaves(_final_params(whole, recipe)), jax.tree.leaves(_final_params(tmp_path, recipe))):
        np.testing.assert_array_equal(x, y)
    for tag in ("loss", "data/share/long"):  # the realised shares count on from the checkpoint's data state
        want, got = _scalars(whole / "recipe", tag), _scalars(tmp_path / "recipe", tag)
        if code == -9:  # SIGKILL loses the TensorBoard events not yet flushed; the resumed steps are all there
            assert {5, 6} <= set(got) and got == {k: want[k] for k in got}, tag
        else:
            assert got == want, tag


def test_the_shipped_recipes_expand_and_the_8b_stages_use_their_fit_winners():
    """Every recipe in configs/recipes expands (validated, as the trainer would before compiling); each stage of
    the Llama-3.1-8B recipe uses the memory setup that `python -m jaxlong.memory --fit --target h100 --config
    configs/recipes/llama3_1_8b_4m.yaml` picked for it (GPU compile of the stage itself: its packed documents run
    the Pallas kernel), kept in experiments/results/recipe_fit_llama3.1-8b, within 79.1 GiB per device and 1.5 TiB
    of host per node."""
    import json  # noqa: PLC0415

    from jaxlong.plan.fit import configure  # noqa: PLC0415

    recipes = sorted((ROOT / "configs" / "recipes").glob("*.yaml"))
    assert len(recipes) >= 2
    for path in recipes:
        assert len(expand(load_config(path))) >= 2, path
    stages = expand(load_config(ROOT / "configs" / "recipes" / "llama3_1_8b_4m.yaml"))
    results = ROOT / "experiments" / "results" / "recipe_fit_llama3.1-8b"
    for stage in stages:
        found = json.loads((results / f"fit_llama3.1-8b_h100_{stage.cfg.seq_len}.json").read_text())
        assert found["winner"]["total"] <= found["budget"] < 80 * 2**30  # an H100 80GB: 79.1 GiB
        assert found["winner"]["host_per_node"] <= found["host_budget"] == 1.5 * 2**40
        want = configure(stage.cfg, found["winner"]["overrides"].split())
        for section in ("mesh", "attention", "remat", "tiling"):
            assert getattr(stage.cfg, section) == getattr(want, section), (stage.name, section)
