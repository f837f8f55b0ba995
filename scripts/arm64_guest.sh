#!/usr/bin/env bash
# An arm64 Debian bookworm machine under emulation (qemu-system-aarch64, TCG), for testing the agent on
# aarch64 on an x86-64 host.
#   scripts/arm64_guest.sh build          build the guest once (cached; ~4-5 min the first time), print its dir
#   scripts/arm64_guest.sh path           print the cached guest's dir, or exit 1 when it is not built
#   scripts/arm64_guest.sh run IN OUT [S] boot it: IN/run.sh runs inside (as `sh run.sh OUTDIR`, in IN), what it
#                                         writes to OUTDIR comes back into OUT, with OUT/console.log (the
#                                         serial console); S: seconds before the guest is killed (600);
#                                         $ARM64_GUEST_SMP: its CPUs (2)
#
# The guest is a root filesystem made by mmdebstrap (Debian's cloud arm64 kernel 6.1 and its headers, BCC,
# Python 3.11 with a venv /opt/fleetprof holding fleetprof's dependencies as aarch64 wheels from PyPI) and an
# initramfs of ours (scripts/arm64_guest_initrd.c: loads the virtio modules, mounts the root, runs its init),
# cached under $FLEETPROF_ARM64_CACHE (/var/cache/fleetprof-arm64) in a folder named by a hash of the
# recipe below: a changed package list, dependency or init script builds a new one. Every boot uses it
# read-only (qemu's snapshot=on: writes go to a throwaway overlay), so boots may run side by side and a
# killed guest leaves no damage to repair. There is no network inside: everything is put in the image
# here. Results come back on a disk, never through a prompt: IN goes in as a tar on the second disk, the
# guest's init (below) writes OUTDIR as a tar onto the third and powers off.
#
# Host packages (scripts/setup.sh --test installs them): qemu-system-arm, qemu-user-static, binfmt-support,
# mmdebstrap, arch-test (mmdebstrap runs the guest's package scripts through qemu-user via binfmt_misc),
# gcc-aarch64-linux-gnu (the initramfs' /init), ca-certificates (the guest's certificate links, made here).
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE=${FLEETPROF_ARM64_CACHE:-/var/cache/fleetprof-arm64}
SUITE=bookworm
say() { printf 'arm64-guest: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }

# What goes into the image besides minbase. The kernel headers are the guest kernel's own (BCC compiles
# against them); iproute2 brings up loopback (the agent and collector talk over 127.0.0.1).
GUEST_PACKAGES=(linux-image-cloud-arm64 linux-headers-cloud-arm64 initramfs-tools bpfcc-tools python3-bpfcc
  procps util-linux kmod iproute2 python3 python3-venv)
# The kernel modules the initramfs loads (scripts/arm64_guest_initrd.py adds what they depend on): the disks'
# (virtio over PCI) and those mkinitramfs' udev loaded for qemu's virt machine, so the guest keeps its drivers.
GUEST_MODULES=(virtio_pci virtio_blk virtio_mmio)

# The Python that reads pyproject.toml and runs pip here: the project's venv when there is one.
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}

# fleetprof's runtime dependencies, from pyproject.toml: the common list and both parts' extras (the guest
# runs the agent and the collector); the venv in the image is made from these. Sorted, so that the cache key
# follows the set of requirements, not their order in the file.
dependencies() {
  "$PY" -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; x = p["optional-dependencies"]
print(*sorted(p["dependencies"] + x["agent"] + x["collector"], key=str.lower), sep="\n")'
}

# The guest's init (PID 1, from the kernel command line): mounts what BPF and the agent need, unpacks the
# input disk, runs its run.sh, writes the output disk, powers off. Never a prompt: whatever happens the
# machine goes down (a failing init panics, and panic=-1 with -no-reboot stops qemu).
guest_init() {
  cat <<'EOF'
#!/bin/sh
export PATH=/opt/fleetprof/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null
mount -t tmpfs tmpfs /run
mount -t tmpfs tmpfs /tmp
mount -t debugfs debugfs /sys/kernel/debug
mount -t tracefs tracefs /sys/kernel/tracing
mount -t cgroup2 cgroup2 /sys/fs/cgroup
mount -t bpf bpf /sys/fs/bpf
ip link set lo up
hostname arm64-guest
echo "fleetprof-guest: up after $(cut -d' ' -f1 /proc/uptime) s, kernel $(uname -r) $(uname -m)"
mkdir -p /run/in /run/out
if tar -xf /dev/vdb -C /run/in && [ -f /run/in/run.sh ]; then
  cd /run/in
  sh /run/in/run.sh /run/out >/run/out/run.log 2>&1
  echo "$?" >/run/out/run.rc
  cd /
  tail -n 40 /run/out/run.log
else
  echo "fleetprof-guest: no run.sh on the input disk" | tee /run/out/run.log
  echo 127 >/run/out/run.rc
fi
echo "fleetprof-guest: run.sh exited $(cat /run/out/run.rc) at $(cut -d' ' -f1 /proc/uptime) s"
tar -cf /dev/vdc -C /run/out .
sync
echo "fleetprof-guest: powering off"
echo o >/proc/sysrq-trigger
sleep 60
EOF
}

# The root filesystem. Runs under flock; $1 is an empty work folder, the result lands in $2.
# Everything that can run natively runs here on the host: under qemu-user each arm64 instruction costs tens of
# host ones, which made mkinitramfs (twice, ~7 min), dpkg-deb's decompression, update-ca-certificates and pip
# the bulk of a build (bench/README.md, "arm64 guest build").
build_image() {
  local work=$1 dest=$2 root=$1/root mirror
  mirror=${DEBIAN_MIRROR:-$(apt-get indextargets --format '$(REPO_URI)' 2>/dev/null | grep -m 1 -E '/debian/?$' || true)}
  mirror=${mirror:-http://deb.debian.org/debian/}
  # The dependencies as aarch64 wheels for the guest's CPython 3.11, fetched here (the guest has no
  # network). pip matches --platform tags exactly, so every manylinux level the guest's glibc (2.36) runs
  # is named.
  local plats=() v
  for v in $(seq 17 36); do plats+=(--platform "manylinux_2_${v}_aarch64"); done
  plats+=(--platform manylinux2014_aarch64 --python-version 3.11 --implementation cp)
  mkdir -p "$work/wheels"
  dependencies >"$work/wheels/requirements.txt"
  say "downloading the wheels"
  "$PY" -m pip download -q --disable-pip-version-check --only-binary=:all: "${plats[@]}" \
    -d "$work/wheels" -r "$work/wheels/requirements.txt"
  guest_init >"$work/init"
  # The initramfs' /init, ours (scripts/arm64_guest_initrd.c): static, so it needs nothing from the guest.
  aarch64-linux-gnu-gcc -static -Os -Wall -Wextra -Werror -o "$work/initrd-init" scripts/arm64_guest_initrd.c
  local packages
  packages=$(IFS=,; echo "${GUEST_PACKAGES[*]}")
  # mmdebstrap runs dpkg and the package scripts inside the arm64 root through qemu-user. To spare them work:
  # - dpkg-deb, which decompresses every package (xz: most of dpkg's time under emulation), is the host's
  #   own (the same dpkg 1.21 on Debian 12), run natively from /.host-dpkg-deb with its loader and libraries,
  #   diverted in as mmdebstrap's eatmydata hook diverts dpkg; taken out again after;
  # - eatmydata (mmdebstrap's own hook) makes dpkg's fsyncs no-ops: the root is copied into an image anyway;
  # - manuals, documentation and translations are not unpacked (nothing in the guest reads them);
  # - update-initramfs and update-ca-certificates are diverted to no-ops while packages are installed (the
  #   kernel's postinst and initramfs-tools' trigger ran mkinitramfs twice; ca-certificates' postinst and
  #   its trigger each took 40-60 s of emulated shell over 142 certificates) and put back after: both are
  #   done here on the host, below.
  say "mmdebstrap"
  mmdebstrap --mode=root --variant=minbase --architectures=arm64 --include="$packages" --verbose \
    --extract-hook="'$PWD/scripts/arm64_guest_host_dpkg_deb.sh' add \"\$1\"" \
    --hook-dir=/usr/share/mmdebstrap/hooks/eatmydata \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --essential-hook='for f in /usr/sbin/update-initramfs /usr/sbin/update-ca-certificates; do
      chroot "$1" dpkg-divert --quiet --local --rename --add "$f"; printf "#!/bin/sh\nexit 0\n" >"$1$f"
      chmod 0755 "$1$f"; done' \
    --customize-hook='for f in /usr/sbin/update-initramfs /usr/sbin/update-ca-certificates; do
      rm "$1$f"; chroot "$1" dpkg-divert --quiet --local --rename --remove "$f"; done' \
    --customize-hook="'$PWD/scripts/arm64_guest_host_dpkg_deb.sh' remove \"\$1\"" \
    --customize-hook='chroot "$1" python3 -m venv --without-pip /opt/fleetprof' \
    "$SUITE" "$root" "$mirror"
  # The certificates (/etc/ssl/certs: a link per certificate, the bundle, openssl's hash links) by the host's
  # update-ca-certificates, Debian 12's as the guest's, pointed at the guest's folders; the links it makes
  # name the host's path to the root, which is cut off again. The guest has no hooks in update.d: none run.
  say "the certificates"
  [ -z "$(ls -A "$root/etc/ca-certificates/update.d")" ] || die "ca-certificates hooks in the guest: run them there"
  update-ca-certificates --certsconf "$root/etc/ca-certificates.conf" --certsdir "$root/usr/share/ca-certificates" \
    --localcertsdir "$root/usr/local/share/ca-certificates" --etccertsdir "$root/etc/ssl/certs" \
    --hooksdir "$root/etc/ca-certificates/update.d"
  local link target
  for link in "$root"/etc/ssl/certs/*; do
    target=$(readlink "$link") || continue
    [ "${target#"$root"}" = "$target" ] || ln -sfn "${target#"$root"}" "$link"
  done
  say "the venv"
  local site=$root/opt/fleetprof/lib/python3.11/site-packages
  "$PY" scripts/arm64_guest_venv.py "$root" /opt/fleetprof "$work/wheels/requirements.txt" "$work/wheels" \
    "$root/usr/share/python-wheels" -- "${plats[@]}"
  ln -s /usr/lib/python3/dist-packages/bcc "$site/bcc"
  install -m 0755 "$work/init" "$root/sbin/fleetprof-guest-init"
  { dpkg-query --admindir="$root/var/lib/dpkg" -W -f '${Package} ${Version}\n'
    PIP_CONFIG_FILE=/dev/null "$PY" -m pip freeze --isolated --all --path "$site"; } >"$root/etc/fleetprof-guest-packages"
  say "the initramfs and the image"
  cp "$(ls "$root"/boot/vmlinuz-* | sort -V | tail -n 1)" "$work/vmlinuz"
  # The modules the root disk needs (virtio over PCI) and the ones udev loaded in mkinitramfs' initramfs for
  # the rest of qemu's virt machine, so that the booted guest has the same drivers as before.
  "$PY" scripts/arm64_guest_initrd.py "$root" "$work/initrd-init" "$work/initrd.img" "${GUEST_MODULES[@]}"
  cp "$root/etc/fleetprof-guest-packages" "$work/packages.txt"
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  mkfs.ext4 -q -F -L fleetprof-arm64 -d "$root" "$work/root.img" 4G
  rm -rf "$root" "$work/wheels" "$work/init" "$work/initrd-init"
  mv "$work" "$dest"
}

# The cache key: the recipe's code (bash prints functions without comments, so a reworded comment keeps
# the image), the package list and the dependencies.
recipe_key() {
  { declare -f build_image guest_init; echo "$SUITE ${GUEST_PACKAGES[*]} ${GUEST_MODULES[*]}"; dependencies
    cat scripts/arm64_guest_initrd.c scripts/arm64_guest_initrd.py scripts/arm64_guest_host_dpkg_deb.sh; } \
    | sha256sum | cut -c1-16
}

guest_dir() { echo "$CACHE/$(recipe_key)"; }

build() {
  local dir
  dir=$(guest_dir)
  [ -f "$dir/root.img" ] && { echo "$dir"; return; }
  [ "$(id -u)" = 0 ] || die "building the guest needs root (mmdebstrap --mode=root)"
  for tool in mmdebstrap qemu-system-aarch64 mkfs.ext4 aarch64-linux-gnu-gcc update-ca-certificates; do
    command -v "$tool" >/dev/null || die "$tool is missing (scripts/setup.sh --test installs the host packages)"
  done
  # mmdebstrap runs arm64 package scripts through qemu-user; binfmt_misc must be mounted and enabled.
  if ! arch-test arm64 >/dev/null 2>&1; then
    mountpoint -q /proc/sys/fs/binfmt_misc || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
    update-binfmts --enable qemu-aarch64 >/dev/null 2>&1 || true
    arch-test arm64 >/dev/null 2>&1 || die "arm64 binaries do not run here (qemu-user-static, binfmt_misc)"
  fi
  mkdir -p "$CACHE"
  exec 9>"$CACHE/.lock"
  flock 9   # one build a machine: a second caller waits, then finds it built
  [ -f "$dir/root.img" ] && { echo "$dir"; return; }
  local work start=$SECONDS
  work=$(mktemp -d "$CACHE/.build.XXXXXX")
  say "building the arm64 guest into $dir (mmdebstrap + qemu-user: ~4-5 min; log $CACHE/build.log)"
  # Each line of the log stamped with the time, so that a slow build says which step was slow. Not called as
  # an `if` condition, which would switch off set -e inside build_image: a failed step must stop the build.
  local rc
  set +e
  (set -e; build_image "$work" "$dir") 2>&1 | while IFS= read -r line; do printf '%(%T)T %s\n' -1 "$line"; done \
    >"$CACHE/build.log"
  rc=${PIPESTATUS[0]}
  set -e
  if [ "$rc" != 0 ]; then
    rm -rf "$work"
    tail -n 30 "$CACHE/build.log" >&2
    die "the build failed (log: $CACHE/build.log)"
  fi
  echo "$((SECONDS - start))" >"$dir/build-seconds"
  say "built in $((SECONDS - start)) s"
  echo "$dir"
}

run() {
  local in=${1:?usage: run IN OUT [SECONDS]} out=${2:?usage: run IN OUT [SECONDS]} limit=${3:-600} dir
  [ -f "$in/run.sh" ] || die "$in/run.sh is missing"
  dir=$(guest_dir)
  [ -f "$dir/root.img" ] || die "the guest is not built ($dir): scripts/arm64_guest.sh build"
  mkdir -p "$out"
  tmp=$(mktemp -d /var/tmp/fleetprof-arm64-run.XXXXXX)   # global: the EXIT trap runs after run() returns
  trap 'rm -rf "$tmp"' EXIT
  tar -C "$in" -cf "$tmp/in.tar" .
  truncate -s 512M "$tmp/out.img"   # sparse: only what the guest writes takes space
  local start=$SECONDS rc=0
  # -nic none: with a network card qemu wants a boot ROM (efi-virtio.rom) Debian's qemu-system-arm lacks.
  # -cpu max with pauth-impdef: pointer authentication on (return addresses are signed), with QEMU's
  # cheap hash instead of QARMA, which is slow to emulate. snapshot=on: the cached image is never written.
  # Two CPUs ($ARM64_GUEST_SMP to change it). One took 10% less host CPU alone (216 s against 240 for the
  # test, 2026-11-28), but on a host loaded beyond its CPUs qemu's one thread got one share of them, and
  # the workloads starved the agent inside: it described and tabled them late (fresh-clone run 28).
  TMPDIR=$tmp timeout -k 10 "$limit" qemu-system-aarch64 -M virt -cpu max,pauth-impdef=on -m 4096 \
    -smp "${ARM64_GUEST_SMP:-2}" \
    -nographic -nic none -no-reboot \
    -kernel "$dir/vmlinuz" -initrd "$dir/initrd.img" \
    -append 'root=/dev/vda rw console=ttyAMA0 init=/sbin/fleetprof-guest-init panic=-1 quiet' \
    -drive "file=$dir/root.img,format=raw,if=virtio,snapshot=on" \
    -drive "file=$tmp/in.tar,format=raw,if=virtio,readonly=on" \
    -drive "file=$tmp/out.img,format=raw,if=virtio" \
    -device virtio-rng-pci \
    </dev/null >"$out/console.log" 2>&1 || rc=$?
  echo "$((SECONDS - start))" >"$out/boot-seconds"
  if ! tar -xf "$tmp/out.img" -C "$out" 2>/dev/null; then
    tail -n 40 "$out/console.log" >&2
    die "the guest wrote no results (qemu exit $rc after $((SECONDS - start)) s; console: $out/console.log)"
  fi
  [ "$rc" = 0 ] || say "qemu exited $rc (results were written; console: $out/console.log)"
  say "guest ran $((SECONDS - start)) s; run.sh exited $(cat "$out/run.rc" 2>/dev/null || echo '?')"
}

case "${1:-}" in
  build) build ;;
  path) d=$(guest_dir); [ -f "$d/root.img" ] && echo "$d" || exit 1 ;;
  key) recipe_key ;;
  run) shift; run "$@" ;;
  *) sed -n '2,8p' "$0" >&2; exit 2 ;;
esac
