#!/usr/bin/env bash
# Regenerates the Python code for the protos under proto/: our wire contract (proto/fleetprof/v1 →
# fleetprof/_proto/v1/), our copy of the kubelet's PodResources API (proto/fleetprof/kubelet →
# fleetprof/_proto/kubelet/) and our subset of Grafana Pyroscope's query API (proto/fleetprof/pyroscope →
# fleetprof/_proto/pyroscope/). protoc sees proto/fleetprof as the virtual path fleetprof/_proto, so the
# generated `from fleetprof._proto.<pkg> import ..._pb2` imports resolve; the protos' packages (the
# names on the wire, e.g. fleetprof.v1.Ingest) do not change. tests/wire/test_proto_sync.py fails when the
# checked-in code differs from what this produces.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${1:-.}
"$PY" -m grpc_tools.protoc -Ifleetprof/_proto=proto/fleetprof \
  --python_out="$OUT" --grpc_python_out="$OUT" --pyi_out="$OUT" \
  proto/fleetprof/v1/*.proto proto/fleetprof/kubelet/*.proto proto/fleetprof/pyroscope/*.proto
touch "$OUT/fleetprof/_proto/v1/__init__.py" "$OUT/fleetprof/_proto/kubelet/__init__.py" \
  "$OUT/fleetprof/_proto/pyroscope/__init__.py"
