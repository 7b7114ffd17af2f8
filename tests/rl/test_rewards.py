"""GRPO's rewards (`jaxlong.rl.rewards`): the shipped ones on text and conversational completions, as RULER and TRL
score them; a user's `module:function` called with TRL's keywords and the dataset's columns; and a reward that
raises, returns the wrong count or a wrong value, named in one line."""

import numpy as np
import pytest

from jaxlong.rl import rewards as R


def test_shipped_rewards_score_text_and_messages():
    completions = ["The numbers are 12 and 7.", [{"role": "assistant", "content": "only 12"}], "nothing"]
    refs = [["12", "7"], ["12", "7"], ["3"]]
    assert R.string_match_all(prompts=["p"] * 3, completions=completions, refs=refs) == [1.0, 0.5, 0.0]
    assert R.string_match_part(prompts=["p"] * 3, completions=completions, refs=refs) == [1.0, 1.0, 0.0]
    think = ["<think>\nsteps\n</think>\nThe answer.", "<think>no end", "answer <think>late</think>",
             "<think>a</think><think>b</think>"]
    assert R.think_format(completions=think) == [1.0, 0.0, 0.0, 0.0]  # TRL's think_format_reward
    with pytest.raises(ValueError, match="refs column"):
        R.string_match_all(completions=completions)


def test_a_users_reward_is_called_as_trl_calls_it(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text("def length(prompts, completions, completion_ids, **kw):\n"
                    "    return [None if c == 'skip' else float(len(ids)) + kw['bonus'][i]\n"
                    "            for i, (c, ids) in enumerate(zip(completions, completion_ids))]\n"
                    "def raises(**kw):\n    raise KeyError('answer')\n"
                    "def short(completions, **kw):\n    return [1.0]\n"
                    "def text(completions, **kw):\n    return ['high'] * len(completions)\n"
                    "def hit(completions, **kw):\n    return ['7' in c for c in completions]\n")
    fns = [("length", R.load_reward(f"{path}:length")), ("string_match_part", R.load_reward("string_match_part"))]
    got = R.score_completions(fns, ["q", "q"], ["abc 7", "skip"], [[1, 2, 3], [4]],
                              {"bonus": [0.5, 0.0], "refs": [["7"], ["7"]]})
    np.testing.assert_array_equal(got, [[3.5, 1.0], [np.nan, 0.0]])
    hit = R.score_completions([("hit", R.load_reward(f"{path}:hit"))], ["q", "q"], ["abc 7", "b"], [[1], [2]])
    np.testing.assert_array_equal(hit, [[1.0], [0.0]])  # booleans count 1 and 0, as TRL's float tensor makes them
    for name, message in (("raises", "reward 'raises' raised KeyError: 'answer' \\(at .*my_rewards.py:5, in raises"),
                          ("short", "returned 1 values for 2"),
                          ("text", "returned 'high' for completion 0")):
        with pytest.raises(ValueError, match=message):
            R.score_completions([(name, R.load_reward(f"{path}:{name}"))], ["q", "q"], ["a", "b"], [[1], [2]])
    for spec, message in (("nonsense", "neither a shipped reward"), (f"{path}:missing", "has no function"),
                          ("no_such_module_xyz:f", "cannot import"), ("missing.py:f", "no such file")):
        with pytest.raises(ValueError, match=message):
            R.load_reward(spec)
