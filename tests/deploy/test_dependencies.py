"""Each image installs only its own part's dependencies: pyproject.toml's common list plus the `agent` or the
`collector` extra (deploy/Dockerfile.*). This venv holds every one of them, so an import the agent image
lacks would fail on a node and never here; these tests read the imports of each part's source instead,
top-level and lazy ones alike, and hold them against the lists that part's image installs."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest

from tests.conftest import REPO

# Not from PyPI: Debian's python3-bpfcc, which the agent image installs with apt (and setup.sh links in).
FROM_DEBIAN = {"bcc"}
# The standard library of Pythons newer than this one, imported where present (agent/symbols/elf.py: zstd).
NEWER_STDLIB = {"compression"}
# Each part's source folders. fleetprof/ (the CLI, TLS, tokens, the HTTP server, the generated wire code)
# runs in both images, so it may import only the common list.
PARTS = {
    "agent": ["agent"],
    "collector": ["collector"],
    "common": ["fleetprof"],
}


def _normalized(requirement: str) -> str:
    """The distribution's name of a requirement line ("google-re2>=1.1" -> "google-re2"), PEP 503 form."""
    name = re.match(r"[A-Za-z0-9._-]+", requirement).group(0)
    return re.sub(r"[-_.]+", "-", name).lower()


def _lists() -> dict[str, set[str]]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    common = {_normalized(r) for r in project["dependencies"]}
    extras = project["optional-dependencies"]
    return {
        "common": common,
        "agent": common | {_normalized(r) for r in extras["agent"]},
        "collector": common | {_normalized(r) for r in extras["collector"]},
    }


def _imported_modules(folder: Path) -> dict[str, str]:
    """Names of the modules imported under `folder` (dotted, as written) -> one file importing it, counting
    `import x`, `from x import y` (absolute only) and `importlib.import_module("x")`."""
    found: dict[str, str] = {}
    for path in sorted(folder.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "import_module"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                names = [node.args[0].value]
            for name in names:
                found.setdefault(name, str(path.relative_to(REPO)))
    return found


def _third_party(modules: dict[str, str]) -> dict[str, str]:
    """Distribution (PEP 503 name) -> a file of the part importing it, for modules neither the standard
    library's, fleetprof's own, nor Debian's."""
    owners = importlib.metadata.packages_distributions()
    out: dict[str, str] = {}
    for module, where in modules.items():
        top = module.split(".")[0]
        if top in sys.stdlib_module_names or top in NEWER_STDLIB | FROM_DEBIAN or top == "fleetprof":
            continue
        dists = owners.get(top, [])
        if len(dists) > 1:  # a namespace package (google.protobuf beside other google.*): who has this one
            dists = [d for d in dists if _provides(d, module)] or dists
        assert dists, f"{where} imports {module!r}, which no installed distribution provides"
        for dist in dists:
            out.setdefault(_normalized(dist), where)
    return out


def _provides(dist: str, module: str) -> bool:
    """Whether distribution `dist` installs files under the package path of `module` (its first two parts)."""
    prefix = "/".join(module.split(".")[:2])
    return any(str(f).startswith(prefix + "/") for f in importlib.metadata.distribution(dist).files or ())


def _imports_of(part: str) -> dict[str, str]:
    modules: dict[str, str] = {}
    for folder in PARTS[part]:
        for module, where in _imported_modules(REPO / folder).items():
            modules.setdefault(module, where)
    return _third_party(modules)


@pytest.mark.parametrize("part", sorted(PARTS))
def test_every_package_a_part_imports_is_in_what_its_image_installs(part: str) -> None:
    installs = _lists()[part]
    missing = {dist: where for dist, where in _imports_of(part).items() if dist not in installs}
    assert not missing, (
        f"the {part}'s code imports packages its image does not install (dist: a file importing it): "
        f"{missing}; list them in pyproject.toml ({'dependencies' if part == 'common' else part + ' extra'})"
    )


def test_every_listed_package_is_imported_by_each_part_that_installs_it() -> None:
    """Nothing rides along unused: a package of an extra is imported by that part, and one of the common
    list by the agent and by the collector (each with the fleetprof/ modules both of them run)."""
    lists = _lists()
    common_imports = set(_imports_of("common"))
    for part in ("agent", "collector"):
        imported = set(_imports_of(part)) | common_imports
        unused = lists[part] - imported
        assert not unused, f"the {part} image installs {sorted(unused)}, which no {part} code imports"


def test_the_images_install_the_lists_these_tests_check() -> None:
    """The Dockerfiles read their requirements from pyproject.toml's common list and their own extra."""
    for part in ("agent", "collector"):
        dockerfile = (REPO / "deploy" / f"Dockerfile.{part}").read_text()
        assert 'p["dependencies"]' in dockerfile, part
        extras = set(re.findall(r'p\["optional-dependencies"\]\["(\w+)"\]', dockerfile))
        assert extras == {part}, (part, extras)
