"""The layout is the architecture: one import namespace, and no stage reaching back upstream or into another
stage's internals (agent → wire → collector: ingest → store → query → render; the model underneath)."""

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

# What each part of the collector may import from the collector (itself always).
ALLOWED = {
    "model": set(),
    "ingest": {"model", "store"},  # the store interface it writes to
    "store": {"model"},
    "query": {"model", "store"},  # the typed views over the store interface
    "render": {"model"},
    "metrics": {"model", "ingest", "store"},  # reads ingest's counters and wraps the store to time queries
}


def modules(package: str, root: Path) -> dict[str, Path]:
    out = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        if "_proto" in parts:
            continue
        out[".".join([package, *parts])] = path
    return out


def imports_of(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


ALL = {name: path for package, root in TREES.items() for name, path in modules(package, root).items()}


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


@pytest.mark.parametrize("name", sorted(n for n in ALL if n.startswith("fleetprof.agent")))
def test_the_agent_never_imports_the_collector(name: str) -> None:
    assert not {m for m in imports_of(ALL[name]) if m.startswith("fleetprof.collector")}


@pytest.mark.parametrize("name", sorted(n for n in ALL if n.startswith("fleetprof.collector.")))
def test_collector_stages_import_only_downstream_and_the_model(name: str) -> None:
    part = name.split(".")[2]
    if part not in ALLOWED:
        return  # main.py wires the stages; serve/ answers queries and renders: they may use any part
    used = {m.split(".")[2] for m in imports_of(ALL[name]) if m.startswith("fleetprof.collector.")}
    assert used - {part} <= ALLOWED[part], f"{name} imports {sorted(used - {part} - ALLOWED[part])}"
