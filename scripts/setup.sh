#!/usr/bin/env bash
# Installs what fleetprof needs on a fresh Debian machine; safe to run again (does only what is missing).
#   scripts/setup.sh          runtime: BCC, kernel headers, the virtualenv with fleetprof in editable mode
#   scripts/setup.sh --test   also what the test suite uses (dev Python deps, headless Chromium, podman)
#   --system                  the machine's part only (Debian packages, kernel headers, tracefs, binfmt), not
#                             the virtualenv: `make test` starts the images' build between the two
set -euo pipefail
cd "$(dirname "$0")/.."

WANT_TEST=0
SYSTEM_ONLY=0
for arg in "$@"; do
  case "$arg" in
    --test) WANT_TEST=1 ;;
    --system) SYSTEM_ONLY=1 ;;
    *) printf 'setup: unknown option %s (--test, --system)\n' "$arg" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
VENV=.venv
say() { printf 'setup: %s\n' "$*"; }

need_root() {
  if [ "$(id -u)" != 0 ]; then
    say "this step needs root (apt-get, /lib/modules); run it as root or with sudo"; exit 1
  fi
}

# --- Debian packages ------------------------------------------------------------------------------
APT_PKGS=(python3-bpfcc bpfcc-tools libbpfcc linux-perf gcc libc6-dev unzip)  # gcc, unzip: scripts/build_cupti.sh
[ $WANT_TEST = 1 ] && APT_PKGS+=(chromium golang-go prometheus)  # go tool pprof reads our pprof; prometheus: test_prometheus_e2e (own free port, never :9090)
[ $WANT_TEST = 1 ] && ! command -v npm >/dev/null && APT_PKGS+=(npm)  # fetches speedscope's schema below
# test_images: scripts/images.sh (podman, runc: crun fails on these VMs; debootstrap: the base image);
# test_wheel: a venv of Debian's python3, as the agent image makes.
[ $WANT_TEST = 1 ] && APT_PKGS+=(podman runc debootstrap python3-venv gcc g++)  # g++: the unwinder's C++ workload
# The ClickHouse store's tests (tests/collector/test_clickhouse_*.py; the demo stays on DuckDB): Debian's server 18.16
# and ZooKeeper 3.8 (it pulls a JRE), started by the tests on loopback, never as services. ~20 s of apt.
[ $WANT_TEST = 1 ] && APT_PKGS+=(clickhouse-server clickhouse-client zookeeper)
# tests/*/test_debuginfo*.py: elfutils' debuginfod server, started by the tests in a network namespace of its own
# (never as a service), serving the debug files they build; binutils (objcopy, strip) splits them, xz-utils
# makes MiniDebugInfo (.gnu_debugdata), util-linux's unshare gives the server its namespace.
[ $WANT_TEST = 1 ] && APT_PKGS+=(debuginfod binutils xz-utils util-linux)
# The arm64 guest (scripts/arm64_guest.sh, tests/e2e/test_arm64_guest.py) and the arm64 image (scripts/images.sh):
# qemu-system-aarch64 runs the guest, qemu-user through binfmt_misc runs arm64 package scripts while the
# guest's root and the image's base are made (arch-test checks that it does); the cross compiler builds the
# aarch64 workloads and the guest's initramfs /init, and its linux-libc-dev-arm64-cross has the arm64 syscall
# table (scripts/gen_syscalls.py); ca-certificates' update-ca-certificates fills the guest's /etc/ssl/certs.
# libc6-dev-arm64-cross is only a Recommends of the cross compiler, which --no-install-recommends leaves out
# (a machine that had the compiler without it failed the guest's build: bits/wordsize.h missing).
[ $WANT_TEST = 1 ] && APT_PKGS+=(qemu-system-arm qemu-user-static binfmt-support mmdebstrap arch-test
  gcc-aarch64-linux-gnu libc6-dev-arm64-cross linux-libc-dev-arm64-cross ca-certificates)
missing=()
for p in "${APT_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
KREL=$(uname -r)
if [ ! -e "/lib/modules/$KREL/build/include" ]; then
  # No headers for the running kernel yet: the distribution's matching package if it exists,
  # otherwise Debian's generic headers (linked below). BCC only needs them to compile BPF C.
  if apt-cache show "linux-headers-$KREL" >/dev/null 2>&1; then
    missing+=("linux-headers-$KREL")
  else
    dpkg-query -W -f='${Status}' linux-headers-amd64 2>/dev/null | grep -q "install ok installed" \
      || missing+=(linux-headers-amd64)
  fi
fi
if [ ${#missing[@]} -gt 0 ]; then
  need_root
  say "installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
fi

# --- kernel headers for BCC -----------------------------------------------------------------------
if [ ! -e "/lib/modules/$KREL/build/include" ]; then
  need_root
  hdr=$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -n 1 || true)
  common=$(ls -d /usr/src/linux-headers-*-common 2>/dev/null | sort -V | tail -n 1 || true)
  if [ -z "$hdr" ] || [ -z "$common" ]; then
    say "no kernel headers found under /usr/src; BPF programs cannot be compiled"; exit 1
  fi
  mkdir -p "/lib/modules/$KREL"
  ln -sfn "$hdr" "/lib/modules/$KREL/build"
  ln -sfn "$common" "/lib/modules/$KREL/source"
  say "kernel $KREL has no matching headers package; linked $hdr (BPF code uses helpers only, never kernel structs)"
fi

# --- tracefs (tracepoints) ------------------------------------------------------------------------
if [ ! -e /sys/kernel/tracing/events ] && [ -d /sys/kernel/tracing ]; then
  mount -t tracefs nodev /sys/kernel/tracing 2>/dev/null || true
fi
if [ ! -e /sys/kernel/debug/tracing ] && [ -d /sys/kernel/debug ]; then
  mount -t debugfs nodev /sys/kernel/debug 2>/dev/null || true
fi

# --- arm64 binaries through qemu-user (the arm64 guest's and image's builds) ------------------------
if [ $WANT_TEST = 1 ] && ! arch-test arm64 >/dev/null 2>&1; then
  need_root
  mountpoint -q /proc/sys/fs/binfmt_misc || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
  update-binfmts --enable qemu-aarch64 >/dev/null 2>&1 || true
  arch-test arm64 >/dev/null 2>&1 || say "arm64 binaries do not run here (binfmt_misc, qemu-user-static)"
fi

[ $SYSTEM_ONLY = 1 ] && exit 0

# --- virtualenv ----------------------------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV with $($PY --version)"
  "$PY" -m venv "$VENV"
fi
# One stamp whatever the extras: it holds "test" when the test extras were installed too (a superset of
# the runtime's), so `make demo` after `make test` finds the package installed instead of reinstalling it
# (4.5 s), and an install for a newer pyproject.toml keeps the extras the venv had.
stamp="$VENV/.installed"
legacy="$VENV/.installed[test]"  # the test install's stamp of a venv set up before
if [ -e "$legacy" ] && [ ! -e "$stamp" ]; then
  echo test > "$stamp" && touch -r "$legacy" "$stamp" && rm -f "$legacy"
fi
had=$(cat "$stamp" 2>/dev/null || true)
# Both parts' extras (pyproject.toml): this machine runs the agent and the collector; each image installs one.
EXTRAS="[agent,collector]"
{ [ $WANT_TEST = 1 ] || [ "$had" = test ]; } && EXTRAS="[agent,collector,test]"
if [ ! -e "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || { [ $WANT_TEST = 1 ] && [ "$had" != test ]; }; then
  say "installing fleetprof$EXTRAS (editable) into $VENV"
  # By uv (PyPI's `uv`, put into the venv by pip first): the same versions as pip picks, installed in ~4 s
  # where pip took ~20 s with its cache warm, the first thing a fresh clone's `make test` waits for. pip
  # where uv cannot be had. Neither compiles the packages' modules: Python does, on first import (pip
  # compiling them all took 37 s instead of 21; most are never imported, their own tests among them).
  # uv reads neither pip.conf nor PIP_* variables: it is handed pip's settings (local wheel folders and
  # indexes a machine is set up with, constraints, the CA), and picks the best version across all the
  # sources, as pip does.
  pip_config=$("$VENV/bin/pip" config list 2>/dev/null || true)  # once: each pip start costs ~0.3 s
  pip_setting() { sed -n "s/^[^.]*\.$1='\(.*\)'\$/\1/p" <<<"$pip_config" | head -1; }
  uv_args=(--index-strategy unsafe-best-match)
  for v in $(pip_setting find-links); do uv_args+=(--find-links "$v"); done
  for v in $(pip_setting extra-index-url); do uv_args+=(--extra-index-url "$v"); done
  for v in $(pip_setting index-url); do uv_args+=(--index-url "$v"); done
  for v in $(pip_setting constraint); do uv_args+=(--constraint "$v"); done
  uv_env=()
  cert=$(pip_setting cert) && [ -n "$cert" ] && uv_env=(SSL_CERT_FILE="$cert")
  if "$VENV/bin/pip" install -q --disable-pip-version-check uv >/dev/null 2>&1 \
      && env "${uv_env[@]}" "$VENV/bin/uv" pip install -q --python "$VENV/bin/python" "${uv_args[@]}" \
        -e ".$EXTRAS"; then
    :
  else
    say "uv failed or is not to be had: installing with pip"
    "$VENV/bin/pip" install -q --disable-pip-version-check --no-compile -e ".$EXTRAS"
  fi
  if [ "$EXTRAS" = "[agent,collector,test]" ]; then echo test > "$stamp"; else : > "$stamp"; fi
fi

# BCC's Python module comes from Debian (PyPI's `bcc` is an unrelated package). Link only the bcc
# package into the venv so the rest of dist-packages stays out of it.
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
bcc_src=$(ls -d /usr/lib/python3/dist-packages/bcc 2>/dev/null || true)
if [ -z "$bcc_src" ]; then
  say "Debian's python3-bpfcc is not installed (no /usr/lib/python3/dist-packages/bcc)"; exit 1
fi
ln -sfn "$bcc_src" "$site/bcc"
"$VENV/bin/python" -c 'import bcc' || { say "bcc does not import in $VENV"; exit 1; }

# --- the CUPTI library that CUDA workloads load (agent/cupti/); rebuilt only when its sources changed ----
bash scripts/build_cupti.sh

# --- speedscope's published file-format schema (tests validate our speedscope output against it) ---
SPEEDSCOPE_SCHEMA="$VENV/share/speedscope/file-format-schema.json"
if [ $WANT_TEST = 1 ] && [ ! -s "$SPEEDSCOPE_SCHEMA" ]; then
  say "fetching speedscope's file-format schema (npm pack speedscope@1.25.0)"
  tmp=$(mktemp -d)
  (cd "$tmp" && npm pack --silent speedscope@1.25.0 >/dev/null && tar xzf speedscope-1.25.0.tgz)
  mkdir -p "$(dirname "$SPEEDSCOPE_SCHEMA")"
  cp "$tmp/package/dist/release/file-format-schema.json" "$SPEEDSCOPE_SCHEMA"
  rm -rf "$tmp"
fi

# --- a published Connect client (tests/e2e/test_grafana_connect.py drives the Pyroscope query API with it) ---
# tests/connect_client pins @connectrpc/connect(-node) and @bufbuild/protobuf; installed again only when
# its lock file changes.
CONNECT_CLIENT="$VENV/share/connect-client"
if [ $WANT_TEST = 1 ] && ! cmp -s tests/connect_client/package-lock.json "$CONNECT_CLIENT/.installed-lock"; then
  say "installing the Connect client's npm packages (npm ci) into $CONNECT_CLIENT"
  rm -rf "$CONNECT_CLIENT"
  mkdir -p "$CONNECT_CLIENT"
  cp tests/connect_client/package.json tests/connect_client/package-lock.json "$CONNECT_CLIENT/"
  (cd "$CONNECT_CLIENT" && npm ci --silent --ignore-scripts --no-audit --no-fund)
  cp tests/connect_client/package-lock.json "$CONNECT_CLIENT/.installed-lock"
fi

# --- Grafana's flame graph component bundled for the browser (tests/collector/test_grafana_flamegraph.py) ----
# tests/grafana_flamegraph pins @grafana/flamegraph and its peers; esbuild bundles its entry into one
# script. Built again only when the lock file, the entry or the build script changes; the ~650 MB of
# node_modules are removed once the bundle exists. The bundle is kept in this machine's build cache under
# that hash too: a fresh clone's setup copies it instead of 50 s of `npm ci` (FLEETPROF_BUILD_CACHE).
GRAFANA_FLAMEGRAPH="$VENV/share/grafana-flamegraph"
gfg_files=(tests/grafana_flamegraph/package.json tests/grafana_flamegraph/package-lock.json
  tests/grafana_flamegraph/entry.jsx tests/grafana_flamegraph/build.mjs)
gfg_stamp=$(cat "${gfg_files[@]}" | sha256sum | cut -d' ' -f1)
if [ -w /var/cache ]; then build_cache=/var/cache/fleetprof-build; else build_cache="${XDG_CACHE_HOME:-$HOME/.cache}/fleetprof-build"; fi
gfg_cached="${FLEETPROF_BUILD_CACHE:-$build_cache}/grafana-flamegraph/$gfg_stamp"
if [ $WANT_TEST = 1 ] && [ "$(cat "$GRAFANA_FLAMEGRAPH/.built-from" 2>/dev/null)" != "$gfg_stamp" ]; then
  rm -rf "$GRAFANA_FLAMEGRAPH"
  if [ -s "$gfg_cached/flamegraph.js" ]; then
    say "@grafana/flamegraph's bundle from this machine's build cache ($gfg_cached)"
    mkdir -p "$GRAFANA_FLAMEGRAPH" && cp -a "$gfg_cached/." "$GRAFANA_FLAMEGRAPH/"
  else
    say "bundling @grafana/flamegraph for the browser (npm ci, esbuild) into $GRAFANA_FLAMEGRAPH"
    mkdir -p "$GRAFANA_FLAMEGRAPH/build"
    cp "${gfg_files[@]}" "$GRAFANA_FLAMEGRAPH/build/"
    (cd "$GRAFANA_FLAMEGRAPH/build" && npm ci --silent --ignore-scripts --no-audit --no-fund \
      && node build.mjs ../flamegraph.js)
    rm -rf "$GRAFANA_FLAMEGRAPH/build"
    # Into the cache whole or not at all (a folder renamed into place): another setup may read it meanwhile.
    if mkdir -p "$(dirname "$gfg_cached")" 2>/dev/null && part=$(mktemp -d "$gfg_cached.XXXXXX" 2>/dev/null); then
      cp -a "$GRAFANA_FLAMEGRAPH/." "$part/" && mv -T "$part" "$gfg_cached" 2>/dev/null || rm -rf "$part"
    fi
  fi
  echo "$gfg_stamp" > "$GRAFANA_FLAMEGRAPH/.built-from"
fi
say "ready: $VENV/bin/fleetprof"
