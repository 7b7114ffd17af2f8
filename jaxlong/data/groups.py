"""Shared-prefix groups: one prompt and its G completions packed as one run of a row, the prompt computed once.

A group of prompt `p` (P tokens) and completions `c_1 .. c_G` becomes P - 1 + sum(1 + len(c_i)) tokens: the
prompt's first P - 1 tokens as the shared prefix (branch 0), then each branch i as the prompt's last token followed
by `c_i`. So every completion token, the first included, is predicted from inside its own branch, and the row
holds exactly what G separate rows `p + c_i` would predict, with the prompt's tokens once instead of G times
(PrefixGrouper, arXiv 2506.05433 section 3). Positions continue from the prompt: branch i's tokens sit at P - 1,
P, ... as in its separate row. Segment ids carry the branch (`jaxlong.core.segments`), so attention lets branch i
see the prefix and itself, never a sibling.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from jaxlong.core.segments import MAX_BRANCHES, encode

__all__ = ["group_row", "group_length"]

IGNORE = -100  # the loss's ignored target (`jaxlong.layers.loss.IGNORE_INDEX`)


def group_length(prompt_len: int, completion_lens: Sequence[int]) -> int:
    """Tokens a group takes in a row: `prompt_len - 1 + sum(1 + n for n in completion_lens)`."""
    return prompt_len - 1 + sum(1 + int(n) for n in completion_lens)


def group_row(prompt: Sequence[int], completions: Sequence[Sequence[int]], document: int,
              scored: Sequence[Sequence[float]] | None = None) -> dict[str, np.ndarray]:
    """One shared-prefix group as `[length]` arrays, `length = group_length(...)`.

    Args:
      prompt: the prompt's token ids (at least one).
      completions: the G completions' token ids (G >= 1, fewer than `MAX_BRANCHES`; a completion may be empty).
      document: the group's document number in its row (>= 1; `jaxlong.core.segments`).
      scored: per completion, a weight for each of its tokens as a target (DPO's trained response tokens); None:
        every completion token counts 1.

    Returns:
      `inputs` int32 (the tokens), `targets` int32 (each input's next token in its own prompt + completion;
      `IGNORE` (-100) after a branch's last token), `positions` int32 (RoPE positions, a branch continuing from
      the prompt), `segment_ids` int32 (`encode(document, branch)`), `branch` int32 (0 for the prefix, i for
      completion i), `completion` float32 (`scored`'s weight where the target is a completion token, what GRPO
      and DPO score; 0 elsewhere).

    Raises:
      ValueError: an empty prompt, no completion, too many completions, a document out of range, or `scored` not
        of the completions' lengths.
    """
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise ValueError("a shared-prefix group needs a prompt of at least one token")
    if not 1 <= len(completions) < MAX_BRANCHES:
        raise ValueError(f"a shared-prefix group takes 1 to {MAX_BRANCHES - 1} completions; got {len(completions)}")
    p, weights = len(prompt), scored
    inputs, targets, positions, branch, scored = [prompt[:-1]], [prompt[1:]], [np.arange(p - 1)], [[0] * (p - 1)], [
        [0.0] * (p - 1)]
    for i, c in enumerate(completions, start=1):
        c = [int(t) for t in c]
        inputs.append([prompt[-1], *c])
        targets.append([*c, IGNORE])
        positions.append(np.arange(p - 1, p + len(c)))
        branch.append([i] * (len(c) + 1))
        w = [1.0] * len(c) if weights is None else [float(x) for x in weights[i - 1]]
        if len(w) != len(c):
            raise ValueError(f"scored[{i - 1}] has {len(w)} weights for a completion of {len(c)} tokens")
        scored.append([*w, 0.0])
    cat = lambda parts, dtype: np.concatenate([np.asarray(x, dtype) for x in parts])
    b = cat(branch, np.int32)
    return {"inputs": cat(inputs, np.int32), "targets": cat(targets, np.int32),
            "positions": cat(positions, np.int32), "segment_ids": encode(np.full_like(b, document), b),
            "branch": b, "completion": cat(scored, np.float32)}
