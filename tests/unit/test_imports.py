"""The project's import rules, checked statically (`ast`, nothing is imported).

Owns three rules over the packages `protocol`, `verifier`, `node`, `scheduler`, `trainer`
(tests/ and deploy/ are not under them):
1. No import cycle among project modules. Imports that run when a module loads (module
   level, class bodies, module-level `if`/`try`) have none, without exception. Counting
   lazy imports (inside functions) and `if TYPE_CHECKING:` imports too, none either but
   the allowlisted ones: such an import that closes a circle does not fail at import
   time, it only hides a two-way dependency.
2. No module imports an underscore-prefixed name from another project module
   (`from x import _y`); dunders such as `__version__` are public. This one holds for the
   modules of tests/ too: a test reaches what it checks through public names.
3. The import direction of DESIGN.md section 1: `node -> verifier -> protocol`,
   `trainer -> verifier -> protocol`, `scheduler -> protocol`; nothing imports `node` or
   `trainer` but themselves; `protocol` and `scheduler` never import torch (lazily or not).

Invariant: each rule's allowlist names every known exception with the reason; an entry that
no longer matches anything fails, so the list only shrinks.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("protocol", "verifier", "node", "scheduler", "trainer")

# Which project packages each package may import (DESIGN.md section 1).
ALLOWED = {
    "protocol": {"protocol"},
    "verifier": {"verifier", "protocol"},
    "node": {"node", "verifier", "protocol"},
    "trainer": {"trainer", "verifier", "protocol"},
    "scheduler": {"scheduler", "protocol"},
}
# Third-party packages a project package must never import (it installs without them).
FORBIDDEN_THIRD_PARTY = {"protocol": {"torch"}, "scheduler": {"torch"}}

# Known cycles, each as the sorted tuple of the modules of one strongly connected component.
CYCLE_ALLOWLIST: dict[tuple[str, ...], str] = {}
# Known private imports: (importer, "module:name").
PRIVATE_ALLOWLIST: dict[tuple[str, str], str] = {}
# Known direction violations: (importer, imported module).
DIRECTION_ALLOWLIST: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Edge:
    importer: str
    target: str  # a project module, or a third-party top-level name
    names: tuple[str, ...]  # names of `from target import ...` (empty for `import target`)
    where: str  # path:line of the statement
    kind: str  # "load" (runs when the importer loads), "lazy" (in a function), "typing"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _project_files() -> dict[str, Path]:
    return {
        _module_name(p): p
        for pkg in PACKAGES
        for p in sorted((ROOT / pkg).rglob("*.py"))
        if ".venv" not in p.parts
    }


MODULES = _project_files()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, kind: str = "load"):
    """(import statement, kind) for every import under `tree`."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, kind
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield from _imports(ast.Module(body=[stmt], type_ignores=[]), "typing")
            for stmt in child.orelse:
                yield from _imports(ast.Module(body=[stmt], type_ignores=[]), kind)
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            yield from _imports(child, "lazy" if kind == "load" else kind)
        else:
            yield from _imports(child, kind)


def _resolve(importer: str, path: Path, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    package = importer.split(".") if path.name == "__init__.py" else importer.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _edges(name: str, path: Path) -> list[Edge]:
    tree = ast.parse(path.read_text(), str(path))
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    out = []
    for node, kind in _imports(tree):
        where = f"{shown}:{node.lineno}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.append(Edge(name, alias.name, (), where, kind))
            continue
        module = _resolve(name, path, node)
        names = tuple(a.name for a in node.names)
        # `from pkg import sub` imports the submodule `pkg.sub` where there is one.
        subs = [f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES]
        rest = tuple(n for n in names if f"{module}.{n}" not in MODULES)
        out.extend(Edge(name, s, (), where, kind) for s in subs)
        if rest or not subs:
            out.append(Edge(name, module, rest, where, kind))
    return out


EDGES = [e for name, path in MODULES.items() for e in _edges(name, path)]
TEST_EDGES = [e for p in sorted((ROOT / "tests").rglob("*.py")) for e in _edges(_module_name(p), p)]


def _project(target: str, known=MODULES) -> str | None:
    """The project module `target` names (itself, or its nearest enclosing module)."""
    while target and target not in known:
        target = target.rpartition(".")[0]
    return target or None


def _cycles(every_kind: bool, edges: list[Edge] = EDGES) -> list[tuple[str, ...]]:
    """Strongly connected components with more than one module (or a self-import), over
    the imports that run at load time, or over `every_kind` of import."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    graph.update({e.importer: set() for e in edges if e.importer not in graph})
    for e in edges:
        target = _project(e.target, graph)
        if target is not None and (every_kind or e.kind == "load"):
            graph[e.importer].add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                found.append(tuple(sorted(comp)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _private_imports(edges: list[Edge] = EDGES) -> dict[tuple[str, str], str]:
    """(importer, "module:name") -> where, for underscore names of another module."""
    found = {}
    for e in edges:
        target = _project(e.target)
        if target is None or target == e.importer:
            continue
        for n in e.names:
            if n.startswith("_") and not (n.startswith("__") and n.endswith("__")):
                found[(e.importer, f"{e.target}:{n}")] = e.where
    return found


def _direction_violations(edges: list[Edge] = EDGES) -> dict[tuple[str, str], str]:
    """(importer, imported module or third-party package) -> where, against `ALLOWED` or
    `FORBIDDEN_THIRD_PARTY`."""
    found = {}
    for e in edges:
        src = e.importer.split(".")[0]
        target = _project(e.target)
        top = e.target.split(".")[0]
        if target is not None and target.split(".")[0] not in ALLOWED[src]:
            found[(e.importer, target)] = e.where
        elif target is None and top in FORBIDDEN_THIRD_PARTY.get(src, set()):
            found[(e.importer, top)] = e.where
    return found


def test_the_scan_sees_the_project():
    """The static graph is not empty: the rules below would pass vacuously otherwise."""
    assert {"verifier.sampling", "verifier.noise", "node.engines.slot_decode"} <= MODULES.keys()
    assert any(e.importer == "verifier.sampling" and e.target == "verifier.noise" for e in EDGES)


def test_the_scan_reads_every_kind_of_import(tmp_path):
    src = tmp_path / "mod.py"
    src.write_text(
        "from typing import TYPE_CHECKING\n"
        "import torch.nn\n"
        "from verifier import noise\n"
        "from verifier.sampling import RowParams, _choose\n"
        "if TYPE_CHECKING:\n"
        "    from node.worker import Worker\n"
        "else:\n"
        "    from protocol import messages\n"
        "try:\n"
        "    from trainer.loss import aipo_loss\n"
        "except ImportError:\n"
        "    pass\n"
        "class C:\n"
        "    from scheduler import db\n"
        "    def f(self):\n"
        "        from . import sibling\n"
    )
    edges = _edges("verifier.mod", src)
    got = {(e.target, e.names, e.kind) for e in edges}
    assert got == {
        ("typing", ("TYPE_CHECKING",), "load"),
        ("torch.nn", (), "load"),
        ("verifier.noise", (), "load"),
        ("verifier.sampling", ("RowParams", "_choose"), "load"),
        ("node.worker", ("Worker",), "typing"),
        ("protocol.messages", (), "load"),
        ("trainer.loss", ("aipo_loss",), "load"),
        ("scheduler.db", (), "load"),
        ("verifier", ("sibling",), "lazy"),
    }
    assert set(_private_imports(edges)) == {("verifier.mod", "verifier.sampling:_choose")}
    assert set(_direction_violations(edges)) == {
        ("verifier.mod", "node.worker"),
        ("verifier.mod", "trainer.loss"),
        ("verifier.mod", "scheduler.db"),
    }
    back = Edge("verifier.sampling", "verifier.mod", (), "x:1", "lazy")
    loop = [*edges, back, Edge("verifier.mod", "verifier.sampling", (), "x:2", "load")]
    assert ("verifier.mod", "verifier.sampling") not in _cycles(False, loop)
    assert ("verifier.mod", "verifier.sampling") in _cycles(True, loop)


def test_no_import_cycles_at_load_time():
    assert not _cycles(every_kind=False), "import cycles among module-level imports"


def test_no_import_cycles_counting_lazy_and_typing_imports():
    cycles = _cycles(every_kind=True)
    unknown = [c for c in cycles if c not in CYCLE_ALLOWLIST]
    assert not unknown, f"import cycles: {unknown}"
    stale = [c for c in CYCLE_ALLOWLIST if c not in cycles]
    assert not stale, f"allowlisted cycles that are gone (drop them): {stale}"


def test_no_private_names_cross_modules():
    found = _private_imports(EDGES + TEST_EDGES)
    unknown = {k: v for k, v in found.items() if k not in PRIVATE_ALLOWLIST}
    assert not unknown, f"underscore names imported from another module: {unknown}"
    stale = [k for k in PRIVATE_ALLOWLIST if k not in found]
    assert not stale, f"allowlisted private imports that are gone (drop them): {stale}"


def test_import_direction():
    found = _direction_violations()
    unknown = {k: v for k, v in found.items() if k not in DIRECTION_ALLOWLIST}
    assert not unknown, f"imports against DESIGN.md section 1: {unknown}"
    stale = [k for k in DIRECTION_ALLOWLIST if k not in found]
    assert not stale, f"allowlisted direction violations that are gone (drop them): {stale}"
