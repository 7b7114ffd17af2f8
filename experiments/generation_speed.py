"""Generation speed on one CPU device: jaxlong's `Generator` against transformers, SmolLM2-135M-Instruct, float32.

One prompt of `--prompt-tokens` tokens of real text (Python standard-library source from `inspect.getsource`, cut
with the model's tokenizer), `--new-tokens` new tokens, greedy, no EOS stop. Both sides run on the same
`--threads` CPUs (this process and the child pin themselves with `sched_setaffinity`, which also sizes XLA's
thread pool; torch gets `torch.set_num_threads`), one side at a time, alternating for `--reps` timed repetitions
after one untimed warm-up each (compiles, first-call allocations). Measured per repetition:

- jaxlong (this process): one `Generator.__call__` of the prompt; prefill = `Generator.seconds["prefill"]` (the
  prefill forward and the first token), decode = `Generator.seconds["decode"]` (its loop: `new_tokens - 1` decode
  steps with the per-token host work: fetching the token, detokenizing).
- transformers (a child process in `--tf-python`'s environment, `--side transformers`): prefill = one forward of
  the prompt with a `DynamicCache` and `logits_to_keep=1` (as `generate` prefills) and the argmax; decode = a loop
  of `new_tokens - 1` one-token forwards on that cache, each followed by the argmax and `int()` of the token (what
  greedy `generate` runs, without its logits processors and stopping checks). Its warm-up is
  `generate(max_new_tokens=N, min_new_tokens=N, do_sample=False)`, whose tokens must equal the loop's.

Rates: prefill tokens/s = prompt tokens / prefill seconds; decode tokens/s = decode steps / decode seconds. Also
the process CPU seconds of each part (steadier than wall time on a shared machine: with one pinned thread, the
work done, not the share of the core received). Afterwards, for the breakdown, jaxlong's decode step alone
(compiled step, each blocked, no host work) and how many times it compiled. Prints a Markdown table; `--json F`
keeps every measurement.

    python experiments/generation_speed.py --tf-python /tmp/tfenv/bin/python --json /tmp/generation_speed.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = Path.home() / ".cache" / "jaxlong" / "test-models" / "smollm2-135m-instruct"
# The prompt's text: these modules' source, in this order, until there are enough tokens.
MODULES = ("argparse", "collections", "dataclasses", "functools", "enum", "typing", "inspect", "pathlib")


def pin(threads: int) -> None:
    """Run this process on its first `threads` CPUs; must happen before jax or torch starts its thread pools."""
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    os.sched_setaffinity(0, cpus)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)


def prompt_ids(model: Path, n: int) -> list[int]:
    """The first `n` tokens of the standard-library source of `MODULES` under the model's tokenizer."""
    import importlib  # noqa: PLC0415
    import inspect  # noqa: PLC0415

    from jaxlong.data import HFTokenizer  # noqa: PLC0415

    tok, text = HFTokenizer(model), ""
    for name in MODULES:
        text += inspect.getsource(importlib.import_module(name))
        ids = tok.encode(text)
        if len(ids) >= n:
            return [int(i) for i in ids[:n]]
    raise ValueError(f"the source of {MODULES} has fewer than {n} tokens")


# ---- jaxlong (the global environment) ------------------------------------------------------------------------------


class Jaxlong:
    """SmolLM2 on a one-device mesh as `python -m jaxlong.generate DIR mesh.num_devices=1` loads it."""

    def __init__(self, model: Path, prompt: int, new: int):
        from jaxlong.config import load_config  # noqa: PLC0415
        from jaxlong.core.mesh import build_mesh  # noqa: PLC0415
        from jaxlong.data import HFTokenizer  # noqa: PLC0415
        from jaxlong.generation.generate import Generator  # noqa: PLC0415
        from jaxlong.models import hf  # noqa: PLC0415

        cfg = load_config(None, [f"model.from_hf={model}", "mesh.fsdp=-1", "mesh.context=1", "mesh.num_devices=1",
                                 f"seq_len={prompt}", "global_batch=1"])
        mesh = build_mesh(cfg.mesh)
        self.gen = Generator(cfg, mesh, hf.load_params(model, cfg.model, mesh, cfg.param_dtype), HFTokenizer(model), max_new_tokens=new,
                             eos_ids=(), trained=0)
        first, self.marks = self.gen.first, []

        def first_marked(logits, key):  # the end of the prefill: the CPU clock then
            tok = first(logits, key)
            tok.block_until_ready()
            self.marks.append(time.process_time())
            return tok

        self.gen.first = first_marked

    def run(self, ids: list[int]) -> dict:
        self.marks.clear()
        c0 = time.process_time()
        out = self.gen([ids])[0]
        c1 = time.process_time()
        s = self.gen.seconds
        return {"prefill_s": s["prefill"], "decode_s": s["decode"], "steps": s["steps"],
                "prefill_cpu_s": self.marks[0] - c0, "decode_cpu_s": c1 - self.marks[0], "tokens": out.tokens}

    def step_alone(self, ids: list[int], steps: int) -> dict:
        """The compiled decode step timed alone (blocked each step, no host work), and its compile count."""
        import jax  # noqa: PLC0415
        import numpy as np  # noqa: PLC0415

        from jaxlong.core.batch import put_batch  # noqa: PLC0415

        g = self.gen
        host, _ = g.batch([ids])
        logits, cache = g.prefill(g.params, put_batch(host, g.mesh))
        key = jax.random.key(0)
        tok, pos = g.first(logits, key), np.array([len(ids)], np.int32)
        wall, cpu = [], []
        for t in range(steps):
            w0, c0 = time.perf_counter(), time.process_time()
            tok, _, cache = g.step(g.params, cache, tok, pos + t, np.int32(t), key)
            tok.block_until_ready()
            wall.append(time.perf_counter() - w0)
            cpu.append(time.process_time() - c0)
        return {"step_s": float(np.median(wall[2:])), "step_cpu_s": float(np.median(cpu[2:])),
                "compiles": g.step._cache_size()}


# ---- transformers (the child, in --tf-python's environment) --------------------------------------------------------


def transformers_child(a) -> int:
    """Serve timed runs: print `READY {...}` after the warm-up, then `RESULT {...}` for each `run` line on stdin."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, DynamicCache  # noqa: PLC0415

    torch.set_num_threads(a.threads)
    ids = torch.tensor([json.loads(Path(a.ids).read_text())], dtype=torch.long)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32, attn_implementation="sdpa").eval()

    def run() -> dict:
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            w0, c0 = time.perf_counter(), time.process_time()
            out = model(ids, cache=cache, use_cache=True, logits_to_keep=1)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens = [int(nxt)]
            w1, c1 = time.perf_counter(), time.process_time()
            for _ in range(a.new_tokens - 1):
                out = model(nxt, cache=cache, use_cache=True)
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                tokens.append(int(nxt))
            w2, c2 = time.perf_counter(), time.process_time()
        return {"prefill_s": w1 - w0, "decode_s": w2 - w1, "steps": a.new_tokens - 1, "prefill_cpu_s": c1 - c0,
                "decode_cpu_s": c2 - c1, "tokens": tokens}

    with torch.no_grad():
        w0 = time.perf_counter()
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.new_tokens,
                             min_new_tokens=a.new_tokens, do_sample=False, pad_token_id=model.config.eos_token_id)
        generate_s = time.perf_counter() - w0
    first = run()
    ready = {"generate_tokens": gen[0, ids.shape[1]:].tolist(), "generate_s": generate_s, "loop_tokens":
             first["tokens"], "torch": torch.__version__, "transformers": transformers.__version__,
             "threads": torch.get_num_threads()}
    print("READY " + json.dumps(ready), flush=True)
    for line in sys.stdin:
        if line.strip() == "run":
            print("RESULT " + json.dumps(run()), flush=True)
    return 0


class Transformers:
    """The child process, started in `--tf-python`'s environment, warm once `READY` arrives."""

    def __init__(self, a, ids_file: Path):
        cmd = [a.tf_python, str(Path(__file__).resolve()), "--side", "transformers", "--model", str(a.model),
               "--ids", str(ids_file), "--new-tokens", str(a.new_tokens), "--threads", str(a.threads)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ready = self._read("READY ")

    def _read(self, tag: str) -> dict:
        for line in self.proc.stdout:
            if line.startswith(tag):
                return json.loads(line[len(tag):])
        raise RuntimeError(f"the transformers child exited ({self.proc.wait()}) before {tag.strip()}")

    def run(self) -> dict:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return self._read("RESULT ")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


# ---- the comparison ------------------------------------------------------------------------------------------------


def agree(a: list[int], b: list[int]) -> int:
    """Tokens equal before the first difference."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def table(runs: dict, prompt: int) -> str:
    import numpy as np  # noqa: PLC0415

    def med(side, f):
        return float(np.median([f(r) for r in runs[side]]))

    rows = [("prefill tokens/s (wall)", lambda r: prompt / r["prefill_s"]),
            ("decode tokens/s (wall)", lambda r: r["steps"] / r["decode_s"]),
            ("prefill tokens per CPU second", lambda r: prompt / r["prefill_cpu_s"]),
            ("decode tokens per CPU second", lambda r: r["steps"] / r["decode_cpu_s"])]
    lines = ["| median of %d | jaxlong | transformers | jaxlong / transformers |" % len(runs["jaxlong"]),
             "|---|---:|---:|---:|"]
    for name, f in rows:
        j, t = med("jaxlong", f), med("transformers", f)
        lines.append(f"| {name} | {j:,.1f} | {t:,.1f} | **{j / t:.2f}x** |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=MODEL, help="the Hugging Face directory (tests/smollm2.py)")
    ap.add_argument("--tf-python", default="python", help="a python with torch and transformers")
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3, help="timed runs per side, interleaved")
    ap.add_argument("--threads", type=int, default=1, help="CPUs (and threads) per side")
    ap.add_argument("--step-samples", type=int, default=24, help="decode steps timed alone (breakdown)")
    ap.add_argument("--json", type=Path, default=None, help="write every measurement here")
    ap.add_argument("--side", choices=("both", "transformers"), default="both", help=argparse.SUPPRESS)
    ap.add_argument("--ids", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    pin(a.threads)
    if a.side == "transformers":
        return transformers_child(a)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    eigen = "true" if a.threads > 1 else "false"
    os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=1 "
                               f"--xla_cpu_multi_thread_eigen={eigen}").strip()
    sys.path.insert(0, str(ROOT))

    import jax  # noqa: PLC0415

    ids = prompt_ids(a.model, a.prompt_tokens)
    ids_file = Path(os.environ.get("TMPDIR", "/tmp")) / f"generation_speed_ids_{os.getpid()}.json"
    ids_file.write_text(json.dumps(ids))
    say = lambda *x: print(*x, file=sys.stderr, flush=True)  # noqa: E731
    t0 = time.perf_counter()
    tf = Transformers(a, ids_file)
    say(f"transformers warm in {time.perf_counter() - t0:.0f} s (generate: {tf.ready['generate_s']:.1f} s)")
    t0 = time.perf_counter()
    jl = Jaxlong(a.model, a.prompt_tokens, a.new_tokens)
    warm = jl.run(ids)
    say(f"jaxlong warm in {time.perf_counter() - t0:.0f} s (first call, compiles included: prefill "
        f"{warm['prefill_s']:.1f} s, decode {warm['decode_s']:.1f} s)")
    runs = {"jaxlong": [], "transformers": []}
    for rep in range(a.reps):
        order = (("jaxlong", lambda: jl.run(ids)), ("transformers", tf.run))
        for side, fn in order if rep % 2 == 0 else order[::-1]:
            r = fn()
            runs[side].append(r)
            say(f"rep {rep} {side}: prefill {r['prefill_s']:.2f} s ({r['prefill_cpu_s']:.2f} CPU s), decode "
                f"{r['steps']} steps {r['decode_s']:.2f} s ({r['decode_cpu_s']:.2f} CPU s)")
    tf.close()
    ids_file.unlink()
    alone = jl.step_alone(ids, a.step_samples)
    loop = runs["jaxlong"][-1]
    j_tokens, t_tokens = loop["tokens"], runs["transformers"][-1]["tokens"]
    same = {"jaxlong_vs_transformers": agree(j_tokens, t_tokens),
            "transformers_loop_vs_generate": agree(tf.ready["loop_tokens"], tf.ready["generate_tokens"]),
            "jaxlong_vs_generate": agree(j_tokens, tf.ready["generate_tokens"]),
            "jaxlong_runs_identical": all(r["tokens"] == j_tokens for r in runs["jaxlong"] + [warm])}
    print(table(runs, a.prompt_tokens))
    print(f"\ngreedy tokens equal before the first difference, of {a.new_tokens}: {same}")
    print(f"jaxlong decode step alone: {alone['step_s'] * 1e3:.1f} ms ({alone['step_cpu_s'] * 1e3:.1f} CPU ms), "
          f"compiled {alone['compiles']} time(s); in Generator's loop: {loop['decode_s'] / loop['steps'] * 1e3:.1f} ms "
          f"({loop['decode_cpu_s'] / loop['steps'] * 1e3:.1f} CPU ms) per step")
    print(f"jax {jax.__version__}, torch {tf.ready['torch']}, transformers {tf.ready['transformers']}, "
          f"{a.threads} CPU(s) per side, torch threads {tf.ready['threads']}")
    if a.json:
        a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "runs": runs, "warm": warm,
                                      "transformers_ready": tf.ready, "agreement": same, "step_alone": alone,
                                      "jax": jax.__version__}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
