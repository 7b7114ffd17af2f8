"""GRPO's rollouts as a training batch: each prompt's G completions, drawn from one prompt cache on the training
mesh (`jaxlong.generation.generate.Generator` with `Sampling.n`), scored by the rewards (`jaxlong.rl.rewards`),
turned into TRL's group-relative advantages (`jaxlong.objectives.grpo.group_advantages`) and packed as
shared-prefix groups (`jaxlong.data.groups`): the prompt once, then its G completions as branches, so the training
forward computes each prompt once too.

`pack_groups` lays the groups into `[rows, seq_len]` first-fit (largest first), with the batch entries
`jaxlong.objectives.grpo.GroupRelativePolicyOptimization` reads: `mask` on completion tokens (zero for a
completion that did not end, with `mask_truncated_completions`), `completion` (each completion's number in its
row) and `advantages` (its advantage at each of its tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from jaxlong.data.groups import group_length, group_row
from jaxlong.objectives.grpo import ADVANTAGES, COMPLETION

__all__ = ["Group", "pack_groups"]


@dataclass(frozen=True)
class Group:
    """One prompt's rollouts: `prompt` token ids, its G `completions` (token ids, the EOS they ended with
    included), whether each `ended` (EOS, not cut at `max_completion_length`) and each one's `advantages`."""

    prompt: np.ndarray
    completions: Sequence[Sequence[int]]
    ended: Sequence[bool]
    advantages: Sequence[float]

    def __len__(self) -> int:
        return group_length(len(self.prompt), [len(c) for c in self.completions])


def pack_groups(groups: Sequence[Group], rows: int, seq_len: int, mask_truncated: bool = False
                ) -> tuple[dict, list[tuple[int, int]]]:
    """The training batch of `groups` and where each group lies: (`[rows, seq_len]` arrays `inputs`, `targets`,
    `positions`, `segment_ids` (int32), `mask` (float32), `completion` (int32) and `advantages` (float32); each
    group's `(row, first index)`), the groups placed first-fit, largest first, each one whole in one row.

    Raises:
      ValueError: a group longer than `seq_len` (naming its prompt and completion lengths), or more groups than
        the rows hold."""
    out = {k: np.zeros((rows, seq_len), np.float32 if k in ("mask", ADVANTAGES) else np.int32)
           for k in ("inputs", "targets", "positions", "segment_ids", COMPLETION, "mask", ADVANTAGES)}
    free, docs, numbers = [seq_len] * rows, [0] * rows, [0] * rows
    where: list[tuple[int, int]] = [(0, 0)] * len(groups)
    for i in sorted(range(len(groups)), key=lambda i: -len(groups[i])):
        g = groups[i]
        n = len(g)
        if n > seq_len:
            raise ValueError(f"a group of a {len(g.prompt)}-token prompt and completions of "
                             f"{[len(c) for c in g.completions]} tokens takes {n} positions, more than "
                             f"seq_len={seq_len}: raise seq_len, or lower grpo.max_completion_length")
        r = next((r for r in range(rows) if free[r] >= n), None)
        if r is None:
            raise ValueError(f"{len(groups)} groups do not fit {rows} rows of {seq_len} tokens; raise global_batch "
                             f"or seq_len, or take fewer prompts per step")
        docs[r] += 1
        weights = [[0.0 if (mask_truncated and not e) else 1.0] * len(c) for c, e in zip(g.completions, g.ended)]
        row = group_row(g.prompt, g.completions, docs[r], weights)
        at = slice(seq_len - free[r], seq_len - free[r] + n)
        where[i] = (r, at.start)
        for k in ("inputs", "targets", "positions", "segment_ids"):
            out[k][r, at] = row[k]
        out["mask"][r, at] = row["completion"]
        branch = row["branch"]
        number = np.where(branch > 0, numbers[r] + branch, 0)
        out[COMPLETION][r, at] = number
        out[ADVANTAGES][r, at] = np.where(branch > 0, np.asarray(g.advantages, np.float32)[np.maximum(branch - 1, 0)],
                                          0.0)
        numbers[r] += len(g.completions)
        free[r] -= n
    return out, where
