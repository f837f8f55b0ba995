#!/usr/bin/env bash
# Builds libfleetprof_cupti.so (agent/cupti/) against NVIDIA's CUPTI and CUDA headers from their PyPI wheels.
#   scripts/build_cupti.sh [--out FILE] [--cache DIR] [--force] [--print-cache]
# --out    the library to write (default .venv/lib/fleetprof/libfleetprof_cupti.so)
# --cache  where the wheels' headers and libraries are unpacked (default .venv/share/cuda-wheels, or
#          /var/cache/fleetprof/cuda-wheels when there is no .venv); kept between runs
# Rebuilds only when the sources, the flags or the header versions changed (a stamp beside the library).
# The library dlopen()s the workload's own libcupti at run time, so nothing here links against CUPTI.
set -euo pipefail
cd "$(dirname "$0")/.."

# CUDA 13.0: the CUPTI of PyTorch's cu130 wheels; the record fields the library reads have kept their
# offsets from CUPTI 12 to 13.5 (static asserts in fleetprof_cupti.c), so one build serves 12.x and 13.x.
WHEELS=(nvidia-cuda-cupti==13.0.85 nvidia-cuda-runtime==13.0.96 nvidia-cuda-crt==13.0.88)
OUT=.venv/lib/fleetprof/libfleetprof_cupti.so
CACHE=
FORCE=0
PRINT_CACHE=0
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --cache) CACHE=$2; shift 2 ;;
    --force) FORCE=1; shift ;;
    --print-cache) PRINT_CACHE=1; shift ;;
    *) echo "build_cupti: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
if [ -z "$CACHE" ]; then
  if [ -d .venv ]; then CACHE=.venv/share/cuda-wheels; else CACHE=/var/cache/fleetprof/cuda-wheels; fi
fi
say() { printf 'build_cupti: %s\n' "$*" >&2; }

# --- NVIDIA's headers (and libcudart/libcupti, which tests use) from the pinned wheels ---------------------
tag=$(printf '%s\n' "${WHEELS[@]}" | sha256sum | cut -c1-12)
CUDA="$CACHE/cu13-$tag"
if [ ! -e "$CUDA/.complete" ]; then
  command -v unzip >/dev/null || { say "unzip is needed to unpack the wheels (apt-get install unzip)"; exit 1; }
  PIP=(python3 -m pip)
  [ -x .venv/bin/pip ] && PIP=(.venv/bin/pip)
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  say "fetching ${WHEELS[*]} (headers only are kept, plus libcudart and libcupti)"
  "${PIP[@]}" download -q --disable-pip-version-check --no-deps --only-binary=:all: -d "$tmp" "${WHEELS[@]}"
  rm -rf "$CUDA"
  mkdir -p "$CUDA"
  for whl in "$tmp"/*.whl; do
    unzip -q -o "$whl" 'nvidia/cu13/include/*' 'nvidia/cu13/lib/libcudart.so.*' 'nvidia/cu13/lib/libcupti.so.*' \
      -d "$tmp/x" 2>/dev/null || true
  done
  [ -e "$tmp/x/nvidia/cu13/include/cupti.h" ] && [ -e "$tmp/x/nvidia/cu13/include/crt/host_defines.h" ] \
    || { say "the wheels lack cupti.h or crt/host_defines.h"; exit 1; }
  mv "$tmp/x/nvidia/cu13/include" "$CUDA/include"
  mv "$tmp/x/nvidia/cu13/lib" "$CUDA/lib"
  printf '%s\n' "${WHEELS[@]}" > "$CUDA/.complete"
fi
if [ $PRINT_CACHE = 1 ]; then
  echo "$CUDA"
  exit 0
fi

# --- the library ---------------------------------------------------------------------------------------
CC=${CC:-gcc}
SRC=agent/cupti/fleetprof_cupti.c
HDR=agent/cupti/fleetprof_cupti_ring.h
# -fno-omit-frame-pointer: cheap here, and it lets frame-pointer unwinders walk through our callback.
# -z nodelete: CUPTI keeps pointers to our callbacks for the life of the process; never unmap them.
FLAGS=(-O2 -g -std=gnu11 -fPIC -shared -fvisibility=hidden -fno-omit-frame-pointer -Wall -Wextra
       -Wl,-soname,libfleetprof_cupti.so -Wl,-z,nodelete -Wl,--no-undefined)
stamp=$( (cat "$SRC" "$HDR" "$CUDA/.complete"; echo "$CC ${FLAGS[*]}"; "$CC" --version | head -n 1) | sha256sum | cut -d' ' -f1)
if [ $FORCE = 0 ] && [ -e "$OUT" ] && [ "$(cat "$OUT.stamp" 2>/dev/null)" = "$stamp" ]; then
  exit 0
fi
mkdir -p "$(dirname "$OUT")"
"$CC" "${FLAGS[@]}" -I "$CUDA/include" -I agent/cupti -o "$OUT.tmp" "$SRC" -ldl -lpthread -lm
mv "$OUT.tmp" "$OUT"
echo "$stamp" > "$OUT.stamp"
say "built $OUT"
