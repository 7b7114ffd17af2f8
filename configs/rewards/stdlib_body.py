"""A user's reward for GRPO, as `grpo.reward_funcs` names one: `configs/rewards/stdlib_body.py:indented_body`.

It is called as TRL's `GRPOTrainer` calls a reward function: `prompts`, `completions` (text here) and
`completion_ids` by keyword, with the dataset's other columns (`refs`, `function`), and returns one float per
completion (or None where it cannot score one). `configs/recipes/tiny_grpo.yaml` uses it beside RULER's
`string_match_all`, which a model as small as that recipe's rarely earns.
"""


def indented_body(prompts=None, completions=(), **kwargs):
    """The share of a completion's non-empty lines indented by four spaces, as a function body's are (0.0 for an
    empty completion): the prompt ends inside a `def`, so a well-formed completion stays in its body."""
    out = []
    for text in completions:
        lines = [line for line in text.split("\n") if line.strip()]
        out.append(sum(line.startswith("    ") for line in lines) / len(lines) if lines else 0.0)
    return out
