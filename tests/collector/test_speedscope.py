"""Our speedscope output, validated against the file-format schema that the speedscope npm package ships."""

from __future__ import annotations

import json
import subprocess
import tarfile
import tempfile
import urllib.parse
from pathlib import Path

import jsonschema
import pytest

from fleetprof.collector.model.profile import FrameKey
from fleetprof.collector.render.speedscope import to_speedscope
from tests.conftest import REPO, RunningCollector, fleetprof, http_get
from tests.support.profiles import FREQUENCY_HZ, PROFILE, push_profile, wide_rows

# scripts/setup.sh --test puts it here (npm pack speedscope@1.25.0).
SCHEMA = REPO / ".venv" / "share" / "speedscope" / "file-format-schema.json"
SPEEDSCOPE_VERSION = "1.25.0"


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft7Validator:
    path = SCHEMA
    if not path.is_file():  # not set up by setup.sh: fetch the package from the npm registry now
        tmp = Path(tempfile.mkdtemp(prefix="speedscope-"))
        r = subprocess.run(
            ["npm", "pack", "--silent", f"speedscope@{SPEEDSCOPE_VERSION}"],
            cwd=tmp,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if r.returncode != 0:
            pytest.fail(f"no speedscope schema at {SCHEMA} and `npm pack` failed: {r.stderr[-500:]}")
        with tarfile.open(tmp / f"speedscope-{SPEEDSCOPE_VERSION}.tgz") as tar:
            member = tar.extractfile("package/dist/release/file-format-schema.json")
            assert member is not None
            path = tmp / "file-format-schema.json"
            path.write_bytes(member.read())
    schema = json.loads(path.read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def check_file(doc: dict, validator: jsonschema.Draft7Validator) -> dict[str, int]:
    """Validate against the schema, check what the schema cannot say, and return weight per leaf name."""
    errors = sorted(validator.iter_errors(doc), key=str)
    assert not errors, "\n".join(e.message for e in errors[:5])
    frames = doc["shared"]["frames"]
    (profile,) = doc["profiles"]
    assert len(profile["samples"]) == len(profile["weights"])
    assert profile["endValue"] - profile["startValue"] == sum(profile["weights"])
    leaf_weight: dict[str, int] = {}
    for stack, weight in zip(profile["samples"], profile["weights"], strict=True):
        assert stack and all(0 <= i < len(frames) for i in stack)
        name = frames[stack[-1]]["name"]
        leaf_weight[name] = leaf_weight.get(name, 0) + weight
    return leaf_weight


@pytest.fixture(scope="module")
def profiled(module_collector: RunningCollector) -> RunningCollector:
    push_profile(module_collector.grpc_target, PROFILE)
    return module_collector


def fetch(col: RunningCollector, **params: str) -> dict:
    q = urllib.parse.urlencode({"since": "10m", "format": "speedscope", **params})
    return json.loads(http_get(f"{col.url}/api/v1/profile?{q}"))


def test_api_speedscope_matches_the_schema_with_cpu_time_weights(
    profiled: RunningCollector, validator: jsonschema.Draft7Validator
) -> None:
    doc = fetch(profiled)
    leaves = check_file(doc, validator)
    ns = 1_000_000_000 // FREQUENCY_HZ
    assert doc["profiles"][0]["unit"] == "nanoseconds"
    assert leaves == {"hot_loop": 300 * ns, "cold_path": 60 * ns, "sys_read": 40 * ns}
    frames = doc["shared"]["frames"]
    by_name = {(f["name"], f.get("file")) for f in frames}
    assert ("sys_read", "[kernel]") in by_name and ("hot_loop", "/app/worker") in by_name
    # Root first: every stack starts at main.
    assert {frames[s[0]]["name"] for s in doc["profiles"][0]["samples"]} == {"main"}


def test_schema_rejects_a_broken_file(validator: jsonschema.Draft7Validator) -> None:
    """The check is real: the schema catches a wrong unit and a missing field."""
    doc = to_speedscope({(FrameKey("a"),): 1}, 19)
    doc["profiles"][0]["unit"] = "cycles"
    assert list(validator.iter_errors(doc))
    doc = to_speedscope({(FrameKey("a"),): 1}, 19)
    del doc["profiles"][0]["weights"]
    assert list(validator.iter_errors(doc))


def test_unknown_frequency_uses_sample_counts_and_empty_stack_is_kept(
    validator: jsonschema.Draft7Validator,
) -> None:
    doc = to_speedscope({(FrameKey("a", "m"), FrameKey("b", "m")): 5, (): 2}, None)
    assert check_file(doc, validator) == {"b": 5, "[unknown]": 2}
    assert doc["profiles"][0]["unit"] == "none"


def test_max_nodes_keeps_the_total_weight(
    module_collector: RunningCollector, validator: jsonschema.Draft7Validator
) -> None:
    rows = wide_rows(6, 3, comm="wide-speedscope")
    push_profile(module_collector.grpc_target, rows)
    doc = fetch(module_collector, query='{comm="wide-speedscope"}', max_nodes="25")
    leaves = check_file(doc, validator)
    assert sum(leaves.values()) == sum(r[5] for r in rows) * 1_000_000_000 // FREQUENCY_HZ
    assert "other" in leaves
    assert len({tuple(s) for s in doc["profiles"][0]["samples"]}) < len(rows)


def test_flame_cli_picks_speedscope_from_the_double_extension(
    profiled: RunningCollector, tmp_path: Path, validator: jsonschema.Draft7Validator
) -> None:
    out = tmp_path / "cpu.speedscope.json"
    r = fleetprof("flame", "--collector", profiled.url, "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert check_file(json.loads(out.read_text()), validator)["hot_loop"] == 300 * 10**9 // FREQUENCY_HZ
