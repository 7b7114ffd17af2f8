"""DPO, IPO and SimPO on preference pairs (`jaxlong.data.preference`, `jaxlong.training.preference`): pairs packed two
segments each, the loss and TRL's metrics on a context-parallel mesh with gradient accumulation equal to a plain
implementation of TRL's formulas on each half alone on one device with a frozen reference copy, forward and
gradients; the precomputed reference equal to that frozen copy; bad pairs refused by file, line and field."""

import json
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from helpers import TINY, assert_trees_close, mesh_for, reference_cfg, tiered, tiny_cfg

from jaxlong.config import runtime
from jaxlong import data as data_lib
from jaxlong.config import ConfigError, objective_of
from jaxlong.core.batch import put_batch
from jaxlong.data.chat import ChatTemplate
from jaxlong.data.pipeline import PAIR_FEATURE
from jaxlong.data.preference import PreferenceSource
from jaxlong.data.tokenizer import ByteTokenizer
from jaxlong.models import llama
from jaxlong.recipes.gates import parse_gate
from jaxlong.training import step as step_lib
from jaxlong.objectives.base import Preparation
from jaxlong.objectives.dpo import PreferenceOptimization
from jaxlong.objectives.reference import compute_reference, half_ids
from jaxlong.training.accumulate import loss_and_grads

sys.path.insert(0, str(Path(__file__).parent))
from test_recipe import _final_params, _ok, _scalars, _train  # noqa: E402  (the recipe tests' runner)

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
PAIRS = [
    {"prompt": [{"role": "user", "content": "2+2?"}], "chosen": [{"role": "assistant", "content": "4"}],
     "rejected": [{"role": "assistant", "content": "five, I think"}]},
    {"chosen": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a colour?"},
                {"role": "assistant", "content": "teal"}],
     "rejected": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a colour?"},
                  {"role": "assistant", "content": "a dog"}]},
    {"prompt": "The sky is", "chosen": " blue.", "rejected": " made of cheese, which is a long answer."},
]


def _files(tmp_path, records=PAIRS):
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "t.jinja").write_text(CHATML)
    return tmp_path / "pairs.jsonl", tmp_path / "t.jinja"


def _dpo_cfg(tmp_path, *extra):
    path, tpl = _files(tmp_path, PAIRS * 4)
    return tiny_cfg("model.vocab_size=257", f"data.path={path}", "data.format=preference", "objective=dpo",
                    f"data.chat_template={tpl}", "eval_every=0", *extra)


MESHES = {  # mesh, loss: fast Ulysses x ring, FSDP, two micro-batches; slow U-Pipe x ring, tiled loss; one device;
    # each pair's prompt once (data.shared_prompt) under U-Pipe x ring
    "ulysses-ring-fsdp-accum2-sigmoid": ("mesh.fsdp=2", "mesh.ring=2", "mesh.context=2", "grad_accum=2"),
    "shared-upipe-ring-tiled-simpo": ("mesh.fsdp=1", "mesh.ring=2", "mesh.context=4", "attention.impl=upipe",
                                      "attention.heads_per_stage=4", "tiling.loss=true", "tiling.loss_tile=16",
                                      "dpo.loss=simpo", "data.shared_prompt=true"),
    "upipe-ring-tiled-ipo": ("mesh.fsdp=1", "mesh.ring=2", "mesh.context=4", "attention.impl=upipe",
                             "attention.heads_per_stage=4", "tiling.loss=true", "tiling.loss_tile=16", "dpo.loss=ipo"),
    "one-device-accum2-simpo": ("mesh.num_devices=1", "mesh.fsdp=1", "mesh.context=1", "grad_accum=2",
                                "dpo.loss=simpo"),
}


def _trl_loss(pc, pr, rc, rr, nc, nr, dpo):
    """TRL's DPOTrainer.dpo_loss (sigmoid, ipo) and CPOTrainer's simpo, written out as they define them."""
    if dpo.loss in ("ipo", "simpo"):
        pc, pr, rc, rr = pc / nc, pr / nr, rc / nc, rr / nr
    if dpo.loss == "simpo":
        logits = pc - pr
        losses = -jax.nn.log_sigmoid(dpo.beta * (logits - dpo.simpo_gamma / dpo.beta))
        chosen, rejected = dpo.beta * pc, dpo.beta * pr
    else:
        logits = (pc - pr) - (rc - rr)
        losses = -jax.nn.log_sigmoid(dpo.beta * logits) if dpo.loss == "sigmoid" else (logits - 1 / (2 * dpo.beta)) ** 2
        chosen, rejected = dpo.beta * (pc - rc), dpo.beta * (pr - rr)
    return losses.mean(), {"rewards/chosen": chosen.mean(), "rewards/rejected": rejected.mean(),
                           "rewards/accuracies": (chosen > rejected).astype(jnp.float32).mean(),
                           "rewards/margins": (chosen - rejected).mean(), "logps/chosen": pc.mean(),
                           "logps/rejected": pr.mean()}


@pytest.mark.parametrize(*tiered("mesh", list(MESHES), fast={"ulysses-ring-fsdp-accum2-sigmoid"}, ids=list(MESHES)))
def test_dpo_on_a_context_parallel_mesh_equals_trl_on_each_half_alone(tmp_path, mesh):
    """Packed pairs on the mesh, the reference precomputed, against TRL's formulas on each half alone on one
    device (positions from 0, no packing) with a frozen reference copy: the loss, every gradient, the metrics, and
    the precomputed reference log-probs against the frozen copy's."""
    cfg = _dpo_cfg(tmp_path, "global_batch=4", "seq_len=256", "attention.block_q=16", "attention.block_k=16",
                   "dpo.beta=0.5", *MESHES[mesh])
    tok = ByteTokenizer()
    source = data_lib.first_source(cfg, tok)
    mesh = mesh_for(cfg, cfg.mesh.num_devices)
    params = step_lib.init_state(cfg, mesh)["params"]
    frozen = llama.init_params(cfg.model, mesh, 7, cfg.param_dtype)  # the reference: other weights than the policy's
    rt, graphdef = runtime(cfg, mesh), llama.model_graphdef(cfg.model, cfg.param_dtype)
    source.reference = compute_reference(Preparation(cfg, tmp_path, source, tok, graphdef, rt, None, None), frozen)
    batch = next(data_lib.batch_iterator(cfg, tok, source=source))
    pair_ids = batch.pop(PAIR_FEATURE)

    def step(p, b):
        return loss_and_grads(PreferenceOptimization(cfg.dpo), p, b, cfg.grad_accum, graphdef, rt)

    loss, grads, metrics = jax.jit(step)(params, put_batch(batch, mesh))

    ref = reference_cfg(cfg)
    ref_mesh = mesh_for(ref, 1)
    like = step_lib.init_state(ref, ref_mesh)["params"]
    on_one = lambda tree: jax.tree.map(lambda h, p: jax.device_put(np.asarray(h), p.sharding), tree, like)  # noqa: E731
    ref_rt, ref_graphdef = runtime(ref, ref_mesh), llama.model_graphdef(ref.model, ref.param_dtype)

    pairs = []  # the batch's pairs in order, a pair packed twice counted twice
    for row in range(cfg.global_batch):
        k = (np.where(batch["mask"][row] > 0, np.asarray(half_ids(batch["segment_ids"][row])), 0) + 1) // 2
        pairs += [int(pair_ids[row][np.argmax(k == j)]) - 1 for j in np.unique(k[k > 0])]
    rows = [(h.tokens[:-1], h.tokens[1:], h.trained[1:]) for i in pairs for h in (source[i].chosen, source[i].rejected)]
    halves = {k: [np.pad(r[j], (0, cfg.seq_len - r[j].size)) for r in rows] for j, k in enumerate(("inputs", "targets",
                                                                                                      "mask"))}
    n = len(pairs)
    x, t, m = (np.stack(halves[k]).astype(np.float32 if k == "mask" else np.int32) for k in halves)
    order = np.r_[0:2 * n:2, 1:2 * n:2]  # chosen halves first
    x, t, m = x[order], t[order], m[order]

    def logps(p):  # positions 0.. per row, no segment ids: nothing to leak between halves
        hidden, head = llama.forward(ref_graphdef, p, x, ref_rt)
        logits = jnp.einsum("bsh,hv->bsv", hidden, head)
        lp = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), t[..., None], -1)[..., 0]
        return jnp.sum(lp * m, axis=1)

    frozen_logps = jax.jit(logps)(on_one(frozen))
    rc, rr = frozen_logps[:n], frozen_logps[n:]
    nc, nr = m[:n].sum(1), m[n:].sum(1)

    def by_hand(p):
        lp = logps(p)
        return _trl_loss(lp[:n], lp[n:], rc, rr, nc, nr, cfg.dpo)

    (ref_loss, ref_metrics), ref_grads = jax.jit(jax.value_and_grad(by_hand, has_aux=True))(on_one(params))
    assert n > cfg.global_batch  # several pairs share a row
    np.testing.assert_allclose(source.reference[pairs], np.stack([rc, rr], 1), rtol=1e-5)  # precomputed = frozen
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for k, v in ref_metrics.items():
        np.testing.assert_allclose(float(metrics[k]), float(v), rtol=1e-5, atol=1e-6, err_msg=k)
    assert_trees_close(jax.tree.map(np.asarray, grads), jax.tree.map(np.asarray, ref_grads), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("record, error", [
    ({"prompt": [{"role": "usr", "content": "a"}], "chosen": [{"role": "assistant", "content": "b"}],
      "rejected": [{"role": "assistant", "content": "c"}]}, r":1: prompt\[0\]: unknown role 'usr'"),
    ({"prompt": [{"role": "user", "content": "a"}], "chosen": [{"role": "user", "content": "b"}],
      "rejected": [{"role": "assistant", "content": "c"}]}, ":1: chosen has no assistant message"),
    ({"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
      "rejected": [{"role": "user", "content": "A"}, {"role": "assistant", "content": "c"}]},
     ":1: chosen and rejected have different prompts"),
    ({"prompt": "a", "chosen": "b", "rejected": "  "}, ":1: rejected is an empty response"),
    ({"prompt": [{"role": "user", "content": "a"}], "chosen": [{"role": "assistant", "content": ""}],
      "rejected": [{"role": "assistant", "content": "c"}]}, ":1: chosen is an empty response"),
    ({"prompt": "a", "chosen": "b"}, ":1: a preference record needs"),
])
def test_bad_pairs_are_named_by_file_line_and_field(tmp_path, record, error):
    path, tpl = _files(tmp_path, [record])
    with pytest.raises(ValueError, match=error):
        PreferenceSource(path, ByteTokenizer(), ChatTemplate(tmp_path, tpl), 256)


def test_pairs_need_a_template_fit_seq_len_and_the_dpo_objective(tmp_path):
    path, tpl = _files(tmp_path)
    with pytest.raises(ValueError, match=":1: a conversation needs a chat template"):
        PreferenceSource(path, ByteTokenizer(), None, 256)
    with pytest.raises(ValueError, match=":2: the pair takes 223 positions .* seq_len=200; a pair is never cut"):
        PreferenceSource(path, ByteTokenizer(), ChatTemplate(tmp_path, tpl), 200)
    kept = PreferenceSource(path, ByteTokenizer(), ChatTemplate(tmp_path, tpl), 200, too_long="drop")
    assert (len(kept), kept.dropped, kept.lengths.tolist()) == (2, 1, [142, 68])
    with pytest.raises(ConfigError, match="objective=dpo trains on preference pairs"):
        tiny_cfg("objective=dpo")
    with pytest.raises(ConfigError, match="data.format=preference is preference pairs, for objective=dpo"):
        tiny_cfg(f"data.path={path}", "data.format=preference")
    with pytest.raises(ConfigError, match="dpo.beta=0.0 must be positive"):
        tiny_cfg(f"data.path={path}", "data.format=preference", "objective=dpo", "dpo.beta=0")
    with pytest.raises(ConfigError, match="a threshold on dpo/rewards/accuracies, but the stage trains with "
                                          "objective=lm"):
        parse_gate({"min": {"dpo/rewards/accuracies": 0.6}}, tiny_cfg("eval_every=10"))
    dpo = tiny_cfg(f"data.path={path}", "data.format=preference", "objective=dpo", "eval_every=10")
    assert parse_gate({"min": {"dpo/rewards/accuracies": 0.6}, "max": {"dpo/loss": 0.7}}, dpo).metrics
    with pytest.raises(ConfigError, match=r"dpo.reference='[^']+': no \*.safetensors files"):
        bad = tiny_cfg(f"data.path={path}", "data.format=preference", "objective=dpo", f"dpo.reference={tmp_path}")
        objective_of(bad).check_files(bad.model)
    assert objective_of(dpo).needs_reference and not objective_of(tiny_cfg(
        f"data.path={path}", "data.format=preference", "objective=dpo", "dpo.loss=simpo")).needs_reference


CHAT = [{"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]},
        {"messages": [{"role": "user", "content": "a colour?"}, {"role": "assistant", "content": "teal"}]}]


def _post_training_recipe(tmp_path):
    """Pretraining (2 steps on the embedded corpus), SFT (2 steps), then DPO (3 steps) with a gate on its held-out
    pairs, on FSDP 2 x Ulysses 4 at 256 tokens."""
    pairs, tpl = _files(tmp_path, PAIRS * 4)
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in CHAT * 6))
    stages = [{"name": "pretrain", "steps": 2},
              {"name": "sft", "steps": 2, "data": {"path": str(tmp_path / "chat.jsonl"), "format": "chat"}},
              {"name": "dpo", "steps": 3, "objective": "dpo", "dpo": {"beta": 0.5}, "optim": {"warmup_steps": 1},
               "data": {"path": str(pairs), "format": "preference"},
               "gate": {"max": {"dpo/loss": 5.0}, "batches": 1}}]
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"data": {"chat_template": str(tpl)}, "stages": stages}))
    return path


POST = [t for t in TINY if t not in ("seq_len=64", "model.vocab_size=128")] + [
    "seq_len=256", "model.vocab_size=257", "mesh.fsdp=2", "mesh.context=4", "optim.lr=1e-2", "eval_every=100",
    "eval_batches=1", "eval_fraction=0.2", "checkpoint_every=1", "keep_checkpoints=2", "run_name=post"]


@pytest.mark.slow
@pytest.mark.subprocess
def test_pretraining_sft_and_dpo_run_as_one_recipe_and_resume_exactly_after_a_kill(tmp_path):
    """`python -m jaxlong.train --config RECIPE` runs the three kinds of stage in one command: the DPO stage computes
    its reference from the SFT stage's final weights into RUN_DIR/reference/stage2.npz, logs TRL's metrics, and its
    gate judges the held-out pairs. Killed by SIGKILL inside the DPO stage, once its first checkpoints have rotated
    the stage's start weights away (`keep_checkpoints=2`), `--resume` reads the stored reference and ends with
    the parameters and losses of the uninterrupted run, bit for bit."""
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    recipe = _post_training_recipe(tmp_path)
    proc = _train("--config", str(recipe), *POST, f"run_dir={whole}")
    _ok(proc)
    assert "gate of stage 2 (dpo) passed" in proc.stdout + proc.stderr
    assert (whole / "post" / "reference" / "stage2.npz").is_file()
    accuracies = _scalars(whole / "post", "rewards/accuracies")
    assert sorted(accuracies) == [5, 6, 7] and _scalars(whole / "post", "loss")[5] == pytest.approx(np.log(2), 1e-5)
    proc = _train("--config", str(recipe), *POST, f"run_dir={killed}", fault="end_of_step@6:SIGKILL")
    assert proc.returncode == -9, proc.stderr[-3000:]
    proc = _train("--resume", "--config", str(recipe), *POST, f"run_dir={killed}")
    _ok(proc)
    out = proc.stdout + proc.stderr
    assert "reference log-probs of 12 pairs read from" in out and "reference log-probs of 12 pairs: one" not in out
    assert re.search(r"resumed from \S+/checkpoints/[56]\n", out)  # inside the DPO stage
    for tag in ("loss", "rewards/margins"):
        want, got = _scalars(whole / "post", tag), _scalars(killed / "post", tag)
        assert got[7] == want[7], tag
    for x, y in zip(jax.tree.leaves(_final_params(whole, recipe, POST, "post")),
                    jax.tree.leaves(_final_params(killed, recipe, POST, "post"))):
        np.testing.assert_array_equal(x, y)
