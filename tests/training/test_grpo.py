"""GRPO's loss (`jaxlong.objectives.grpo`) on shared-prefix rows under a context-parallel mesh with gradient
accumulation equals TRL's formulas written out by hand (trl v1.9.0 `GRPOTrainer._compute_loss`) on each prompt +
completion alone on one device, with TRL's micro-batches (`per_device_train_batch_size` = a micro-batch's
completions, `gradient_accumulation_steps` = `grad_accum`): the loss, every gradient and the metrics, for each
`loss_type`; and the advantages equal TRL's."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_close, mesh_for, reference_cfg, tiered, tiny_cfg

from jaxlong.config import runtime
from jaxlong.core.batch import put_batch
from jaxlong.data.groups import group_row
from jaxlong.models import llama
from jaxlong.objectives import grpo as G
from jaxlong.training import step as step_lib
from jaxlong.training.accumulate import loss_and_grads

SEQ, VOCAB, N_GEN = 64, 128, 3
# Per row, its groups: (prompt length, [completion lengths]); 4 rows, 2 micro-batches (rows 0, 2 and 1, 3).
ROWS = [[(7, [5, 3, 6])], [(5, [4, 6, 2]), (3, [2, 2, 1])], [(9, [3, 3, 3])], [(4, [6, 1, 5])]]
MAX_LEN = 6  # max_completion_length


def test_advantages_are_trls():
    """Group-relative advantages with unbiased standard deviations (torch's `std`), for each `scale_rewards`; the
    rewards summed over functions with their weights, a missing score left out."""
    r = np.array([1.0, 0.0, 0.5, 2.0, 2.0, 2.0])
    mean = np.repeat([0.5, 2.0], 3)
    std = np.repeat([0.5, 0.0], 3)  # unbiased: sqrt(((.5)^2 + (.5)^2 + 0) / 2)
    adv, s = G.group_advantages(r, 3, "group")
    np.testing.assert_allclose(s, std)
    np.testing.assert_allclose(adv, (r - mean) / (std + 1e-4))
    np.testing.assert_allclose(G.group_advantages(r, 3, "none")[0], r - mean)
    adv_b, s_b = G.group_advantages(r, 3, "batch")
    np.testing.assert_allclose(s_b, np.full(6, np.std(r, ddof=1)))
    np.testing.assert_allclose(adv_b, (r - mean) / (np.std(r, ddof=1) + 1e-4))
    scores = np.array([[1.0, np.nan], [0.0, 1.0], [np.nan, np.nan]])
    np.testing.assert_allclose(G.combine_rewards(scores, [2.0, 0.5]), [2.0, 0.5, np.nan])
    # an unscorable completion (NaN) is left out of its group's mean and deviation, and its advantage is 0
    adv_u, s_u = G.group_advantages(np.array([1.0, np.nan, 0.5]), 3)
    np.testing.assert_allclose(s_u, np.full(3, np.std([1.0, 0.5], ddof=1)))
    np.testing.assert_allclose(adv_u, [0.25 / (s_u[0] + 1e-4), 0.0, -0.25 / (s_u[0] + 1e-4)])
    with pytest.raises(ValueError, match="not whole groups"):
        G.group_advantages(r[:5], 3)


def _layout(seed=0):
    """The packed shared-prefix batch (without the per-token GRPO entries) and the separate rows: every prompt +
    completion alone, `[n, SEQ]`, with where each completion's targets sit in both."""
    rng = np.random.default_rng(seed)
    keys = ("inputs", "targets", "positions", "segment_ids")
    packed = {k: np.zeros((len(ROWS), SEQ), np.int32) for k in keys}
    packed["mask"] = np.zeros((len(ROWS), SEQ), np.float32)
    packed[G.COMPLETION] = np.zeros((len(ROWS), SEQ), np.int32)
    sep = {"inputs": np.zeros((0, SEQ), np.int32), "targets": np.zeros((0, SEQ), np.int32)}
    comps = []  # (row, [packed index of each target], separate row, first target index there, length)
    sep_rows = []
    for r, groups in enumerate(ROWS):
        at, number = 0, 0
        for doc, (p, lengths) in enumerate(groups, start=1):
            prompt = rng.integers(0, VOCAB, p)
            cs = [rng.integers(0, VOCAB, n) for n in lengths]
            g = group_row(prompt, cs, doc)
            n = g["inputs"].size
            for k in keys:
                packed[k][r, at:at + n] = g[k]
            packed["mask"][r, at:at + n] = g["completion"]
            for b, c in enumerate(cs, start=1):
                idx = at + np.flatnonzero(g["branch"] == b)
                number += 1
                packed[G.COMPLETION][r, idx] = number
                full = np.concatenate([prompt, c])
                sep_rows.append(full)
                comps.append((r, idx[:len(c)], len(sep_rows) - 1, p - 1, len(c)))
            at += n
    sep["inputs"] = np.stack([np.pad(x[:-1], (0, SEQ - x.size + 1)) for x in sep_rows]).astype(np.int32)
    sep["targets"] = np.stack([np.pad(x[1:], (0, SEQ - x.size + 1)) for x in sep_rows]).astype(np.int32)
    return packed, sep, comps


def _trl_loss(logps, old, ref, adv, mask, entropy, g: G.GRPOConfig, micro: list[np.ndarray]):
    """TRL's `_compute_loss` on padded `[completions, MAX_LEN]` tensors, summed over its micro-batches (`micro`:
    each one's completion indices) as gradient accumulation sums them; and its metrics over every token."""
    high = g.epsilon if g.epsilon_high is None else g.epsilon_high
    coef_1 = jnp.exp(logps - old)
    coef_2 = jnp.clip(coef_1, 1 - g.epsilon, 1 + high)
    per_token_loss = -jnp.minimum(coef_1 * adv[:, None], coef_2 * adv[:, None])
    kl = jnp.exp(ref - logps) - (ref - logps) - 1
    if g.beta:
        per_token_loss = per_token_loss + g.beta * kl
    total = 0.0
    for ix in micro:
        ptl, m = per_token_loss[ix], mask[ix]
        if g.loss_type == "grpo":
            loss = ((ptl * m).sum(-1) / jnp.maximum(m.sum(-1), 1.0)).mean() / len(micro)
        elif g.loss_type == "bnpo":
            loss = (ptl * m).sum() / jnp.maximum(m.sum(), 1.0) / len(micro)
        elif g.loss_type == "dr_grpo":
            loss = (ptl * m).sum() / (ptl.shape[0] * g.max_completion_length) / len(micro)
        else:  # dapo: num_items_in_batch, the counted tokens of the accumulated batch
            loss = (ptl * m).sum() / mask.sum()
        total = total + loss
    mean = lambda x: (x * mask).sum() / mask.sum()  # noqa: E731
    low = (coef_1 < 1 - g.epsilon) & (adv[:, None] < 0)
    high_c = (coef_1 > 1 + high) & (adv[:, None] > 0)
    metrics = {"entropy": mean(entropy), "clip_ratio/low_mean": mean(low), "clip_ratio/high_mean": mean(high_c),
               "clip_ratio/region_mean": mean(low | high_c)}
    if g.beta:
        metrics["kl"] = mean(kl)
    return total, metrics


CASES = {  # mesh and GRPO options: fast Ulysses x ring with FSDP, two micro-batches, TRL's defaults plus the KL
    "ulysses-ring-fsdp-accum2-dapo-kl": (("mesh.fsdp=2", "mesh.ring=2", "mesh.context=2", "grad_accum=2"),
                                         dict(beta=0.04, epsilon_high=0.28)),
    "upipe-ring-tiled-accum2-grpo": (("mesh.fsdp=1", "mesh.ring=2", "mesh.context=4", "attention.impl=upipe",
                                      "attention.heads_per_stage=4", "tiling.loss=true", "tiling.loss_tile=8",
                                      "grad_accum=2"), dict(loss_type="grpo", temperature=0.7)),
    "one-device-accum2-bnpo": (("mesh.num_devices=1", "mesh.fsdp=1", "mesh.context=1", "grad_accum=2"),
                               dict(loss_type="bnpo", beta=0.1)),
    "ulysses-c8-dr_grpo": (("mesh.fsdp=1", "mesh.context=8", "remat.policy=full"), dict(loss_type="dr_grpo")),
}


@functools.lru_cache(maxsize=None)
def _separate(temperature: float):
    """Per-token log-probs (float64 numpy, `[completions, MAX_LEN]`), entropies and parameters of the separate rows
    on one device (reference attention), and the function of the parameters that gives the log-probs."""
    cfg = tiny_cfg(f"seq_len={SEQ}", f"model.vocab_size={VOCAB}")
    ref = reference_cfg(cfg)
    packed, sep, comps = _layout()
    ref.global_batch, ref.data.packing = len(sep["inputs"]), "concat"
    mesh = mesh_for(ref, 1)
    params = step_lib.init_state(ref, mesh)["params"]
    rt, graphdef = runtime(ref, mesh), llama.model_graphdef(ref.model, ref.param_dtype)
    rows = jnp.asarray([c[2] for c in comps])[:, None]
    cols = jnp.asarray([[min(c[3] + t, SEQ - 1) for t in range(MAX_LEN)] for c in comps])

    def per_token(p):
        hidden, head = llama.forward(graphdef, p, sep["inputs"], rt)
        logits = jnp.einsum("bsh,hv->bsv", hidden, head) / temperature
        logp_all = jax.nn.log_softmax(logits, -1)
        lp = jnp.take_along_axis(logp_all, jnp.asarray(sep["targets"])[..., None], -1)[..., 0]
        ent = -jnp.sum(jnp.exp(logp_all) * logp_all, -1)
        return lp[rows, cols], ent[rows, cols]

    return per_token, params


@pytest.mark.parametrize(*tiered("case", list(CASES), fast={"ulysses-ring-fsdp-accum2-dapo-kl"}, ids=list(CASES)))
def test_grpo_on_shared_prefix_rows_equals_trls_formulas(case):
    overrides, options = CASES[case]
    g = G.GRPOConfig(num_generations=N_GEN, max_completion_length=MAX_LEN, **options)
    cfg = tiny_cfg(*overrides, f"seq_len={SEQ}", f"model.vocab_size={VOCAB}", "global_batch=4",
                   "data.packing=documents")
    packed, _, comps = _layout()
    per_token, ref_params = _separate(g.temperature)
    lp0, _ = jax.jit(per_token)(ref_params)
    rng = np.random.default_rng(1)
    n = len(comps)
    mask = np.zeros((n, MAX_LEN), np.float32)
    for i, c in enumerate(comps):
        mask[i, :c[4]] = 1.0
    mask[4, :] = 0.0  # a truncated completion, masked (mask_truncated_completions)
    old = np.asarray(lp0) + rng.normal(0, 0.3, (n, MAX_LEN))  # ratios around 1, some clipped
    ref = np.asarray(lp0) + rng.normal(0, 0.3, (n, MAX_LEN))
    rewards = rng.normal(size=n)
    adv = G.group_advantages(rewards, N_GEN, g.scale_rewards)[0]
    batch = dict(packed)
    for key in (G.ADVANTAGES, G.OLD_LOGPS, G.REF_LOGPS):
        batch[key] = np.zeros((len(ROWS), SEQ), np.float32)
    for i, (r, idx, _, _, length) in enumerate(comps):
        batch[G.ADVANTAGES][r, idx] = adv[i]
        batch[G.OLD_LOGPS][r, idx], batch[G.REF_LOGPS][r, idx] = old[i, :length], ref[i, :length]
        batch["mask"][r, idx] = mask[i, :length]

    mesh = mesh_for(cfg, cfg.mesh.num_devices)
    like = step_lib.init_state(cfg, mesh)["params"]
    params = jax.tree.map(lambda h, p: jax.device_put(np.asarray(h), p.sharding), ref_params, like)
    rt, graphdef = runtime(cfg, mesh), llama.model_graphdef(cfg.model, cfg.param_dtype)
    objective = G.GroupRelativePolicyOptimization(g)
    step = jax.jit(lambda p, b: loss_and_grads(objective, p, b, cfg.grad_accum, graphdef, rt))
    loss, grads, metrics = step(params, put_batch(batch, mesh))

    rows_of = [c[0] for c in comps]
    micro = [np.array([i for i, r in enumerate(rows_of) if r % cfg.grad_accum == j]) for j in range(cfg.grad_accum)]
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731

    def by_hand(p):
        lp, ent = per_token(p)
        return _trl_loss(lp, f32(old), f32(ref), f32(adv), f32(mask), jax.lax.stop_gradient(ent), g, micro)

    (want, want_metrics), want_grads = jax.jit(jax.value_and_grad(by_hand, has_aux=True))(ref_params)
    assert float(want_metrics["clip_ratio/region_mean"]) > 0  # some tokens are clipped
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
    assert set(metrics) == set(want_metrics)
    for k, v in want_metrics.items():
        np.testing.assert_allclose(float(metrics[k]), float(v), rtol=1e-5, atol=1e-6, err_msg=k)
    assert_trees_close(jax.tree.map(np.asarray, grads), jax.tree.map(np.asarray, want_grads), rtol=1e-4, atol=1e-6)
