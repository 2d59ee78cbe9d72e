"""dtrec's layering: no import cycles, and no import that points up the layer order.

Data flows one way (DESIGN.md): plan -> placements -> sharded module -> ops ->
backends/kernels, so a lower layer never imports a higher one. The order is defined
once, in ``LAYERS``; the checker reads every module under dtrec/ with ``ast``
(module-level and function-level imports, ``from . import``, ``import a.b``).
``make lint`` runs this file.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "dtrec"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("dtrec._torch_compat",),
    ("dtrec.kernels",),
    ("dtrec.ops",),  # with dtrec.ops.backends
    ("dtrec.comm",),
    ("dtrec.optim",),
    ("dtrec.sparse",),
    ("dtrec.modules",),
    ("dtrec.interop",),  # TorchRec modules and configs -> dtrec's (torchrec never imported)
    ("dtrec.placements",),
    # TorchRec plans / constraints -> specs, TableConstraint; DMPCollectionConfigs -> meshes
    ("dtrec.interop.plans", "dtrec.interop.dmp_collection"),
    # the search (offload, offload_plan: the host tier's costs and choices)
    (
        "dtrec.planning.step_model",  # the scale model's fabric and step (imports no dtrec)
        "dtrec.planning.topology",
        "dtrec.planning.offload",
        "dtrec.planning.cost_model",
        "dtrec.planning.offload_plan",
        "dtrec.planning.fully_sharded_plan",  # which tables the planner fully shards
        "dtrec.planning.plan_step",  # a whole plan's step: what the search ranks plans by
        "dtrec.planning.search",  # the search's state and steps
        "dtrec.planning.planner",
    ),
    ("dtrec.planning",),
    ("dtrec.sharded", "dtrec.pipelining"),  # with the microbatches of pipeline stages
    ("dtrec.checkpoint",),
    ("dtrec", "dtrec.planner"),  # the public API (dtrec/__init__.py) and the CLI entry point
)
"""Lowest first; each entry is one layer's packages (or top-level modules)."""

ALLOWED_UPWARD: dict[tuple[str, str], str] = {
    # (importer, imported): why; none today
}
"""(importer, imported) -> why it is tolerated for now. Entries must still occur."""


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    line: int
    at_import_time: bool
    """False inside a function body or an ``if TYPE_CHECKING:`` block (cannot form a cycle)."""


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(name: str, modules: set[str]) -> str | None:
    """The longest known module ``name`` names (``a.b.attr`` -> ``a.b``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


class _ImportVisitor(ast.NodeVisitor):
    def __init__(self, source: str, is_package: bool, modules: set[str]) -> None:
        self.source, self.is_package, self.modules = source, is_package, modules
        self.imports: list[Import] = []
        self._deferred = 0  # depth of function bodies / TYPE_CHECKING blocks

    def _add(self, target: str, node: ast.stmt) -> None:
        found = _resolve(target, self.modules)
        if found is not None and found != self.source:
            self.imports.append(Import(self.source, found, node.lineno, self._deferred == 0))

    def _defer(self, nodes: list[ast.AST]) -> None:
        self._deferred += 1
        for node in nodes:
            self.visit(node)
        self._deferred -= 1

    def _function(self, node: ast.AST) -> None:
        self._defer(list(ast.iter_child_nodes(node)))

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
        if name == "TYPE_CHECKING":
            self._defer(node.body)
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] == "dtrec":
                self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            package = self.source if self.is_package else self.source.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{node.module}" if node.module else package
        else:
            base = node.module or ""
        if base.split(".")[0] != "dtrec":
            return
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            self._add(submodule if submodule in self.modules else base, node)


def scan(root: Path) -> list[Import]:
    """Every import between modules of the package at ``root``."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    modules = set(files)
    imports: list[Import] = []
    for name, path in files.items():
        visitor = _ImportVisitor(name, path.name == "__init__.py", modules)
        visitor.visit(ast.parse(path.read_text(), str(path)))
        imports += visitor.imports
    return imports


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected group of modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def connect(node: str) -> None:  # Tarjan
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            connect(node)
    cycles = []
    for group in groups:
        members, start = set(group), group[0]
        paths = {start: [start]}
        frontier = [start]
        while frontier:  # shortest path from start back to start inside the group
            node = frontier.pop(0)
            for nxt in sorted(edges.get(node, ())):
                if nxt == start:
                    frontier = []
                    cycles.append([*paths[node], start])
                    break
                if nxt in members and nxt not in paths:
                    paths[nxt] = [*paths[node], nxt]
                    frontier.append(nxt)
    return sorted(cycles)


def layer_of(module: str, layers: tuple[tuple[str, ...], ...] = LAYERS) -> int:
    """Index of ``module``'s layer; KeyError for a module no layer names."""
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for i, prefixes in enumerate(layers):
        for prefix in prefixes:
            nested = prefix != "dtrec" and module.startswith(prefix + ".")
            if (module == prefix or nested) and (best is None or len(prefix) > best[0]):
                best = (len(prefix), i)
    if best is None:
        raise KeyError(f"{module} is in no layer: add it to LAYERS in tests/test_layering.py")
    return best[1]


def upward_imports(
    imports: list[Import],
    layers: tuple[tuple[str, ...], ...] = LAYERS,
    allowed: dict[tuple[str, str], str] | None = None,
) -> list[str]:
    """Each import from a lower layer into a higher one, as ``file:line a -> b``."""
    allowed = ALLOWED_UPWARD if allowed is None else allowed
    return [
        f"{i.source}:{i.line} imports {i.target} (layer {layer_of(i.target, layers)} > "
        f"{layer_of(i.source, layers)})"
        for i in imports
        if layer_of(i.target, layers) > layer_of(i.source, layers)
        and (i.source, i.target) not in allowed
    ]


def import_time_edges(imports: list[Import]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for i in imports:
        if i.at_import_time:
            edges.setdefault(i.source, set()).add(i.target)
    return edges


# --------------------------------------------------------------------------- the tree


@pytest.fixture(scope="module")
def dtrec_imports() -> list[Import]:
    return scan(ROOT)


def test_every_module_has_a_layer(dtrec_imports: list[Import]) -> None:
    for path in ROOT.rglob("*.py"):
        layer_of(module_name(path, ROOT))


def test_no_import_cycles(dtrec_imports: list[Import]) -> None:
    cycles = find_cycles(import_time_edges(dtrec_imports))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_function_level_imports_close_no_cycle_either(dtrec_imports: list[Import]) -> None:
    """A lazy import hides a cycle from Python, not from the design."""
    edges: dict[str, set[str]] = {}
    for i in dtrec_imports:
        edges.setdefault(i.source, set()).add(i.target)
    cycles = find_cycles(edges)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_upward_imports(dtrec_imports: list[Import]) -> None:
    found = upward_imports(dtrec_imports)
    assert not found, "imports against the layer order:\n" + "\n".join(found)


def test_allowed_upward_imports_still_exist(dtrec_imports: list[Import]) -> None:
    """An allow-list entry whose import is gone must be deleted, not left to rot."""
    present = {(i.source, i.target) for i in dtrec_imports}
    stale = sorted(set(ALLOWED_UPWARD) - present)
    assert not stale, f"delete these ALLOWED_UPWARD entries, the imports are gone: {stale}"


# --------------------------------------------------------------------------- the checker


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "dtrec"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_checker_finds_a_cycle_and_names_it() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(edges) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_checker_reads_cycles_and_upward_imports_from_source(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "__init__.py": "",
            "ops/__init__.py": "from . import lookup\n",
            "ops/lookup.py": "import dtrec.ops.op\n",
            "ops/op.py": "from dtrec.ops.lookup import x\n",
            "comm/__init__.py": "",
            "comm/a.py": "def f():\n    from dtrec.sharded import b\n",
            "sharded/__init__.py": "",
            "sharded/b.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..comm import a\n"
            ),
        },
    )
    imports = scan(root)
    assert find_cycles(import_time_edges(imports)) == [
        ["dtrec.ops.lookup", "dtrec.ops.op", "dtrec.ops.lookup"]
    ]
    # The comm <-> sharded loop only closes through a lazy and a type-only import.
    everything: dict[str, set[str]] = {}
    for i in imports:
        everything.setdefault(i.source, set()).add(i.target)
    assert ["dtrec.comm.a", "dtrec.sharded.b", "dtrec.comm.a"] in find_cycles(everything)
    assert upward_imports(imports, allowed={}) == [
        f"dtrec.comm.a:2 imports dtrec.sharded.b (layer {layer_of('dtrec.sharded')} > "
        f"{layer_of('dtrec.comm')})"
    ]


def test_checker_layers() -> None:
    assert layer_of("dtrec.ops.backends.triton") == layer_of("dtrec.ops")
    assert layer_of("dtrec._torch_compat") == 0
    assert layer_of("dtrec.planner") == layer_of("dtrec") == len(LAYERS) - 1
    with pytest.raises(KeyError, match="dtrec.newthing is in no layer"):
        layer_of("dtrec.newthing")
