"""The shape of the code: no import cycles, short functions where the driver and the roles meet.

Both checks read the source with `ast` (nothing is imported), so they run in a fraction of a second.
Every import counts, also those inside functions and under `TYPE_CHECKING`: a lazy import hides a cycle
from Python at start-up but not from the reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "rayzero"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The rayzero modules that `path` imports (a `from pkg import sub` of a submodule names the submodule)."""
    name = module_name(path)
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    return {m for m in found if m in known and m != name}


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(path, known) for name, path in mods.items()}


def package_of(module: str) -> str:
    """rayzero.tree.search -> rayzero.tree; a module at the root (rayzero.config) is its own node."""
    parts = module.split(".")
    if len(parts) >= 3 or (module in modules() and modules()[module].name == "__init__.py"):
        return ".".join(parts[:2])
    return module


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph (as a closed path), or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_walk_sees_imports():
    edges = graph()
    assert "rayzero.config" in edges["rayzero.models.networks"]
    assert "rayzero.tree.search" in edges["rayzero.tree"]


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle_between_modules():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_import_cycle_between_packages():
    packages: dict[str, set[str]] = {}
    for module, targets in graph().items():
        source = package_of(module)
        packages.setdefault(source, set()).update(package_of(t) for t in targets if package_of(t) != source)
    cycle = find_cycle(packages)
    assert cycle is None, "import cycle between packages: " + " -> ".join(cycle or [])


# Where the driver and the roles meet, a function that does not fit on a screen hides its decisions.
SHORT = ["train.py", "schedule.py", "cluster", "inference/server.py", "learner/learner.py"]
MAX_LINES = 80


def long_functions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    return [f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_LINES]


@pytest.mark.parametrize("where", SHORT)
def test_functions_are_short(where):
    target = PACKAGE / where
    paths = sorted(target.rglob("*.py")) if target.is_dir() else [target]
    assert paths
    long = [entry for path in paths for entry in long_functions(path)]
    assert not long, f"functions over {MAX_LINES} lines: {long}"


RESOURCE_KEYWORDS = {"num_cpus", "num_gpus", "resources", "memory", "max_concurrency"}


def test_only_the_plan_decides_resources():
    """No `.options(...)` with a literal resource request outside cluster/ (benchmarks size their own actors)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith(("cluster/", "bench/")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "options":
                keywords = {k.arg for k in node.keywords} & RESOURCE_KEYWORDS
                if keywords:
                    found.append(f"{relative}:{node.lineno} {sorted(keywords)}")
    assert not found, found


def test_no_duplicated_code():
    """pylint's duplicate-code check over the package (6 similar lines or more). The Triton kernels mirror the
    torch path on purpose (the same float32 operations in the same order): kernels.py is left out by name."""
    pytest.importorskip("pylint", reason="pylint is in the dev extra")
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "pylint", "--disable=all", "--enable=duplicate-code",
                             "--min-similarity-lines=6", "--ignore=kernels.py", "--score=n", str(PACKAGE)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
