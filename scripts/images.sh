#!/usr/bin/env bash
# Builds the two images from deploy/Dockerfile.agent and deploy/Dockerfile.collector with podman.
#   scripts/images.sh [ARCH...]   ARCH: amd64, arm64 (default: this machine's). `make images` builds both.
#   scripts/images.sh --cached-arches   what `make test` builds: this machine's, and others with a base.
# Names: fleetprof/agent:VERSION and fleetprof/collector:VERSION (VERSION from pyproject.toml) for this
# machine's architecture, as the manifests name them; and fleetprof/COMPONENT:VERSION-ARCH for each ARCH built.
# A registry serves both under one name as a manifest list (deploy/README.md, "Mixed-architecture clusters").
# Their base, debian:bookworm-slim, is built here from Debian's packages (debootstrap) when podman does not
# have it yet: the registry that serves it may be unreachable (it is on the development machines). Once built
# it stays in podman's store, so later runs skip it; podman's layer cache makes unchanged images instant.
# Another architecture's base and RUN steps run through qemu-user (binfmt_misc; scripts/setup.sh --test):
# the first arm64 build takes ~20 min here, later ones reuse its layers.
# Env: DEBIAN_MIRROR (default: the Debian mirror apt already uses), IMAGES_LOG (build output; default stderr).
set -euo pipefail
cd "$(dirname "$0")/.."

NATIVE=$(dpkg --print-architecture)
# --cached-arches: print the architectures worth building before the tests (make test): this machine's, and
# any other whose base podman already has, so a rebuild there is fleetprof's own layer only.
if [ "${1:-}" = "--cached-arches" ]; then
  arches=("$NATIVE")
  for arch in amd64 arm64; do
    [ "$arch" != "$NATIVE" ] && command -v podman >/dev/null \
      && podman image exists "localhost/fleetprof/debian-base:bookworm-slim-$arch" 2>/dev/null \
      && arches+=("$arch")
  done
  echo "${arches[@]}"
  exit 0
fi
ARCHES=("$@")
[ ${#ARCHES[@]} -gt 0 ] || ARCHES=("$NATIVE")
VERSION=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -n 1)
# crun, podman's default, fails on this machine kind ("cgroups in hybrid mode not supported", setrlimit
# EPERM); runc works, with rlimits below the host's own (setting those needs CAP_SYS_RESOURCE).
RUNTIME_FLAGS=(--runtime runc --ulimit nofile=1024:1024 --ulimit nproc=4096:4096)
say() { printf 'images: %s\n' "$*" >&2; }
log=${IMAGES_LOG:-/dev/stderr}
[ -n "${IMAGES_LOG:-}" ] && : >"$IMAGES_LOG"

command -v podman >/dev/null || { say "podman is not installed (scripts/setup.sh --test installs it)"; exit 1; }
for arch in "${ARCHES[@]}"; do
  case "$arch" in amd64 | arm64) ;; *) say "unknown architecture $arch (amd64 or arm64)"; exit 2 ;; esac
  if [ "$arch" != "$NATIVE" ] && ! arch-test "$arch" >/dev/null 2>&1; then
    say "$arch binaries do not run here: install qemu-user-static and binfmt-support (scripts/setup.sh --test)"
    exit 1
  fi
done
# What to remove at exit, whatever happens: the base's debootstrap folder, the CA bundle's copy.
cleanup=()
trap 'rm -rf "${cleanup[@]}"' EXIT
# One build at a time on a machine (two test sessions at once would debootstrap twice and race on tags).
exec 9>/var/tmp/fleetprof-images.lock
flock 9
[ -n "$VERSION" ] || { say "no version in pyproject.toml"; exit 1; }

# The base of each architecture: this machine's under the name the Dockerfiles' FROM uses by default,
# another's under a local name passed as their BASE build argument.
base_name() {
  if [ "$1" = "$NATIVE" ]; then echo docker.io/library/debian:bookworm-slim
  else echo "localhost/fleetprof/debian-base:bookworm-slim-$1"; fi
}

# --- base image -----------------------------------------------------------------------------------
build_base() {
  local arch=$1 BASE mirror root security start
  BASE=$(base_name "$arch")
  if podman image exists "$BASE"; then
    say "base $BASE present"
    return
  fi
  command -v debootstrap >/dev/null || { say "debootstrap is not installed (scripts/setup.sh --test)"; exit 1; }
  [ "$(id -u)" = 0 ] || { say "building the base needs root (debootstrap)"; exit 1; }
  mirror=${DEBIAN_MIRROR:-$(apt-get indextargets --format '$(REPO_URI)' 2>/dev/null \
    | grep -m 1 -E '/debian/?$' || true)}
  mirror=${mirror:-http://deb.debian.org/debian/}
  root=$(mktemp -d /var/tmp/fleetprof-base.XXXXXX)
  cleanup+=("$root")
  say "building $BASE ($arch) with debootstrap --variant=minbase bookworm from $mirror"
  start=$SECONDS
  debootstrap --arch="$arch" --variant=minbase bookworm "$root" "$mirror" >>"$log" 2>&1 \
    || { cat "$root/debootstrap/debootstrap.log" >>"$log" 2>/dev/null; say "debootstrap failed (log: ${IMAGES_LOG:-above})"; exit 1; }
  # What Debian's official slim image does (debuerreotype --slimify, its apt snippets): no docs, man
  # pages or translations from later installs, no .deb cache; and its apt sources.
  cat >"$root/etc/dpkg/dpkg.cfg.d/docker" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/lintian/overrides/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/all_languages
path-include /usr/share/locale/locale.alias
path-exclude /usr/share/man/*
EOF
  # ...and what those path-excludes would have left out had they been there from the start (~40 MB).
  find "$root/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
  find "$root/usr/share/locale" -mindepth 1 -maxdepth 1 -not -name locale.alias -not -name all_languages \
    -exec rm -rf {} +
  cat >"$root/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
  printf 'Acquire::Languages "none";\n' >"$root/etc/apt/apt.conf.d/docker-no-languages"
  printf 'Apt::AutoRemove::SuggestsImportant "false";\n' >"$root/etc/apt/apt.conf.d/docker-autoremove-suggests"
  rm -f "$root/etc/apt/sources.list"
  security=${mirror%/}-security
  [ -z "${DEBIAN_MIRROR:-}" ] && security=$(apt-get indextargets --format '$(REPO_URI)' 2>/dev/null \
    | grep -m 1 -E '/debian-security/?$' || echo http://deb.debian.org/debian-security/)
  cat >"$root/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: ${mirror%/}
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: ${security%/}
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/cache/apt/*.bin "$root"/var/lib/apt/lists/* \
    "$root"/var/log/*.log "$root"/var/log/apt/* "$root"/debootstrap \
    "$root"/usr/share/man/* "$root"/usr/share/info/*
  tar -C "$root" --numeric-owner -c . | podman import --quiet --arch "$arch" \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["bash"]' \
    --change 'LABEL org.opencontainers.image.description=debian:bookworm-slim built locally by fleetprof scripts/images.sh (debootstrap --variant=minbase)' \
    --message "debootstrap --arch=$arch --variant=minbase bookworm $mirror" - "$BASE" >/dev/null
  rm -rf "$root"
  say "built $BASE in $((SECONDS - start)) s"
}

# --- the images -----------------------------------------------------------------------------------
# --network host: RUN steps reach Debian's mirror and PyPI without a container network (bridge/CNI).
BUILD_FLAGS=(--network host --pull=never)
# Where pip on this machine trusts a CA of its own (a TLS-inspecting proxy in front of PyPI, as on the
# development machines), pip in the build must too: the host's bundle is bind-mounted on the image's empty
# /mnt for the build only and named by the Dockerfiles' PIP_CERT build argument (neither is kept).
pip_cert=${PIP_CERT:-$(python3 -m pip config list 2>/dev/null | sed -n "s/^global\.cert='\(.*\)'$/\1/p" | head -n 1)}
if [ -n "$pip_cert" ] && [ -r "$pip_cert" ]; then
  certs=$(mktemp -d /var/tmp/fleetprof-pip-ca.XXXXXX)
  cleanup+=("$certs")
  cp "$pip_cert" "$certs/ca.crt"
  chmod -R a+rX "$certs"
  BUILD_FLAGS+=(-v "$certs:/mnt:ro" --build-arg PIP_CERT=/mnt/ca.crt)
  say "pip in the build trusts this machine's CA bundle ($pip_cert), as pip here does"
fi
# The Dockerfiles' package stage runs on this machine's own base (BUILD_BASE), whatever the target.
build_base "$NATIVE"
for arch in "${ARCHES[@]}"; do
  build_base "$arch"
  for component in agent collector; do
    tag=fleetprof/$component:$VERSION-$arch
    start=$SECONDS
    say "building $tag from deploy/Dockerfile.$component"
    podman build "${RUNTIME_FLAGS[@]}" "${BUILD_FLAGS[@]}" --platform "linux/$arch" \
      --build-arg "BASE=$(base_name "$arch")" --build-arg "BUILDPLATFORM=linux/$NATIVE" \
      --build-arg "TARGETPLATFORM=linux/$arch" -f "deploy/Dockerfile.$component" -t "$tag" . >>"$log" 2>&1 \
      || { say "podman build of $tag failed (log: ${IMAGES_LOG:-above})"; exit 1; }
    # This machine's architecture also under the plain name, which the manifests and tests run.
    [ "$arch" = "$NATIVE" ] && podman tag "$tag" "fleetprof/$component:$VERSION"
    say "built $tag in $((SECONDS - start)) s, $(podman image inspect --format '{{.Size}}' "$tag") bytes"
  done
done
