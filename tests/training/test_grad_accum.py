"""Gradient accumulation: N micro-batches in a scan give the update of one batch N times larger."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_close, mesh_for, random_batch, tiered, tiny_cfg

from jaxlong.config import ConfigError
from jaxlong.core.batch import put_batch
from jaxlong.layers.loss import IGNORE_INDEX
from jaxlong.config import runtime
from jaxlong.models.llama import model_graphdef
from jaxlong.training import step as step_lib
from jaxlong.objectives.lm import LanguageModeling
from jaxlong.training.accumulate import loss_and_grads


def _uneven_batch(cfg):
    """Micro-batch j holds rows j, j + N, ...: give rows 1 and 3 (micro-batch 1 of 2) far fewer valid tokens.
    Row 3's are left out as Hugging Face labels leave them out: target -100 with mask 1."""
    batch = random_batch(cfg, seed=3)
    batch["mask"][1, : cfg.seq_len - 5] = 0.0
    batch["targets"][3, 4:] = IGNORE_INDEX
    return batch


def _loss_grads_update(cfg, batch):
    mesh = mesh_for(cfg, 8)
    graphdef, rt = model_graphdef(cfg.model, cfg.param_dtype), runtime(cfg, mesh)
    b = put_batch(batch, mesh)
    state = step_lib.init_state(cfg, mesh)
    loss, grads = jax.jit(
        lambda p, x: loss_and_grads(LanguageModeling(), p, x, cfg.grad_accum, graphdef, rt)[:2]
    )(state["params"], b)
    grads = jax.tree.map(np.asarray, grads)
    new_state, metrics = step_lib.make_train_step(cfg, mesh)(state, b)
    return float(loss), grads, jax.tree.map(np.asarray, new_state["params"]), float(metrics["loss"])


# The fast tier's accumulation: the SFT and DPO equalities on two micro-batches (tests/data/test_chat_data.py,
# tests/training/test_dpo.py) and the toy objective below; the slow tier, one big batch against two here.
@pytest.mark.parametrize(*tiered("extra", [(), ("tiling.loss=true", "tiling.loss_tile=8")], ids=["dense_loss", "tiled_loss"],
                                 fast=set()))
def test_two_micro_batches_equal_one_double_batch(extra):
    # Adam's first update is g / (|g| + eps) ~ sign(g): for entries with |g| near 1e-8 it amplifies float32
    # rounding of the gradient sum into O(lr) differences, whatever the accumulation. eps=1e-4 keeps the
    # update a smooth function of g, so the comparison checks the accumulation, not Adam's conditioning.
    base = ("mesh.fsdp=2", "mesh.context=4", "global_batch=4", "optim.warmup_steps=0", "optim.eps=1e-4", *extra)
    one = tiny_cfg(*base, "grad_accum=1")
    two = tiny_cfg(*base, "grad_accum=2")
    batch = _uneven_batch(one)
    valid = batch["mask"] * (batch["targets"] != IGNORE_INDEX)
    counts = valid.reshape(2, 2, -1).sum(axis=(0, 2))  # rows (0, 2) and (1, 3)
    assert counts[0] > 3 * counts[1]  # the micro-batches hold very different numbers of valid tokens
    loss1, grads1, params1, step_loss1 = _loss_grads_update(one, batch)
    loss2, grads2, params2, step_loss2 = _loss_grads_update(two, batch)
    np.testing.assert_allclose(loss2, loss1, rtol=1e-5)
    np.testing.assert_allclose(step_loss2, step_loss1, rtol=1e-5)
    assert_trees_close(grads2, grads1, rtol=1e-5, atol=1e-8)
    assert_trees_close(params2, params1, rtol=1e-5, atol=1e-7)


def test_grad_accum_that_does_not_divide_the_batch_is_a_config_error():
    with pytest.raises(ConfigError, match=r"grad_accum=3: global_batch=4 must be divisible"):
        tiny_cfg("mesh.fsdp=2", "mesh.context=4", "global_batch=4", "grad_accum=3")
    with pytest.raises(ConfigError, match="grad_accum=0 must be positive"):
        tiny_cfg("grad_accum=0")


class _Weighted:
    """A toy objective without a model: the loss of a token is `w * x`, the denominator the count of `mask`."""

    normalize, batch_keys = "batch", {}

    def __init__(self, normalize):
        self.normalize = normalize

    def denominator(self, batch, mesh):
        return jnp.sum(batch["mask"])

    def sum_shapes(self):
        return {}

    def sums(self, params, batch, graphdef, rt):
        return jnp.sum(params["w"] * batch["x"] * batch["mask"]), {}

    def metrics(self, sums, denominator, batch):
        return {}


def test_one_accumulator_normalises_over_the_batch_or_per_micro_batch():
    """`normalize="batch"` (TRL's dapo): the sums of every micro-batch over the whole batch's count, equal to one
    batch; `"micro"` (bnpo, grpo): each micro-batch's mean, averaged. Micro-batch j holds rows j, j + n, ..."""
    from types import SimpleNamespace

    mesh = mesh_for(tiny_cfg("mesh.fsdp=1", "mesh.context=1", "mesh.num_devices=1"), 1)
    x = np.arange(1.0, 17.0, dtype=np.float32).reshape(4, 4)
    mask = np.array([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], np.float32)
    batch, params, rt = {"x": x, "mask": mask}, {"w": jnp.float32(2.0)}, SimpleNamespace(mesh=mesh)
    whole = float((x * mask).sum() * 2 / mask.sum())
    for n in (1, 2):
        loss, grads, _ = loss_and_grads(_Weighted("batch"), params, batch, n, None, rt)
        np.testing.assert_allclose(float(loss), whole, rtol=1e-6)
        np.testing.assert_allclose(float(grads["w"]), whole / 2, rtol=1e-6)
    loss, grads, _ = loss_and_grads(_Weighted("micro"), params, batch, 2, None, rt)
    means = [(x[j::2] * mask[j::2]).sum() * 2 / mask[j::2].sum() for j in (0, 1)]  # rows (0, 2) and (1, 3)
    np.testing.assert_allclose(float(loss), np.mean(means), rtol=1e-6)
    np.testing.assert_allclose(float(grads["w"]), np.mean(means) / 2, rtol=1e-6)
