#!/usr/bin/env bash
# Regenerates the Python code for the protos under proto/: our wire contract (proto/fleetprof/v1 →
# fleetprof/v1/) and our copy of the kubelet's PodResources API (proto/fleetprof/kubelet →
# fleetprof/kubelet/). Each proto sits at the path of the Python package it generates into, so the
# generated `from fleetprof.<pkg> import ..._pb2` imports resolve. tests/test_proto_sync.py fails when
# the checked-in code differs from what this produces.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${1:-.}
"$PY" -m grpc_tools.protoc -I proto --python_out="$OUT" --grpc_python_out="$OUT" --pyi_out="$OUT" \
  proto/fleetprof/v1/*.proto proto/fleetprof/kubelet/*.proto
touch "$OUT/fleetprof/v1/__init__.py" "$OUT/fleetprof/kubelet/__init__.py"
