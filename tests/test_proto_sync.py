"""The generated wire code in fleetprof/v1 is exactly what scripts/gen_proto.sh makes from proto/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def test_generated_code_matches_the_proto_sources(tmp_path: Path) -> None:
    subprocess.run(
        ["bash", str(REPO / "scripts" / "gen_proto.sh"), str(tmp_path)],
        check=True,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )
    generated = sorted(p.relative_to(tmp_path) for p in (tmp_path / "fleetprof" / "v1").glob("*.py*"))
    checked_in = sorted(p.relative_to(REPO) for p in (REPO / "fleetprof" / "v1").glob("*.py*"))
    assert generated == checked_in, "files differ: run `make proto`"
    for rel in generated:
        assert (tmp_path / rel).read_text() == (REPO / rel).read_text(), f"{rel} is stale: run `make proto`"


def test_reserved_sections_stay_reserved() -> None:
    """Fields 20-39 are promised to the syscall and GPU sections; nothing else may take them."""
    from fleetprof.v1 import ingest_pb2 as pb

    numbers = {f.number for f in pb.Batch.DESCRIPTOR.fields}
    assert not numbers & set(range(20, 40))
    assert "reserved 20 to 39" in (REPO / "proto" / "fleetprof" / "v1" / "ingest.proto").read_text()
