#!/usr/bin/env bash
# Regenerates the Python code for the wire contract (proto/ → fleetprof/v1/). tests/test_proto_sync.py
# fails when the checked-in code differs from what this produces.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${1:-.}
"$PY" -m grpc_tools.protoc -I proto --python_out="$OUT" --grpc_python_out="$OUT" --pyi_out="$OUT" \
  proto/fleetprof/v1/*.proto
touch "$OUT/fleetprof/v1/__init__.py"
