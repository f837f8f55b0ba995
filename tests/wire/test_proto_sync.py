"""The code in fleetprof/_proto is exactly what scripts/gen_proto.sh makes from proto/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

GENERATED_PACKAGES = ["fleetprof/_proto/v1", "fleetprof/_proto/kubelet", "fleetprof/_proto/pyroscope"]


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
    """20-29 belong to the syscall section, 30-39 to the GPU section, 40-49 to the off-CPU section and
    50-59 to the CUDA section; nothing else may take them."""
    from fleetprof._proto.v1 import ingest_pb2 as pb

    by_number = {f.number: f.name for f in pb.Batch.DESCRIPTOR.fields}
    assert all(name.startswith("syscall") for n, name in by_number.items() if 20 <= n < 30)
    assert all(name.startswith("gpu") for n, name in by_number.items() if 30 <= n < 40)
    assert all(name.startswith("offcpu") for n, name in by_number.items() if 40 <= n < 50)
    assert {n for n in by_number if 40 <= n < 50} == {40, 41}
    assert all(name.startswith("cuda") for n, name in by_number.items() if 50 <= n < 60)
    assert {n for n in by_number if 50 <= n < 60} == {50, 51, 52, 53, 54}


# Grafana's datasource and Profiles Drilldown speak Pyroscope's numbers: ours must be the same.
PYROSCOPE_FIELDS = {
    "querier.v1.SelectMergeStacktracesRequest": {
        "profile_typeID": 1,
        "label_selector": 2,
        "start": 3,
        "end": 4,
        "max_nodes": 5,
        "format": 6,
    },
    "querier.v1.SelectMergeStacktracesResponse": {"flamegraph": 1, "tree": 2},
    "querier.v1.FlameGraph": {"names": 1, "levels": 2, "total": 3, "max_self": 4},
    "querier.v1.SelectSeriesRequest": {
        "profile_typeID": 1,
        "label_selector": 2,
        "start": 3,
        "end": 4,
        "group_by": 5,
        "step": 6,
        "aggregation": 7,
        "limit": 9,
    },
    "querier.v1.SeriesRequest": {"matchers": 1, "label_names": 2, "start": 3, "end": 4},
    "querier.v1.SeriesResponse": {"labels_set": 2},
    "types.v1.ProfileType": {
        "ID": 1,
        "name": 2,
        "sample_type": 4,
        "sample_unit": 5,
        "period_type": 6,
        "period_unit": 7,
    },
    "types.v1.Point": {"value": 1, "timestamp": 2},
    "types.v1.LabelValuesRequest": {"name": 1, "matchers": 2, "start": 3, "end": 4},
    "types.v1.LabelNamesRequest": {"matchers": 1, "start": 2, "end": 3},
    "types.v1.GetProfileStatsResponse": {
        "data_ingested": 1,
        "oldest_profile_time": 2,
        "newest_profile_time": 3,
    },
}


@pytest.mark.parametrize("message", sorted(PYROSCOPE_FIELDS))
def test_pyroscope_messages_keep_pyroscopes_field_numbers(message: str) -> None:
    from google.protobuf import descriptor_pool

    from fleetprof._proto.pyroscope import querier_pb2  # noqa: F401 - registers the files

    desc = descriptor_pool.Default().FindMessageTypeByName(message)
    assert {f.name: f.number for f in desc.fields} == PYROSCOPE_FIELDS[message]
