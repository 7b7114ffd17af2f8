"""The package's shape, checked from the source (docs/architecture.md): folders are floors that import only the
floors below them, imports between jaxlong modules form no cycle, no module imports another's underscore name, no
command is imported from outside it, only the command folders import jaxlong modules inside functions (for start-up
time), the objective is named in one place, and functions stay short."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jaxlong"
COMMANDS = ("train", "eval", "memory", "export", "generate")  # `python -m jaxlong.<command>`: the command layer


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


MODULES = _modules()


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _imports(path: Path):
    """(imported jaxlong module, imported names, inside a function?) for every import of a jaxlong module."""
    tree = _tree(path)
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inside.update(id(n) for n in ast.walk(node) if n is not node)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jaxlong"):
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{node.module}.{alias.name}"
                target = sub if sub in MODULES else node.module
                yield target, ([] if sub in MODULES else [alias.name]), id(node) in inside
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("jaxlong"):
                    yield alias.name, [], id(node) in inside


@functools.cache
def _graph() -> dict[str, set[str]]:
    return {m: {t for t, _, _ in _imports(p) if t in MODULES and t != m} for m, p in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_top_level_holds_folders_and_the_config_module_only():
    files = sorted(p.name for p in PACKAGE.iterdir() if p.is_file() and p.suffix == ".py")
    assert files == ["__init__.py", "config.py"]
    for folder in (p for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"):
        assert (folder / "__init__.py").is_file(), f"{folder.name}/ is not a package"
    for command in COMMANDS:
        assert (PACKAGE / command / "__main__.py").is_file(), f"python -m jaxlong.{command} has no __main__.py"


def test_imports_between_jaxlong_modules_form_no_cycle():
    graph = _graph()
    assert sum(len(v) for v in graph.values()) > 100  # the graph was built
    assert _cycles(graph) == []


def test_no_module_imports_an_underscore_name_of_another():
    found = []
    for path in [*PACKAGE.rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "experiments").rglob("*.py")]:
        for target, names, _ in _imports(path):
            found += [f"{path.relative_to(ROOT)}: {target}.{n}" for n in names
                      if n.startswith("_") and not n.startswith("__")]
    assert found == []


def test_only_the_commands_import_jaxlong_modules_inside_functions():
    found = []
    for name, path in MODULES.items():
        if name.split(".")[1:2] and name.split(".")[1] in COMMANDS:
            continue
        found += [f"{name} imports {t} in a function" for t, _, inside in _imports(path) if inside]
    assert found == []


# The floors (docs/architecture.md): a folder may import its own floor's modules only from its own folder, and the
# floors below it. Peers on one floor import neither each other: `training` and `generation` are peers.
FLOORS = {"core": 0, "kernels": 1, "data": 1, "layers": 1, "optim": 1, "parallel": 2, "models": 3, "objectives": 4,
          "config": 5, "training": 6, "generation": 6, "evaluation": 7, "rl": 8, "recipes": 9, "plan": 10,
          **{c: 11 for c in COMMANDS}}


def _folder(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _folder_edges() -> dict[tuple[str, str], list[str]]:
    edges: dict[tuple[str, str], list[str]] = {}
    for name, targets in _graph().items():
        for t in targets:
            a, b = _folder(name), _folder(t)
            if a and b and a != b:
                edges.setdefault((a, b), []).append(f"{name} -> {t}")
    return edges


def test_every_folder_has_a_floor():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"} | {"config"}
    assert folders == set(FLOORS), "give each folder of jaxlong/ its floor in FLOORS (and docs/architecture.md)"


def test_folders_import_downwards_only():
    """core < kernels, data, layers, optim < parallel < models < objectives < config < training, generation <
    evaluation < rl < recipes < plan < the commands: a module never imports a folder on its own floor or above, except
    its own folder (so no two folders import each other, and training and generation import neither)."""
    wrong = [line for (a, b), lines in _folder_edges().items() if FLOORS[b] >= FLOORS[a] for line in lines]
    assert wrong == []


def test_no_command_is_imported_from_outside_it():
    """`train`, `eval`, `generate`, `memory` and `export` are entry points: the library and the experiments never
    import them (what they share lives in the library)."""
    found = []
    for path in [*PACKAGE.rglob("*.py"), *(ROOT / "experiments").rglob("*.py")]:
        own = _folder(_module_name(path)) if path.is_relative_to(PACKAGE) else None
        found += [f"{path.relative_to(ROOT)} imports {t}" for t, _, _ in _imports(path)
                  if _folder(t) in COMMANDS and _folder(t) != own]
    assert found == []


def test_only_the_config_and_the_registry_name_an_objective():
    """The objective is chosen once (`jaxlong.objectives.registry`); everywhere else code asks the `Objective`,
    never compares `objective` with a name."""
    allowed = {"jaxlong/config.py", "jaxlong/objectives/registry.py"}
    found = []
    for path in PACKAGE.rglob("*.py"):
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(_tree(path)):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            names = any(isinstance(x, ast.Attribute) and x.attr == "objective" for x in sides)
            strings = any(isinstance(x, ast.Constant) and isinstance(x.value, str) for x in sides)
            if names and strings and rel not in allowed:
                found.append(f"{rel}:{node.lineno}")
    assert found == []


def test_functions_a_reader_can_hold():
    """No function is longer than 100 lines, and none outside the kernels and the parallel ops takes more than 10
    parameters (options that travel together travel as one record)."""
    long, many = [], []
    for path in PACKAGE.rglob("*.py"):
        rel = str(path.relative_to(ROOT))
        for n in ast.walk(_tree(path)):
            if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if n.end_lineno - n.lineno + 1 > 100:
                long.append(f"{rel}:{n.lineno} {n.name}")
            a = n.args
            count = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
            count -= bool(a.args) and a.args[0].arg in ("self", "cls")
            if count > 10 and not rel.startswith(("jaxlong/kernels/", "jaxlong/parallel/")):
                many.append(f"{rel}:{n.lineno} {n.name} ({count})")
    assert long == [] and many == []


def test_every_jaxlong_name_the_scripts_and_tests_import_exists():
    """Scripts import inside functions (they set up devices first), so a moved name would only fail when they run:
    each `from jaxlong... import name` of `experiments/` and `tests/` must resolve."""
    import importlib

    missing = []
    for path in [*(ROOT / "experiments").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jaxlong"):
                module = importlib.import_module(node.module)
                missing += [f"{path.relative_to(ROOT)}: {node.module}.{a.name}" for a in node.names
                            if not hasattr(module, a.name) and f"{node.module}.{a.name}" not in MODULES]
    assert missing == []


def test_every_test_file_joins_a_tier_explicitly():
    """Every `test_*.py` under tests/ is listed in `tests/tiers.py` (and nothing listed is missing); collection
    then checks that its tests are in the tiers it declares (`tests/conftest.py`)."""
    from tiers import BUDGET_S, TIERS

    on_disk = {str(p.relative_to(ROOT / "tests")).replace("\\", "/") for p in (ROOT / "tests").rglob("test_*.py")}
    assert sorted(on_disk - set(TIERS)) == [], "add these to TIERS in tests/tiers.py"
    assert sorted(set(TIERS) - on_disk) == [], "remove these from TIERS in tests/tiers.py"
    assert set(TIERS.values()) <= {"fast", "slow", "fast+slow"}
    assert set(BUDGET_S) == {"fast", "slow"}
