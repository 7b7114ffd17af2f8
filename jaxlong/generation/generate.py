"""Generate text on the training mesh: a batch of prompts of different lengths, prefilled once, then decoded one
token per step (`jaxlong.generation.decode`) until EOS, a stop string or `max_new_tokens`.

Prompts are **left-padded** to one prompt length the mesh takes (the least length `>=` the longest prompt that
`jaxlong.config.validate` accepts as `seq_len`): padding has segment id 0, so it is masked out of attention and
out of the cache (`Cache.valid`), and each row's tokens keep their true positions `0 .. n-1`; the first generated
token of a row sits at position n. A batch whose row count the mesh's batch axes (data x fsdp) do not divide is
filled with copies of its last prompt, whose output is dropped.

With `prefill_chunk` set, a batch whose longest prompt is longer than the chunk is **right-padded** to a multiple
of it and prefilled chunk by chunk (`jaxlong.generation.chunked`): the prefill holds one chunk's activations
beside the cache, where the whole-prompt forward holds the whole prompt's.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Callable, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from jaxlong.config import Config, ConfigError, forward_at, validate
from jaxlong.core.memstats import free_per_device
from jaxlong.core.mesh import BATCH_AXES, axis_size
from jaxlong.core.batch import put_batch
from jaxlong.generation.chunked import ChunkedPrefill
from jaxlong.generation.decode import (Sampling, decode_weights_mode, expand_samples, make_decode_step,
                                       make_prefill, replicate_weights, sample, weight_bytes)


__all__ = ["Generated", "Generator", "prompt_length", "check_positions"]


@dataclasses.dataclass
class Generated:
    """One row's result: the generated `tokens` (EOS excluded), their `text`, why it stopped (`eos`, `stop`:
    a stop string, cut before it; `length`: `max_new_tokens`) and, for `eos`, the id that ended it (`eos_id`;
    else -1)."""

    tokens: list[int]
    text: str
    reason: str
    eos_id: int = -1


def check_positions(cfg: Config, prompt_tokens: int, max_new: int, trained: int | None = None) -> None:
    """Refuse a prompt plus `max_new` generated tokens beyond the model's positions: the largest of
    `model.max_position_embeddings` (the checkpoint's), the trained length `trained` (default `cfg.seq_len`; 0 for
    a Hugging Face directory) and, with RoPE scaling, its `original_max_position_embeddings x factor` (what the
    scaling extends the pretraining context to).

    Raises:
      ConfigError: naming both counts, the limit and what would work.
    """
    rs = cfg.model.rope_scaling
    scaled = int(rs.original_max_position_embeddings * rs.factor) if rs.type != "none" else 0
    limit = max(cfg.model.max_position_embeddings or 0, cfg.seq_len if trained is None else trained, scaled)
    if prompt_tokens + max_new > limit:
        room = (f"generate at most {limit - prompt_tokens} tokens or shorten the prompt" if prompt_tokens < limit else
                f"shorten the prompt to fewer than {limit} tokens")
        raise ConfigError(f"a prompt of {prompt_tokens} tokens plus --max-new-tokens={max_new} exceeds the model's "
                          f"{limit} positions (the largest of model.max_position_embeddings, the trained seq_len and "
                          f"the RoPE scaling's reach); {room}, or extend the context with RoPE scaling "
                          f"(model.rope_scaling.*, docs/hf-models.md)")


def prompt_length(cfg: Config, longest: int, rows: int, search: int = 1 << 16) -> int:
    """The least prompt length `>= longest` that the mesh takes as `seq_len` for a batch of `rows` (every rule of
    `jaxlong.config.validate`: divisibility by the sequence axes, ring's zigzag, the kernels' blocks).

    Raises:
      ConfigError: no such length within `search` tokens above `longest`.
    """
    for n in range(max(longest, 1), longest + search):
        try:
            validate(forward_at(cfg, n, global_batch=rows, grad_accum=1, steps=1,
                                optim=dataclasses.replace(cfg.optim, schedule_start=0, warmup_steps=0, decay_steps=0)))
            return n
        except ConfigError:
            continue
    raise ConfigError(f"no prompt length from {longest} to {longest + search} tokens fits this mesh; change the mesh")


class Generator:
    """Generation with one model on one mesh; compiles the prefill per prompt length and the decode step once per
    batch and cache size.

    Args:
      cfg: the run's `Config` (model, mesh, attention options, `decode_weights`). mesh: its mesh. params: the
        parameters, FSDP-sharded (the decode steps read them as `decode_params` says).
      tokenizer: the run's (`jaxlong.data.run_tokenizer`): `decode` makes the text.
      max_new_tokens: generated tokens per row at most (>= 1). sampling: `Sampling` (default greedy).
      eos_ids: token ids that end a row. stop: strings that end a row (the text is cut before them).
      trained: the context the model was trained to (`check_positions`; default `cfg.seq_len`, 0 for a Hugging
        Face directory's model).
      prefill_bar: show a progress bar on stderr over each chunked prefill (the CLIs' process 0): at 1M tokens in
        chunks of 8K a CPU host runs 128 chunk programs for hours.
    With `sampling.n` = G > 1 each prompt is prefilled once and G rows decode from its one prompt cache
    (`jaxlong.generation.decode`), drawing their own tokens; a call returns G results per prompt, prompt by prompt.
    """

    def __init__(self, cfg: Config, mesh, params: dict, tokenizer, *, max_new_tokens: int,
                 sampling: Sampling = Sampling(), eos_ids: Sequence[int] = (), stop: Sequence[str] = (),
                 trained: int | None = None, prefill_bar: bool = False):
        if max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens={max_new_tokens} must be >= 1")
        if sampling.n < 1:
            raise ConfigError(f"sampling n={sampling.n} must be >= 1 (rows generated from each prompt)")
        self.samples = int(sampling.n)
        self.cfg, self.mesh, self.params, self.tokenizer = cfg, mesh, params, tokenizer
        self.max_new, self.sampling, self.trained, self.prefill_bar = max_new_tokens, sampling, trained, prefill_bar
        self.eos, self.stop = set(int(i) for i in eos_ids), [s for s in stop if s]
        vocab = min(int(tokenizer.vocab_size), cfg.model.vocab_size)  # the padded embedding's extra ids: never drawn
        self.prefill = make_prefill(cfg, mesh, max_new_tokens)
        # prompts longer than `prefill_chunk` are prefilled chunk by chunk (`jaxlong.generation.chunked`)
        self.chunked = ChunkedPrefill(cfg, mesh, cfg.prefill_chunk, max_new_tokens) if cfg.prefill_chunk else None
        self.step = make_decode_step(cfg, mesh, sampling, vocab=vocab)
        self.expand = expand_samples(mesh, self.samples) if self.samples > 1 else None
        # the first token in the decode step's own output sharding (replicated, so that every process reads the
        # tokens): every step then has one input signature
        self.first = jax.jit(lambda logits, key: sample(logits, key, sampling, vocab),
                             out_shardings=NamedSharding(mesh, P()))
        self.rows_unit = int(np.prod([axis_size(mesh, a) for a in BATCH_AXES]))
        self.weights = ""  # where the last call's decode steps read the weights (`decode_params`)
        self.replicate = replicate_weights(cfg, mesh)

    def chunks(self, longest: int) -> bool:
        """Whether a batch whose longest prompt (or `pad_to`) is `longest` tokens is prefilled in chunks."""
        return bool(self.cfg.prefill_chunk) and longest > self.cfg.prefill_chunk

    def batch(self, prompts: Sequence[np.ndarray], pad_to: int = 0) -> tuple[dict, int]:
        """The host batch of `prompts` (left-padded, see the module docstring) and its prompt length (at least
        `pad_to`: batches of one padded length share their compiled prefill)."""
        rows = -(-len(prompts) // self.rows_unit) * self.rows_unit
        prompts = list(prompts) + [prompts[-1]] * (rows - len(prompts))
        longest = max(pad_to, *(len(p) for p in prompts))
        chunk = self.cfg.prefill_chunk
        chunked = self.chunks(longest)  # right-padded to chunks (`jaxlong.generation.chunked`)
        n = -(-longest // chunk) * chunk if chunked else prompt_length(self.cfg, longest, rows)
        out = {k: np.zeros((rows, n), np.int32) for k in ("inputs", "positions", "segment_ids")}
        for r, p in enumerate(prompts):
            p = np.asarray(p, np.int32)
            at = slice(0, len(p)) if chunked else slice(n - len(p), n)
            out["inputs"][r, at] = p
            out["positions"][r, at] = np.arange(len(p))
            out["segment_ids"][r, at] = 1
        return out, n

    def __call__(self, prompts: Sequence[np.ndarray], *, seed: int = 0,
                 on_text: Callable[[int, str], None] | None = None, logits: list | None = None,
                 max_new: Sequence[int] | None = None, pad_to: int = 0) -> list[Generated]:
        """Generate for each prompt (token ids, each non-empty); `on_text(row, new_text)` streams each row's text
        as it grows (only text that no stop string could still claim); `logits`, when a list, receives each
        step's float32 logits `[rows, vocab]` (tests). `max_new` gives each row its own most new tokens (each at
        most `max_new_tokens`, the cache's room); `pad_to` the least padded prompt length (`batch`). With
        `sampling.n` G > 1 the result holds G rows per prompt (prompt p's at `p G .. p G + G - 1`), and `on_text`
        and `logits` see those rows.

        Raises:
          ConfigError: an empty prompt, or a prompt plus its new tokens beyond the model's positions, or a row's
            `max_new` outside [1, max_new_tokens].
        """
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ConfigError("an empty prompt: give at least one token of text")
        limits = [self.max_new] * len(prompts) if max_new is None else [int(m) for m in max_new]
        if len(limits) != len(prompts) or not all(1 <= m <= self.max_new for m in limits):
            raise ConfigError(f"max_new {list(limits)}: give one count per prompt, each in [1, {self.max_new}]")
        longest = max(range(len(prompts)), key=lambda r: len(prompts[r]) + limits[r])
        check_positions(self.cfg, len(prompts[longest]), limits[longest], self.trained)
        host, _ = self.batch(prompts, pad_to)
        t0 = time.perf_counter()
        if self.chunks(max(pad_to, *(len(p) for p in prompts))):  # as `batch` padded them: to the right
            tick, close = _chunk_bar(self.prefill_bar)
            try:
                logits_now, cache = self.chunked(self.params, host, on_chunk=tick)
            finally:
                close()
        else:
            logits_now, cache = self.prefill(self.params, put_batch(host, self.mesh))
        g = self.samples
        if g > 1:  # G rows per prompt: one prompt cache, G caches of generated tokens
            logits_now, cache = jax.numpy.repeat(logits_now, g, axis=0), self.expand(cache)
        key = jax.random.key(seed)
        key, sub = jax.random.split(key)
        tok = self.first(logits_now, sub)
        tok.block_until_ready()
        self.seconds = {"prefill": time.perf_counter() - t0, "decode": 0.0, "steps": 0, "weights": 0.0,
                        "prompt_tokens": sum(len(p) for p in prompts), "padded": int(host["inputs"].size)}
        t0 = time.perf_counter()
        weights, self.weights = None, ""  # `decode_params`, before the first decode step
        if logits is not None:
            logits.append(np.asarray(jax.device_get(logits_now)))
        positions = np.array([len(p) for p in prompts] + [len(prompts[-1])] * (host["inputs"].shape[0] - len(prompts)),
                             np.int32).repeat(g)
        rows, limits = len(prompts) * g, [m for m in limits for _ in range(g)]
        out = [Generated([], "", "length") for _ in range(rows)]
        shown = [0] * rows
        done = [False] * rows
        for t in range(self.max_new):
            ids = np.asarray(jax.device_get(tok))
            for r in range(rows):
                if done[r]:
                    continue
                if int(ids[r]) in self.eos:
                    done[r], out[r].reason, out[r].eos_id = True, "eos", int(ids[r])
                else:
                    out[r].tokens.append(int(ids[r]))
                    self._update(out[r], done, r)
                    if not done[r] and t + 1 >= limits[r]:
                        done[r] = True  # its own max_new: reason "length"
                if on_text is not None:
                    text = out[r].text
                    safe = len(text) if done[r] else _safe_prefix(text, self.stop)
                    if safe > shown[r]:
                        on_text(r, text[shown[r]:safe])
                        shown[r] = safe
            if all(done) or t == self.max_new - 1:
                break
            key, sub = jax.random.split(key)
            if weights is None:
                t1 = time.perf_counter()
                weights = self.decode_params()
                self.seconds["weights"] = time.perf_counter() - t1
            tok, logits_now, cache = self.step(weights, cache, tok, positions, np.int32(t), sub)
            self.seconds["steps"] += 1
            if logits is not None:
                logits.append(np.asarray(jax.device_get(logits_now)))
            positions = positions + 1
        self.seconds["decode"] = time.perf_counter() - t0 - self.seconds["weights"]
        if on_text is not None:
            for r in range(rows):
                if len(out[r].text) > shown[r]:
                    on_text(r, out[r].text[shown[r]:])
        return out

    def decode_params(self) -> dict:
        """The weights this call's decode steps read, by `decode_weights`
        (`jaxlong.generation.decode.decode_weights_mode`, from the memory free now, after the prefill): a
        replicated copy of `params`, made for the call and released with it (training's validations assign new
        `params` between calls), or the FSDP-sharded `params`. Several processes decide on the least free memory
        of any of them, and on `sharded` where any cannot tell, so that they run one program; CPU processes sharing
        a host each count its whole available memory. Sets `weights` to the choice."""
        need = weight_bytes(self.params, self.cfg)
        free = free_per_device(self.mesh.local_devices) if self.cfg.decode_weights == "auto" else None
        if self.cfg.decode_weights == "auto" and jax.process_count() > 1:
            from jax.experimental import multihost_utils  # noqa: PLC0415

            every = np.asarray(multihost_utils.process_allgather(np.int64(-1 if free is None else free)))
            free = None if (every < 0).any() else int(every.min())
        self.weights = decode_weights_mode(self.cfg.decode_weights, need, free)
        return self.replicate(self.params) if self.weights == "replicated" else self.params

    def timing(self) -> str:
        """The last call's prefill and decode rates (the first call's include the compiles), and where the decode
        steps read the weights (the replicated copy's gather timed apart)."""
        t = self.seconds
        rate = t["steps"] / t["decode"] if t["decode"] else 0.0
        weights = f", weights {self.weights}" if self.weights else ""
        if self.weights == "replicated":
            weights += f" (copied in {t['weights']:.2f} s)"
        return (f"prefill {t['prompt_tokens']} tokens ({t['padded']} with padding) in {t['prefill']:.2f} s, "
                f"{t['prompt_tokens'] / t['prefill']:,.0f} tokens/s; decode {t['steps']} steps in {t['decode']:.2f} s, "
                f"{rate:,.1f} steps/s{weights}")

    def _update(self, g: Generated, done: list, r: int) -> None:
        g.text = self.tokenizer.decode(g.tokens)
        for s in self.stop:
            at = g.text.find(s)
            if at >= 0:
                g.text, done[r], g.reason = g.text[:at], True, "stop"


def _chunk_bar(show: bool) -> tuple[Callable[[int, int], None] | None, Callable[[], None]]:
    """`(on_chunk, close)` for `ChunkedPrefill`: a progress bar on stderr weighted by each chunk's attention work
    (chunk j reads j + 1 chunks of the cache, so the bar's time left holds as the chunks slow down; the first
    chunk, which compiles, is left out of the rate), or nothing when not `show`."""
    if not show:
        return None, lambda: None
    bar = tqdm(total=0, desc="prefill", leave=False, file=sys.stderr, dynamic_ncols=True, mininterval=0,
               bar_format="{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}]")

    def tick(done: int, chunks: int) -> None:
        bar.set_description_str(f"prefill, chunk {done}/{chunks}", refresh=False)
        if done == 1:  # the first chunk's time holds the chunk step's compile: the rate counts from the second
            bar.reset(total=chunks * (chunks + 1) // 2)
            bar.n = bar.last_print_n = 1
            bar.refresh()
        else:
            bar.update(done)

    return tick, bar.close


def _safe_prefix(text: str, stops: Sequence[str]) -> int:
    """The length of `text`'s prefix that no stop string can still begin in (its tail may be a stop's start);
    a trailing replacement character (a multi-byte character cut) waits too."""
    n = len(text.rstrip("\ufffd"))
    for s in stops:
        for k in range(min(len(s) - 1, n), 0, -1):
            if text[:n].endswith(s[:k]):
                n -= k
                break
    return n
