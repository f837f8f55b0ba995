"""The layout is the architecture: one import namespace, and no stage reaching back upstream or into another
stage's internals. The agent: bpf loaders -> sampler -> resolver -> batch/shipper, with the plain values
they pass each other (agent/model.py) underneath. The collector: ingest ->
store -> query -> serve (HTTP, Pyroscope, the web UI: thin, the store only through QueryService), with
render and metrics beside and the model underneath; models and renderers keep no process-wide state. The
shared modules of fleetprof/ (auth, tls, HTTP, the client) belong to neither side."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

from tests.conftest import REPO

TREES = {
    "fleetprof": REPO / "fleetprof",
    "fleetprof.agent": REPO / "agent",
    "fleetprof.collector": REPO / "collector",
}
AGENT, COLLECTOR = "fleetprof.agent", "fleetprof.collector"

# What each part of the collector may import from the rest of the collector (itself always), as module
# names or packages under fleetprof.collector. main.py wires the parts and may import any of them.
ALLOWED = {
    "model": (),  # plain values: imports no other part
    # the store interface it writes to, and the dedupe state of a store that keeps none itself
    "ingest": ("model", "store.base", "store.sequences"),
    "store": ("model",),
    "query": ("model", "store.base"),  # the store's protocol, never a store
    "render": ("model",),
    "serve": ("model", "query", "render"),  # parse, ask the query stage, render: never the store
    # The store's protocol, which it wraps to time queries (metrics/queries.py); what it reads of ingest
    # is plain values (model/counters.py) behind a protocol of its own (metrics/ingest.py).
    "metrics": ("model", "store.base"),
}

# The agent's stages in the order a sample travels them: a module may import its own stage and earlier
# ones, never a later one. A module belongs to the stage whose entry names it most closely (python.offsets
# before python); agent/main.py wires the stages and may import any of them.
AGENT_STAGES = (
    # The plain values that cross stages (drains, processes, frames, GPU polls, the resolved window): first,
    # so that every stage may import it; it imports none of them (test below).
    ("model", ("model",)),
    # BCC and the kernel, and what the BPF programs share with user space: maps, offsets, unwind tables,
    # the kernel's syscall numbers
    (
        "bpf",
        (
            "bpf",
            "kernel",
            "kernel_btf",
            "bpfmaps",
            "memory",
            "offcpu",
            "python.offsets",
            "unwind.kernel_maps",
            "syscall_table",
            "syscall_names",
            "cuda_api",
            "scope",
        ),
    ),
    # load the BPF programs and drain their maps (the CUDA uprobes are the sampler's: one BPF object)
    ("sampler", ("sampler", "syscalls", "cuda_probes")),
    # pid -> process and pod, addresses -> symbols (native, Python, kernel), GPU state and its owners
    (
        "resolver",
        ("resolver", "attribution", "process", "symbols", "python", "unwind", "kube", "gpu", "cupti"),
    ),
    ("ship", ("batch", "shipper", "metrics")),  # encode, spool, gRPC; and the agent's own metrics
)
# The BPF loaders: they own BCC objects. Only agent/main.py (which wires them) imports them; the other stages
# take what they drain as agent/model.py values, never their types from a loader.
BPF_LOADERS = (f"{AGENT}.sampler", f"{AGENT}.syscalls", f"{AGENT}.cuda_probes")
# fleetprof/'s own modules other than these are shared by both sides (auth, tls, httpserve, httprequest,
# client, gpu_families, procname): they never import the agent or the collector.
NOT_SHARED = ("agent", "collector", "cli", "_proto")


def modules(package: str, root: Path) -> dict[str, Path]:
    out = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        if "_proto" in parts:
            continue
        out[".".join([package, *parts])] = path
    return out


ALL = {name: path for package, root in TREES.items() for name, path in modules(package, root).items()}


def imports_of(path: Path) -> set[str]:
    """The modules a file imports, anywhere in it; `from package import module` counts as the module."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in ALL)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def shared(name: str) -> bool:
    """A module of fleetprof/ itself: not the agent's or the collector's, the CLI or generated code."""
    return name.startswith("fleetprof") and name.split(".")[1:2] not in [[p] for p in NOT_SHARED]


def within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def agent_stage(name: str) -> int | None:
    """The index in AGENT_STAGES of an agent module (fleetprof.agent.X), by its most specific entry."""
    rel = name.removeprefix(AGENT + ".")
    best: tuple[int, int] | None = None  # (entry length, stage)
    for i, (_, entries) in enumerate(AGENT_STAGES):
        for entry in entries:
            if within(rel, (entry,)) and (best is None or len(entry) > best[0]):
                best = (len(entry), i)
    return None if best is None else best[1]


def test_pyproject_installs_every_package_of_the_tree_under_fleetprof_alone() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    declared = set(config["packages"])
    in_tree = set()
    for package, root in TREES.items():
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root)
            in_tree.add(".".join([package, *rel.parts]))
    assert declared == in_tree
    assert {p.split(".")[0] for p in declared} == {"fleetprof"}
    assert config["package-dir"] == {
        "fleetprof": "fleetprof",
        "fleetprof.agent": "agent",
        "fleetprof.collector": "collector",
    }


@pytest.mark.parametrize("name", sorted(n for n in ALL if n.startswith(AGENT)))
def test_the_agent_never_imports_the_collector(name: str) -> None:
    assert not {m for m in imports_of(ALL[name]) if within(m, (COLLECTOR,))}


@pytest.mark.parametrize("name", sorted(n for n in ALL if n.startswith(AGENT + ".") and n != f"{AGENT}.main"))
def test_agent_stages_import_no_later_stage(name: str) -> None:
    mine = agent_stage(name)
    assert mine is not None, f"{name} is in no stage: add it to AGENT_STAGES"
    later = {
        m: AGENT_STAGES[agent_stage(m)][0]  # type: ignore[index]
        for m in imports_of(ALL[name])
        if within(m, (AGENT,)) and m != AGENT and agent_stage(m) is not None and agent_stage(m) > mine
    }
    assert not later, f"{name} ({AGENT_STAGES[mine][0]}) imports later stages: {later}"


def test_the_agent_model_imports_no_agent_module() -> None:
    """agent/model.py is plain values: every stage may import it because it imports none of them."""
    assert not {m for m in imports_of(ALL[f"{AGENT}.model"]) if within(m, (AGENT,))}


@pytest.mark.parametrize(
    "name",
    sorted(n for n in ALL if n.startswith(AGENT + ".") and n not in (f"{AGENT}.main", *BPF_LOADERS)),
)
def test_no_agent_stage_imports_a_bpf_loader(name: str) -> None:
    used = {m for m in imports_of(ALL[name]) if within(m, BPF_LOADERS)}
    assert not used, f"{name} imports {sorted(used)}: take the values from {AGENT}.model"


@pytest.mark.parametrize(
    "name", sorted(n for n in ALL if n.startswith(COLLECTOR + ".") and n != f"{COLLECTOR}.main")
)
def test_collector_parts_import_only_what_their_rule_allows(name: str) -> None:
    part = name.split(".")[2]
    assert part in ALLOWED, f"{name} is in no part of the collector: add a rule for {part!r} to ALLOWED"
    used = {m.removeprefix(COLLECTOR + ".") for m in imports_of(ALL[name]) if m.startswith(COLLECTOR + ".")}
    bad = sorted(m for m in used if m.split(".")[0] != part and not within(m, ALLOWED[part]))
    assert not bad, f"{name} imports {bad}; {part} may import {ALLOWED[part] or 'nothing'} of the collector"


def _store_taking(path: Path) -> set[str]:
    """The top-level functions and classes of a module that take a ProfileStore (a parameter of theirs, or
    of a class's __init__, annotated with it): the ways to the store's data."""
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef):
            init = [f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"]
            args = init[0].args if init else None
        elif isinstance(node, ast.FunctionDef):
            args = node.args
        else:
            continue
        params = [*args.posonlyargs, *args.args, *args.kwonlyargs] if args else []
        if any(a.annotation is not None and "ProfileStore" in ast.unparse(a.annotation) for a in params):
            out.add(node.name)
    return out


@pytest.mark.parametrize("name", sorted(n for n in ALL if n.startswith(f"{COLLECTOR}.serve.")))
def test_serve_adapters_reach_the_store_only_through_the_query_service(name: str) -> None:
    """The HTTP API, the Pyroscope/Connect API and the web UI are thin: they parse, ask QueryService and
    render. No store (the import rule above), and of the query stage nothing else that takes the store
    (query/typed.py's views, query/labels.py's listings): what a question means lives in the query stage."""
    used = set()
    for node in ast.walk(ast.parse(ALL[name].read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and within(node.module, (f"{COLLECTOR}.query",)):
            door = _store_taking(ALL[node.module]) - {"QueryService"}
            used.update(f"{node.module}.{a.name}" for a in node.names if a.name in door)
    assert not used, f"{name} takes the store past QueryService: {sorted(used)}"


def test_the_store_protocol_is_taken_where_the_rules_say() -> None:
    """The check above sees the ways to the store it is meant to forbid (it would pass on a rule that finds
    nothing)."""
    assert {"TypedStore"} <= _store_taking(ALL[f"{COLLECTOR}.query.typed"])
    assert {"label_names", "notes"} <= _store_taking(ALL[f"{COLLECTOR}.query.labels"])
    assert "QueryService" in _store_taking(ALL[f"{COLLECTOR}.query.service"])


@pytest.mark.parametrize(
    "name",
    sorted(n for n in ALL if within(n, (f"{COLLECTOR}.model", f"{COLLECTOR}.render", f"{AGENT}.model"))),
)
def test_the_models_and_renderers_keep_no_process_wide_state(name: str) -> None:
    """Content-id keys, frame caches and the demangler are objects that main builds and passes down: no
    module of the models or the renderers rebinds a global of its own."""
    rebinds = [n.names for n in ast.walk(ast.parse(ALL[name].read_text())) if isinstance(n, ast.Global)]
    assert not rebinds, f"{name} rebinds module globals {rebinds}: make them an object main passes down"


@pytest.mark.parametrize(
    "name",
    sorted(
        n for n in ALL if n.startswith("fleetprof") and n.split(".")[1:2] not in ([p] for p in NOT_SHARED)
    ),
)
def test_shared_modules_never_import_the_agent_the_collector_or_the_cli(name: str) -> None:
    assert not {m for m in imports_of(ALL[name]) if within(m, (AGENT, COLLECTOR, "fleetprof.cli"))}


def test_the_rules_cover_what_they_claim() -> None:
    """The rules above are checked against real modules: each shared module named in the docstring exists,
    and the main modules that may import anything are the two that wire a side."""
    named = {f"fleetprof.{m}" for m in ("auth", "tls", "httpserve", "httprequest", "client")}
    assert named <= {n for n in ALL if shared(n)}
    assert {f"{AGENT}.main", f"{COLLECTOR}.main"} <= set(ALL)
    assert {n.split(".")[2] for n in ALL if n.startswith(COLLECTOR + ".")} == {*ALLOWED, "main"}
    # The collector's order: nothing below the readers imports them (the query stage no serve adapter), and
    # the query stage and metrics see the store only through its protocol.
    assert [part for part, allowed in ALLOWED.items() if "serve" in allowed] == []
    assert ALLOWED["query"] == ALLOWED["metrics"] == ("model", "store.base")
    assert "store" not in ALLOWED["serve"] and "ingest" not in ALLOWED["serve"]
