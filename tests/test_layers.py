"""The two services' layers, checked from their source: every import statement (at the top of a
module or inside a function) is parsed, and the graph each service's imports make must have no
cycle and no arrow from a lower layer to a higher one (nor between two peers of one layer). The
scheduler reaches torch or worker_svc only through the in-process executor; the worker never
imports the scheduler. docs/architecture.md draws the same maps."""

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
# The worker's layers: what a step needs is below what runs it, which is below what serves it.
# parallel/ and sample/ are peers, as are models/ and batch/, and loaders/, spec_decode/, pooling/.
WORKER_LAYERS = {
    "model_config": 0,  # an architecture's shape, read from config.json or GGUF metadata
    "parallel": 1,  # tensor-parallel shards, pipeline stages
    "sample": 1,  # logits shaping, the sampler, its metadata, the sampled tokens' wire
    "models": 2,  # the model code and the step's attention context it reads
    "batch": 2,  # the persistent batch, block table, host staging, the step's checks
    "quant": 2,  # quantized weights: GGUF codes and scales, int4 / int8 linear layers
    "loaders": 3,  # weights from GGUF or safetensors into a model
    "native": 3,  # the native CPU decode step (C), built from a model and its stored weights
    "spec_decode": 3,  # a verifying step's layout, rejection sampling, its reply
    "pooling": 3,  # embeddings from final hidden states
    "batch_invariant": 3,  # fixed-shape linears and attention for --batch-invariant
    "lora": 3,  # LoRA adapters: PEFT files, the model's adapter slots, a step's adapters
    "runner": 4,  # ModelRunner (ExecuteModel, SampleTokens), prompt logprobs, Worker
    "server": 5,  # gRPC and ZMQ servers, servicer, registration, group launcher, options
    "__main__": 6,  # python -m worker_svc
    "__init__": 6,
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
WORKER = graph("worker_svc", ROOT / "worker_svc")
COMMON = graph("batchwire.common", ROOT / "common")


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def upward_arrows(imports: dict[str, set[str]], layers: dict[str, int]) -> list[str]:
    """Every arrow into a higher layer, or across to another folder of the same layer."""
    wrong = []
    for module, imported in imports.items():
        for target in imported:
            if target in imports and target != module:
                a, b = layer(module), layer(target)
                if a != b and layers[b] >= layers[a]:
                    wrong.append(f"{module} ({a}) imports {target} ({b})")
    return sorted(wrong)


def a_cycle(imports: dict[str, set[str]]) -> list[str]:
    """One import cycle between modules (empty when there is none)."""
    edges = {m: {t for t in names if t in imports and t != m} for m, names in imports.items()}
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
    return cycle


def test_no_arrow_goes_up_a_layer():
    assert not (wrong := upward_arrows(SCHEDULER, LAYERS)), "\n".join(wrong)


def test_the_import_graph_has_no_cycle():
    assert not (cycle := a_cycle(SCHEDULER)), " -> ".join(cycle)


def heavy(names: set[str]) -> set[str]:
    return {n for n in names if n.split(".")[0] in HEAVY}


def test_only_the_in_process_executor_reaches_torch_or_the_worker():
    reached = {m: heavy(names) for m, names in SCHEDULER.items() if m not in ALLOWED_HEAVY}
    assert {m: h for m, h in reached.items() if h} == {}
    uni = heavy(SCHEDULER["scheduler_svc.executors.uni"])
    assert {n for n in uni if n.startswith("worker_svc")} == {
        "worker_svc.runner.worker", "worker_svc.runner.worker.Worker"}


def test_what_both_services_share_imports_neither_service_nor_torch():
    for module, names in COMMON.items():
        bad = {n for n in names if n.split(".")[0] in (*HEAVY, "scheduler_svc")}
        assert not bad, f"{module} imports {sorted(bad)}"


def test_every_scheduler_module_is_in_a_known_layer():
    assert {layer(m) for m in SCHEDULER} <= set(LAYERS)


def test_no_worker_arrow_goes_up_a_layer():
    assert not (wrong := upward_arrows(WORKER, WORKER_LAYERS)), "\n".join(wrong)


def test_the_worker_import_graph_has_no_cycle():
    assert not (cycle := a_cycle(WORKER)), " -> ".join(cycle)


def test_the_worker_never_imports_the_scheduler():
    reached = {m: {n for n in names if n.split(".")[0] == "scheduler_svc"}
               for m, names in WORKER.items()}
    assert {m: names for m, names in reached.items() if names} == {}


def test_every_worker_module_is_in_a_known_layer():
    assert {layer(m) for m in WORKER} <= set(WORKER_LAYERS)


def test_the_rules_catch_an_arrow_up_and_a_cycle():
    """The checks themselves: a sampler that imported the runner would be both."""
    broken = {**WORKER, "worker_svc.sample.sampler": WORKER["worker_svc.sample.sampler"]
              | {"worker_svc.runner.model_runner"}}
    assert upward_arrows(broken, WORKER_LAYERS) == [
        "worker_svc.sample.sampler (sample) imports worker_svc.runner.model_runner (runner)"]
    assert a_cycle(broken)[0] == a_cycle(broken)[-1]
