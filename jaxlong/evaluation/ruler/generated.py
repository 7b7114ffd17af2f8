"""RULER scored by generation on the training mesh: each case's prompt (`jaxlong.evaluation.ruler.prompts`) is
prefilled and decoded greedily by `jaxlong.generation.Generator` (the training forward, then split-KV decode on
the run's mesh), `tokens_to_generate` tokens at most or until EOS, and the text is scored by RULER's
`string_match_all` (docs/evaluation.md#ruler).

Cases of one length go in batches of `rows_per_batch` rows (a training micro-batch's tokens: `eval_batch_size(cfg)`
rows of `seq_len`, in rows of the length), every batch padded to the length's longest prompt and given room for
its task family's most new tokens, so each length compiles one prefill and one decode step whatever its tasks.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from jaxlong.config import Config
from jaxlong.data.heldout import eval_batch_size
from jaxlong.evaluation.ruler.prompts import GenerationCase, string_match_all
from jaxlong.generation.generate import Generator

__all__ = ["outputs_on_mesh", "rows_per_batch", "score_outputs", "generation_case_rows"]


def outputs_on_mesh(cfg: Config, mesh, params: dict, tokenizer, cases: Sequence[GenerationCase], *,
                    eos_ids: Sequence[int], progress: Callable[[int], None] | None = None,
                    generators: dict | None = None, prefill_bar: bool = False) -> list:
    """Each case's greedy generation (`jaxlong.generation.generate.Generated`: tokens, text, why it stopped).

    Args:
      cfg, mesh: the run's config and mesh. params: FSDP-sharded parameters. tokenizer: the run's.
      cases: `generation_cases` cases, any lengths and tasks. eos_ids: ids that end a row
        (`jaxlong.data.tokenizer.stop_ids`).
      progress: called with the number of cases after each batch.
      generators: a dict kept between calls (training's validations): each length's `Generator`, so that its
        compiled prefill and decode step are reused with the new parameters.
      prefill_bar: a progress bar over each chunked prefill (`Generator`'s; the eval command's process 0).

    Raises:
      ConfigError: a padded prompt length the mesh does not take (`jaxlong.generation.generate.prompt_length`).
    """
    out: list = [None] * len(cases)
    by_length: dict[int, list[int]] = {}
    for i, c in enumerate(cases):
        by_length.setdefault(c.length, []).append(i)
    for length, idx in sorted(by_length.items()):
        rows = rows_per_batch(cfg, length)
        room = max(cases[i].tokens_to_generate for i in idx)
        # RULER's budget keeps prompt + generated within the length; the positions are the user's choice
        gens = {} if generators is None else generators
        if (length, room) not in gens:
            gens[length, room] = Generator(cfg, mesh, params, tokenizer, max_new_tokens=room, eos_ids=eos_ids,
                                           trained=length, prefill_bar=prefill_bar)
        gen = gens[length, room]
        gen.params = params
        pad_to = max(cases[i].prompt.size for i in idx)
        for s in range(0, len(idx), rows):
            chunk = idx[s:s + rows]
            got = gen([cases[i].prompt for i in chunk], max_new=[cases[i].tokens_to_generate for i in chunk],
                      pad_to=pad_to)
            for i, g in zip(chunk, got):
                out[i] = g
            if progress:
                progress(len(chunk))
    return out


def rows_per_batch(cfg: Config, length: int) -> int:
    """Prompts per generation batch at `length` tokens: as many as hold a training micro-batch's tokens
    (`eval_batch_size(cfg) x seq_len`), at least one; the prefill holds no more activations than a micro-step."""
    return max(1, eval_batch_size(cfg) * max(1, cfg.seq_len // max(length, 1)))


def score_outputs(cases: Sequence[GenerationCase], texts: Sequence[str]) -> np.ndarray:
    """float `[len(cases)]`: RULER's `string_match_all` of each case's generated text, in [0, 1]."""
    return np.array([string_match_all(t, c.refs) for c, t in zip(cases, texts, strict=True)], np.float64)


def generation_case_rows(cases: Sequence[GenerationCase], outputs: Sequence, scores: np.ndarray) -> list[dict]:
    """One row per case: task, length, index, `depth` (the asked needle's, empty for
    cwe and fwe), `score` (string_match_all), `answer` (the reference items, ", "-joined), the `generated` text,
    `prompt_tokens`, and why generation `stopped` (eos, length)."""
    return [{"task": c.task, "length": c.length, "index": c.index,
             "depth": "" if c.depth is None else f"{c.depth:.3f}", "score": f"{s:.4g}", "answer": ", ".join(c.refs),
             "generated": g.text, "prompt_tokens": int(c.prompt.size), "stopped": g.reason}
            for c, g, s in zip(cases, outputs, scores, strict=True)]
