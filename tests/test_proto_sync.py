"""The code in fleetprof/_proto is exactly what scripts/gen_proto.sh makes from proto/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

GENERATED_PACKAGES = ["fleetprof/_proto/v1", "fleetprof/_proto/kubelet"]


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gen")
    subprocess.run(
        ["bash", str(REPO / "scripts" / "gen_proto.sh"), str(out)],
        check=True,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )
    return out


@pytest.mark.parametrize("package", GENERATED_PACKAGES)
def test_generated_code_matches_the_proto_sources(fresh: Path, package: str) -> None:
    generated = sorted(p.relative_to(fresh) for p in (fresh / package).glob("*.py*"))
    checked_in = sorted(p.relative_to(REPO) for p in (REPO / package).glob("*.py*"))
    assert generated, f"gen_proto.sh made nothing under {package}"
    assert generated == checked_in, "files differ: run `make proto`"
    for rel in generated:
        assert (fresh / rel).read_text() == (REPO / rel).read_text(), f"{rel} is stale: run `make proto`"


def test_sections_keep_their_field_ranges() -> None:
    """20-29 belong to the syscall section and 30-39 to the GPU section; nothing else may take them."""
    from fleetprof._proto.v1 import ingest_pb2 as pb

    by_number = {f.number: f.name for f in pb.Batch.DESCRIPTOR.fields}
    assert all(name.startswith("syscall") for n, name in by_number.items() if 20 <= n < 30)
    assert all(name.startswith("gpu") for n, name in by_number.items() if 30 <= n < 40)
