"""The package's shape, read from its source: every import of a kern module (top level or inside a
function; not the ``if TYPE_CHECKING:`` blocks, which never run) runs downward through the layers
cli/bench -> app -> server -> engine -> the base (models, backend, kernels, pool, checkpoints,
configs, tokenizer, metrics, ...); no modules import each other in a circle, not even through
``if TYPE_CHECKING:`` imports (to a reader a circle is a circle); a family is its folder under
``kern/models/`` and a registry row: no module outside the folder imports it but the registry
(and the benchmarks), and its name is not spelled out elsewhere; and no file or function grows
past the size at which it stops being one concept (Rust sources included).

``python tests/test_layers.py`` prints the graph's layers and its edges that run sideways.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "python"
PACKAGE = ROOT / "kern"

# Top-level subpackage or module -> layer; higher may import lower or equal, never higher.
LAYERS = {"cli": 4, "bench": 4, "app": 3, "server": 2, "engine": 1}
BASE = 0
LAYER_NAMES = {4: "cli, bench", 3: "app", 2: "server", 1: "engine", 0: "base"}
MAX_LINES = 450
# One concept however long: the wire types of the HTTP API (msgspec Structs).
LONG_FILES = {"kern/server/api.py"}
MAX_FUNCTION_LINES = 100
RUST = ROOT.parent / "rust"
MAX_RUST_LINES = 700
# Where a family may be named: its own folder and the registry (kern/models/), the
# benchmarks (one per family); elsewhere at most this many literals (chat formats' names that
# are also a family's: "qwen3", "kimi_k2").
FAMILY_HOMES = ("kern/models/", "kern/bench/")
MAX_FAMILY_LITERALS = 8


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.get(parts[1], BASE) if len(parts) > 1 else BASE


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(
    tree: ast.AST, module: str, is_package: bool, known: set[str], *, typing: bool = False
) -> set[str]:
    """The kern modules ``module`` imports at run time (``typing``: and in its ``if
    TYPE_CHECKING:`` blocks)."""
    found: set[str] = set()

    def resolve(name: str) -> str | None:
        # The longest known module that ``name`` starts with (``kern.x.y.Name`` -> ``kern.x.y``).
        while name:
            if name in known:
                return name
            name = name.rpartition(".")[0]
        return None

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node) and not typing:
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "kern" or alias.name.startswith("kern."):
                    target = resolve(alias.name)
                    if target:
                        found.add(target)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source == "kern" or source.startswith("kern."):
                for alias in node.names:
                    target = resolve(f"{source}.{alias.name}") or resolve(source)
                    if target:
                        found.add(target)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    found.discard(module)
    return found


def graph(*, typing: bool = False) -> dict[str, set[str]]:
    """Module -> the kern modules it imports (``typing``: counting ``TYPE_CHECKING`` imports)."""
    mods = modules()
    known = set(mods)
    return {
        name: _imports(
            ast.parse(path.read_text(encoding="utf-8")),
            name,
            path.name == "__init__.py",
            known,
            typing=typing,
        )
        for name, path in mods.items()
    }


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_graph_is_read():
    # A reader that found no edges would pass every check below.
    edges = graph()
    assert "kern.app" in edges and "kern.engine.scheduler" in edges
    assert "kern.engine.scheduler" in {m for targets in edges.values() for m in targets}
    assert sum(map(len, edges.values())) > 100


def test_no_module_imports_a_layer_above_it():
    upward = [
        f"{src} ({LAYER_NAMES[layer(src)]}) imports {dst} ({LAYER_NAMES[layer(dst)]})"
        for src, targets in sorted(graph().items())
        for dst in sorted(targets)
        if layer(dst) > layer(src)
    ]
    assert not upward, "\n".join(upward)


def test_no_import_cycles():
    found = cycles(graph())
    assert not found, "\n".join(" <-> ".join(c) for c in found)


def test_no_import_cycles_even_through_type_checking_imports():
    found = cycles(graph(typing=True))
    assert not found, "\n".join(" <-> ".join(c) for c in found)


def _families() -> tuple[str, ...]:
    """The family folders under kern/models/ (each has its registry row, checked below)."""
    return tuple(
        p.name
        for p in sorted((PACKAGE / "models").iterdir())
        if p.is_dir() and p.name != "layers" and (p / "__init__.py").is_file()
    )


def test_every_family_folder_has_a_registry_row():
    rows = (PACKAGE / "models" / "registry.py").read_text(encoding="utf-8")
    families = _families()
    assert len(families) >= 6
    for family in families:
        assert f'"{family}",\n' in rows or f'"{family}"' in rows, family
        assert (PACKAGE / "models" / family / "config.py").is_file(), family
        assert (PACKAGE / "models" / family / "model.py").is_file(), family
        assert (PACKAGE / "models" / family / "tiny.py").is_file(), family


def test_only_the_registry_imports_a_family():
    families = _families()
    edges = graph(typing=True)
    wrong = []
    for src, targets in sorted(edges.items()):
        rel = "kern/" + "/".join(src.split(".")[1:])
        for dst in sorted(targets):
            parts = dst.split(".")
            if len(parts) < 3 or parts[1] != "models" or parts[2] not in families:
                continue
            home = f"kern.models.{parts[2]}"
            if src == home or src.startswith(home + ".") or src == "kern.models.registry":
                continue
            if rel.startswith("kern/bench"):
                continue
            wrong.append(f"{src} imports {dst}")
    assert not wrong, "\n".join(wrong)


def family_literals() -> list[str]:
    """String constants equal to a family's name or a config.json model_type it reads, in
    python/kern outside the family homes."""
    names = set(_families()) | {"qwen3_5_text", "kimi_k2", "kimi_k25"}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(FAMILY_HOMES):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{rel}:{node.lineno}: {node.value!r}")
    return found


def test_families_are_not_named_outside_their_homes():
    found = family_literals()
    assert len(found) <= MAX_FAMILY_LITERALS, "\n".join(found)


def test_no_function_outgrows_one_concept():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(("kern/kernels/", "kern/bench/")):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{rel}:{node.lineno} {node.name}: {lines} lines")
    assert not long, "\n".join(long)


def test_no_rust_file_outgrows_one_concept():
    sources = sorted(RUST.rglob("*.rs"))
    assert sources, RUST
    long = [
        f"{p.relative_to(RUST)}: {n} lines"
        for p in sources
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_RUST_LINES
    ]
    assert not long, "\n".join(long)


def test_the_checker_finds_a_cycle_and_an_upward_import():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    assert layer("kern.engine.scheduler") < layer("kern.server.openai") < layer("kern.app")
    assert layer("kern.app") < layer("kern.cli.run")
    assert layer("kern.pool") == layer("kern.models.qwen3") == BASE
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "import kern.pool\n"
        "from kern.engine import scheduler\n"
        "if TYPE_CHECKING:\n    from kern.app import App\n"
        "def f():\n    from kern.server.api import ApiError\n"
    )
    known = {"kern", "kern.pool", "kern.engine", "kern.engine.scheduler", "kern.app"}
    known |= {"kern.server", "kern.server.api"}
    got = _imports(tree, "kern.engine.spec", False, known)
    assert got == {"kern.pool", "kern.engine.scheduler", "kern.server.api"}
    typed = _imports(tree, "kern.engine.spec", False, known, typing=True)
    assert typed == got | {"kern.app"}


def test_no_file_outgrows_one_concept():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_LINES and rel not in LONG_FILES:
            long.append(f"{rel}: {lines} lines")
    assert not long, "\n".join(long)


if __name__ == "__main__":
    edges = graph(typing="--typing" in sys.argv)
    for level in sorted(LAYER_NAMES, reverse=True):
        names = sorted(m for m in edges if layer(m) == level)
        print(f"{LAYER_NAMES[level]} ({len(names)}): {', '.join(names)}")
    problems = cycles(edges)
    for c in problems:
        print("cycle:", " <-> ".join(c))
    sys.exit(1 if problems else 0)
