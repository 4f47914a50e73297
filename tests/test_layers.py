"""The scheduler service's layers, checked from its source: every import statement (at the top of a
module or inside a function) is parsed, and the graph they make must have no cycle, no arrow from
a lower layer to a higher one, and no path to torch or worker_svc except through the in-process
executor. docs/architecture.md draws the same map."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Lower number = lower layer; a module may import its own layer's modules and lower layers only.
# core and executors are peers that must not import each other.
LAYERS = {
    "config": 0,
    "core": 1,
    "executors": 1,
    "engine": 2,
    "service": 3,
    "cli": 4,
    "__init__": 5,  # the package's front door: LLM, SamplingParams
}
HEAVY = ("torch", "worker_svc")  # what a scheduler driving remote workers must never load
ALLOWED_HEAVY = {"scheduler_svc.executors.uni"}  # builds the in-process worker


def module_name(path: pathlib.Path, root: pathlib.Path, package: str) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([package, *parts])


def imports_of(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def graph(package: str, folder: pathlib.Path) -> dict[str, set[str]]:
    """module -> the modules it imports, for every module under folder (named as package)."""
    modules = {module_name(p, folder, package): p for p in folder.rglob("*.py")}
    return {m: imports_of(p) for m, p in modules.items()}


SCHEDULER = graph("scheduler_svc", ROOT / "scheduler_svc")
COMMON = graph("batchwire.common", ROOT / "common")


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_no_arrow_goes_up_a_layer():
    wrong = []
    for module, imported in SCHEDULER.items():
        for target in imported:
            if target in SCHEDULER and target != module:
                a, b = layer(module), layer(target)
                if a != b and (LAYERS[b] > LAYERS[a] or LAYERS[b] == LAYERS[a]):
                    wrong.append(f"{module} ({a}) imports {target} ({b})")
    assert not wrong, "\n".join(sorted(wrong))


def test_the_import_graph_has_no_cycle():
    edges = {m: {t for t in imported if t in SCHEDULER and t != m}
             for m, imported in SCHEDULER.items()}
    # A package's __init__ may re-export its modules; only module-to-module arrows count.
    edges = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in edges.items()}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    cycle: list[str] = []

    def visit(m: str, path: list[str]) -> bool:
        state[m] = 1
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                cycle.extend([*path[path.index(t):], t] if t in path else [m, t])
                return True
            if t not in state and visit(t, [*path, t]):
                return True
        state[m] = 2
        return False

    for m in sorted(edges):
        if m not in state and visit(m, [m]):
            break
    assert not cycle, " -> ".join(cycle)


def heavy(names: set[str]) -> set[str]:
    return {n for n in names if n.split(".")[0] in HEAVY}


def test_only_the_in_process_executor_reaches_torch_or_the_worker():
    reached = {m: heavy(names) for m, names in SCHEDULER.items() if m not in ALLOWED_HEAVY}
    assert {m: h for m, h in reached.items() if h} == {}
    assert {n.split(".")[1] for n in heavy(SCHEDULER["scheduler_svc.executors.uni"])} == {"worker"}


def test_what_both_services_share_imports_neither_service_nor_torch():
    for module, names in COMMON.items():
        bad = {n for n in names if n.split(".")[0] in (*HEAVY, "scheduler_svc")}
        assert not bad, f"{module} imports {sorted(bad)}"


def test_every_scheduler_module_is_in_a_known_layer():
    assert {layer(m) for m in SCHEDULER} <= set(LAYERS)
