"""The benchmarks' import rules, checked from their source: every import statement under
benchmarks/ (at the top of a module or inside a function) is parsed, and the graph they make must
have no cycle; shared/ imports no kind of benchmark; each kind imports shared/, its own modules and
the kinds ALLOWED names, nothing else; nothing imports __main__, the `batchwire bench` front.
Imports name the installed package (batchwire.benchmarks...): a relative import would hide its
arrow from this parse, and the bare `benchmarks` name only resolves from the repository root."""

from __future__ import annotations

import ast
import graphlib

from batchwire.benchmarks.__main__ import BENCHMARKS as SUBCOMMANDS

from tests.test_layers import ROOT, graph

PACKAGE = "batchwire.benchmarks"
FOLDER = ROOT / "benchmarks"
MODULES = graph(PACKAGE, FOLDER)

# kind (a sub-package, or one of the package's own two files) -> the other kinds it may import.
ALLOWED: dict[str, set[str]] = {
    "__init__": set(),
    "shared": set(),
    "serving": {"shared"},
    "offline": {"shared"},
    "engine": {"shared", "serving"},  # overhead drives a `batchwire serve` with the load generator
    "reliability": {"shared", "serving"},  # soak reports its latency as the serving metrics do
    "gpu": {"shared"},
    "__main__": {"shared", "serving", "offline", "engine", "reliability"},
}


def kind(module: str) -> str:
    return module.removeprefix(PACKAGE).lstrip(".").split(".")[0] or "__init__"


def arrows() -> list[tuple[str, str]]:
    """(importer, imported) for each import of one benchmarks module by another; a module's
    arrow to a package above it (`from batchwire.benchmarks.engine import step`) is not one."""
    return sorted((module, name) for module, names in MODULES.items() for name in names
                  if name in MODULES and name != module and not module.startswith(name + "."))


def test_the_import_graph_has_no_cycle():
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, imported in arrows():
        edges[module].add(imported)
    try:
        graphlib.TopologicalSorter(edges).prepare()
    except graphlib.CycleError as e:
        raise AssertionError("import cycle: " + " -> ".join(e.args[1])) from None


def test_the_allowed_arrows_between_kinds_have_no_cycle():
    graphlib.TopologicalSorter(ALLOWED).prepare()


def test_each_arrow_between_kinds_is_allowed():
    wrong = [f"{a} ({kind(a)}) imports {b} ({kind(b)})" for a, b in arrows()
             if kind(a) != kind(b) and kind(b) not in ALLOWED[kind(a)]]
    assert not wrong, "\n".join(wrong)


def test_every_module_is_in_a_known_kind():
    assert {kind(m) for m in MODULES} <= set(ALLOWED), sorted({kind(m) for m in MODULES})


def test_imports_name_the_installed_package():
    wrong = []
    for path in sorted(FOLDER.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level:
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} relative import")
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            wrong += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names
                      if n.split(".")[0] == "benchmarks"]
    assert not wrong, "\n".join(wrong)


def test_each_bench_subcommand_names_a_module_of_the_package():
    assert {name: f"{PACKAGE}.{module}" in MODULES for name, (module, _) in SUBCOMMANDS.items()
            } == dict.fromkeys(SUBCOMMANDS, True)
