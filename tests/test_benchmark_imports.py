"""Benchmarks share one harness and never import each other (issue 46).

Every module under ``benchmarks/`` may import ``benchmarks.common`` (workloads, the
TorchRec side, the run loop, report helpers), ``benchmarks.probes`` (the measuring
instruments) and the modules of its own package (``benchmarks/soak/run.py`` reads
``benchmarks.soak.model``); nothing else of ``benchmarks``. ``common`` imports only
``common`` and ``probes``, ``probes`` only ``probes``. Imports inside functions count.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"


def _module(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every ``benchmarks.*`` module ``path`` imports (``from benchmarks import x`` as
    ``benchmarks.x``), at any depth of the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("benchmarks.")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "benchmarks":
                found |= {f"benchmarks.{a.name}" for a in node.names}
            elif node.module.startswith("benchmarks."):
                found.add(node.module)
    return found


def _graph() -> dict[str, tuple[str, set[str]]]:
    """Module name -> (its path from the repository root, the benchmarks modules it imports)."""
    paths = [p for p in BENCHMARKS.rglob("*.py") if "results" not in p.parts]
    return {_module(p): (str(p.relative_to(REPO)), _imports(p)) for p in paths}


def _allowed(module: str, target: str) -> bool:
    def within(name: str, package: str) -> bool:
        return name == package or name.startswith(package + ".")

    if within(module, "benchmarks.probes"):
        return within(target, "benchmarks.probes")
    if within(target, "benchmarks.common") or within(target, "benchmarks.probes"):
        return True
    parts = module.split(".")
    # a module of a benchmark package (benchmarks/<pkg>/<m>.py) may import its own package
    return len(parts) > 2 and within(target, ".".join(parts[:2]))


def test_benchmarks_import_only_the_harness() -> None:
    graph = _graph()
    bad = [
        f"{path} imports {target}"
        for module, (path, targets) in sorted(graph.items())
        for target in sorted(targets)
        if not _allowed(module, target)
    ]
    assert not bad, "benchmarks import other benchmarks:\n" + "\n".join(bad)


def test_no_import_cycle() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module][1]):
            target = next((m for m in (target, target.rpartition(".")[0]) if m in graph), None)
            if target is None or state.get(target) == 2:
                continue
            assert state.get(target) != 1, "import cycle: " + " -> ".join([*path, target])
            visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_the_rule_catches_a_benchmark_importing_another(tmp_path) -> None:
    """The checker itself: a cross import and a common -> benchmark import are refused."""
    assert not _allowed("benchmarks.planner", "benchmarks.distributed")
    assert not _allowed("benchmarks.common.run_loop", "benchmarks.distributed")
    assert not _allowed("benchmarks.probes.stages", "benchmarks.common.workloads")
    assert not _allowed("benchmarks.dynamic_2d.run", "benchmarks.soak.model")
    assert _allowed("benchmarks.dynamic_2d.run", "benchmarks.dynamic_2d.model")
    source = tmp_path / "x.py"
    source.write_text(
        "def f():\n    from benchmarks import gpu_step\n    import benchmarks.kernels\n"
    )
    assert _imports(source) == {"benchmarks.gpu_step", "benchmarks.kernels"}
