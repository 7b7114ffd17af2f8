"""GRPO as `python -m jaxlong.train` runs it (`objective: grpo`, `jaxlong.recipes.train` with
`jaxlong.rl.grpo_batches`): prompts in TRL's prompt-only JSONL format with a column, a user's reward given as
`path.py:function` beside a shipped one, G completions per prompt sampled on a ring x Ulysses x FSDP mesh from the
parameters each step starts from, trained with the 8B recipe's memory setup (full remat, kept attention, the tiled
loss), two optimizer steps per rollout (old log-probs from the training forward) and the
KL term to the reference saved with the run. The run logs TRL's metrics, its rewards vary within groups, the first
iteration's ratio is 1 (no clipping; KL 0 against the reference it starts at), and a resume between two rollouts
restores the reference and goes on."""

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import tiny_cfg

from jaxlong.config import ConfigError
from jaxlong.recipes import train
from jaxlong.rl.grpo_batches import REFERENCE_DIR
from jaxlong.training.hooks import Hook

REWARD = '''
def vowels(prompts=None, completions=(), completion_ids=(), topic=None, **kwargs):
    assert len(topic) == len(completions) and all(isinstance(t, str) for t in topic)
    return [sum(ch in "aeiou" for ch in c) / max(len(c), 1) for c in completions]
'''
TRL_NAMES = ("reward", "reward_std", "frac_reward_zero_std", "rewards/vowels/mean", "rewards/string_match_part/mean",
             "completions/mean_length", "completions/clipped_ratio", "clip_ratio/low_mean", "clip_ratio/high_mean",
             "clip_ratio/region_mean", "kl", "entropy", "timing/rollout_s", "timing/train_s")


def _cfg(tmp_path, *extra):
    data = tmp_path / "prompts.jsonl"
    topics = ["sky", "sea", "tree", "stone", "river", "cloud"]
    data.write_text("".join(json.dumps({"prompt": f"Say a word about the {t}:", "topic": t, "refs": [t[:2]]}) + "\n"
                            for t in topics))
    (tmp_path / "reward.py").write_text(REWARD)
    return tiny_cfg("model.vocab_size=257", "data.tokenizer=byte", "seq_len=128", "global_batch=2", "mesh.fsdp=2",
                    "mesh.ring=2", "mesh.context=2", "attention.block_q=8", "attention.block_k=8", "objective=grpo",
                    f"grpo.dataset={data}", f"grpo.reward_funcs=[string_match_part,{tmp_path}/reward.py:vowels]",
                    "grpo.reward_weights=[1.0,2.0]", "grpo.num_generations=3", "grpo.max_completion_length=8",
                    "grpo.prompts_per_step=2", "grpo.num_iterations=2", "grpo.beta=0.04", "grpo.epsilon_high=0.28",
                    "optim.lr=1e-2", "optim.warmup_steps=0", "eval_every=0", "checkpoint_every=2", "log_every=1",
                    # the memory setup of the 8B recipe's GRPO stage (configs/recipes/llama3_1_8b_post_training.yaml)
                    "remat.policy=full", "remat.keep_attention=2", "tiling.loss=true", "tiling.loss_tile=16",
                    f"run_dir={tmp_path}", "run_name=grpo", *extra)


def test_grpo_trains_on_rollouts_logs_trls_metrics_and_resumes_between_rollouts(tmp_path):
    seen = []

    def record(ctx):
        seen.append(dict(ctx.metrics))
        if ctx.step == 3 and len(seen) == 3:
            ctx.request_stop("stopped inside a rollout")  # as a kill after step 3's checkpoint would

    keep = Hook(record, name="record")
    out = train(_cfg(tmp_path, "steps=4"), hooks=[keep])
    assert out["step"] == 3 and len(seen) == 3
    for name in TRL_NAMES:
        assert all(name in m and np.isfinite(m[name]) for m in seen), name
    first, second, third = seen
    # rollout 0 trains steps 1 and 2, rollout 1 steps 3 and 4; the reward metrics are the rollout's
    assert first["reward"] == second["reward"] and first["timing/rollout_s"] > 0 == second["timing/rollout_s"]
    assert max(m["reward_std"] for m in seen) > 0  # the rewards vary within groups: the loss trains something
    # step 1: old log-probs and the reference are the step's own weights: ratio 1, nothing clipped, KL 0
    assert first["clip_ratio/region_mean"] == 0 and abs(first["kl"]) < 1e-6
    assert second["kl"] > 0 and second["loss"] != 0  # the second step of a rollout: the weights moved
    assert (tmp_path / "grpo" / REFERENCE_DIR / "stage0").is_dir()
    # resumed after step 3, inside rollout 1: a fresh rollout at the resumed weights, the reference from disk
    resumed = train(_cfg(tmp_path, "steps=4"), resume=True, hooks=[keep])
    assert resumed["step"] == 4 and seen[-1]["timing/rollout_s"] > 0 and seen[-1]["kl"] > 0


@pytest.mark.parametrize("override, match", [
    ("grpo.num_generations=1", "at least 2 completions per prompt"),
    ("grpo.max_completion_length=64", "takes 195 positions, more than seq_len=128"),
    ("data.packing=concat", "data.packing=documents"),
    ("grpo.reward_weights=[1.0]", "1 weights for 2 grpo.reward_funcs"),
])
def test_grpo_refuses_bad_options_in_one_line(tmp_path, override, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(tmp_path, "steps=1", override)


def test_grpo_refuses_a_missing_reward_and_a_prompt_too_long_before_compiling(tmp_path):
    with pytest.raises(ValueError, match="cannot import"):
        train(_cfg(tmp_path, "steps=1", "grpo.reward_funcs=[no_such_module:f,string_match_part]"))
    norefs = tmp_path / "norefs.jsonl"
    norefs.write_text(json.dumps({"prompt": "Say a word about the sky:", "topic": "sky"}) + "\n")
    with pytest.raises(ConfigError, match="string_match_part reads the column refs, which grpo.dataset"):
        train(_cfg(tmp_path, "steps=1", f"grpo.dataset={norefs}", "run_name=norefs"))
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "x" * 200, "refs": ["x"]}) + "\n")
    with pytest.raises(ConfigError, match="prompt 0 has 201 tokens"):
        train(_cfg(tmp_path, "steps=1", f"grpo.dataset={long}", "run_name=long"))


def test_prompts_in_trls_formats_text_or_messages_with_their_columns(tmp_path):
    """TRL's prompt-only records: text is tokenized as it is (or as a user turn under `grpo.chat`), messages are
    rendered with the run's chat template, the assistant's turn opened; the other fields are columns. Messages
    without a template, and files that mix the two formats, are refused in one line."""
    from jaxlong.data import ByteTokenizer  # noqa: PLC0415
    from jaxlong.data.chat import ChatTemplate  # noqa: PLC0415
    from jaxlong.rl.prompts import jsonl_prompts  # noqa: PLC0415

    tok = ByteTokenizer()
    chat = ChatTemplate(tmp_path, Path(__file__).parents[2] / "configs" / "chat_templates" / "chatml.jinja")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"prompt": messages, "refs": ["red"], "id": 7}) + "\n")
    got = jsonl_prompts(path, tok, chat)
    want = tok.encode(chat.render(messages, add_generation_prompt=True))
    assert got.conversational and list(got.tokens[0]) == list(want) and got.columns == {"id": [7], "refs": [["red"]]}
    assert chat.render(messages, add_generation_prompt=True).endswith("<|im_start|>assistant\n")
    text = tmp_path / "t.jsonl"
    text.write_text(json.dumps({"prompt": "Name a colour."}) + "\n")
    assert list(jsonl_prompts(text, tok).tokens[0]) == list(tok.encode_prompt("Name a colour."))
    assert list(jsonl_prompts(text, tok, chat, use_chat=True).tokens[0]) == list(tok.encode(chat.render(
        [{"role": "user", "content": "Name a colour."}], add_generation_prompt=True)))
    with pytest.raises(ConfigError, match="its prompts are messages, which need a chat template"):
        jsonl_prompts(path, tok, None)
    mixed = tmp_path / "x.jsonl"
    mixed.write_text(path.read_text() + text.read_text())
    with pytest.raises(ConfigError, match="some prompts are text and some messages"):
        jsonl_prompts(mixed, tok, chat)
