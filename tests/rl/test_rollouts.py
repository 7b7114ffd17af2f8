"""GRPO's rollouts into a training batch (`jaxlong.rl.rollouts`): G completions per prompt drawn from one prompt
cache on a ring x Ulysses mesh, scored, given TRL's advantages and packed as shared-prefix groups. The trainer's
log-probs of the packed batch equal the sampler's (the difference is reported), the first step's ratio is 1 (the
loss is minus the mean advantage over the counted tokens), and packing refuses what does not fit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tiny_cfg

from jaxlong.config import runtime
from jaxlong.core.batch import natural_order, put_batch
from jaxlong.core.mesh import build_mesh
from jaxlong.data import ByteTokenizer
from jaxlong.generation.decode import Sampling
from jaxlong.generation.generate import Generator
from jaxlong.models import llama
from jaxlong.objectives import grpo as G
from jaxlong.objectives.base import token_logps_and_entropies
from jaxlong.rl.rewards import load_reward, score_completions
from jaxlong.rl.rollouts import Group, pack_groups
from jaxlong.training import step as step_lib
from jaxlong.training.accumulate import loss_and_grads

N_GEN, T = 3, 0.8


@pytest.mark.slow  # the fast tier samples, packs and trains through the whole loop (tests/rl/test_grpo_run.py)
def test_rollouts_pack_into_a_batch_the_trainer_scores_as_the_sampler_did():
    cfg = tiny_cfg("model.vocab_size=257", "seq_len=64", "global_batch=2", "mesh.fsdp=2", "mesh.ring=2",
                   "mesh.context=2", "attention.block_q=8", "attention.block_k=8", "data.packing=documents")
    mesh = build_mesh(cfg.mesh, jax.devices()[:8])
    params = step_lib.init_state(cfg, mesh)["params"]
    prompts = [np.frombuffer(b"The sky is", np.uint8).astype(np.int32),
               np.frombuffer(b"Two and two make", np.uint8).astype(np.int32)]
    steps: list = []
    gen = Generator(cfg, mesh, params, ByteTokenizer(), max_new_tokens=6, sampling=Sampling(T, 0, 1.0, n=N_GEN))
    out = gen(prompts, seed=5, logits=steps)
    texts = [o.text for o in out]
    scores = score_completions([("string_match_part", load_reward("string_match_part"))],
                               [ByteTokenizer().decode(p) for p in prompts for _ in range(N_GEN)], texts,
                               [o.tokens for o in out], {"refs": [["e"], ["o"], ["a"]] * 2})
    adv, _ = G.group_advantages(G.combine_rewards(scores), N_GEN)
    groups = [Group(p, [o.tokens for o in out[i * N_GEN:(i + 1) * N_GEN]], [o.reason == "eos" for o in
                                                                           out[i * N_GEN:(i + 1) * N_GEN]],
                    adv[i * N_GEN:(i + 1) * N_GEN]) for i, p in enumerate(prompts)]
    batch, where = pack_groups(groups, rows=2, seq_len=64)
    assert batch[G.COMPLETION].max() == N_GEN and batch["mask"].sum() == sum(len(o.tokens) for o in out)

    rt, graphdef = runtime(cfg, mesh), llama.model_graphdef(cfg.model, cfg.param_dtype)
    logps, _ = jax.jit(lambda p, b: token_logps_and_entropies(p, b, graphdef, rt, T))(params, put_batch(batch, mesh))
    logps = natural_order(np.asarray(logps), mesh)
    diffs = []
    for r, o in enumerate(out):  # the sampler drew token t of row r from steps[t][r] / T
        row, start = where[r // N_GEN]
        at = start + np.flatnonzero(batch[G.COMPLETION][row, start:] == r % N_GEN + 1 + (
            batch[G.COMPLETION][row, :start].max(initial=0)))
        for t, token in enumerate(o.tokens):
            sampler = jax.nn.log_softmax(jnp.asarray(steps[t][r]) / T)[token]
            diffs.append(abs(float(sampler) - float(logps[row, at[t]])))
    print(f"sampler against trainer log-probs: max {max(diffs):.2e}, mean {np.mean(diffs):.2e} nats")
    assert max(diffs) < 1e-4, max(diffs)  # float32 forward against cached decode

    objective = G.GroupRelativePolicyOptimization(G.GRPOConfig(num_generations=N_GEN, temperature=T))
    loss, grads, metrics = jax.jit(lambda p, b: loss_and_grads(objective, p, b, 1, graphdef, rt))(
        params, put_batch(batch, mesh))
    m, a = batch["mask"], batch[G.ADVANTAGES]
    np.testing.assert_allclose(float(loss), -float((a * m).sum() / m.sum()), rtol=1e-5)  # ratio 1: -mean advantage
    assert metrics["clip_ratio/region_mean"] == 0 and all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))


def test_packing_refuses_what_does_not_fit():
    g = Group(np.arange(10), [[1, 2, 3], [4]], [True, False], [1.0, -1.0])
    assert len(g) == 9 + 4 + 2
    batch, where = pack_groups([g, g], rows=1, seq_len=32, mask_truncated=True)
    assert where == [(0, 0), (0, 15)]
    assert batch["mask"].sum() == 2 * 3  # the completion that did not end counts no token
    assert list(batch[G.COMPLETION][0, 9:15]) == [1, 1, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="takes 15 positions, more than seq_len=8"):
        pack_groups([g], rows=1, seq_len=8)
    with pytest.raises(ValueError, match="3 groups do not fit 1 rows of 32 tokens"):
        pack_groups([g, g, g], rows=1, seq_len=32)
