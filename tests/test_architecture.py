"""The package's shape, checked from the source (docs/architecture.md): folders are layers, imports between
jaxlong modules form no cycle, no module imports another's underscore name, and only the command folders import
jaxlong modules inside functions (for start-up time)."""

from __future__ import annotations

import ast
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


def _imports(path: Path):
    """(imported jaxlong module, imported names, inside a function?) for every import of a jaxlong module."""
    tree = ast.parse(path.read_text())
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


def test_layers_import_downwards():
    """core <- kernels <- layers <- parallel <- config <- models <- training and evaluation (peers) <- plan <- the
    commands; data sits beside layers, and `models/hf_config.py` (config.json read into plain values, importing
    only core) below config, which reads `model.from_hf` through it. A module never imports a layer above its
    own."""
    rank = {"core": 0, "kernels": 1, "data": 2, "layers": 2, "parallel": 3, "config": 4, "models": 5,
            "training": 6, "evaluation": 6, "generation": 6, "plan": 7, **{c: 8 for c in COMMANDS}}
    below_config = {"jaxlong.models.hf_config": 3}

    def layer(module: str) -> int | None:
        parts = module.split(".")
        return below_config.get(module, rank.get(parts[1]) if len(parts) > 1 else None)

    upward = []
    for name, targets in _graph().items():
        own = layer(name)
        upward += [f"{name} -> {t}" for t in targets if own is not None and (layer(t) or 0) > own]
    assert upward == []


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
