#!/usr/bin/env bash
# The host's dpkg-deb inside the arm64 guest's root while mmdebstrap installs packages (scripts/arm64_guest.sh):
#   arm64_guest_host_dpkg_deb.sh add ROOT      (an --extract-hook: after the essential packages' files are
#                                               laid out, before dpkg first runs there)
#   arm64_guest_host_dpkg_deb.sh remove ROOT   (a --customize-hook: the root's own dpkg-deb back)
#
# dpkg (arm64, through qemu-user) runs dpkg-deb for each package to decompress it: xz under emulation was
# most of dpkg's time. dpkg-deb only turns a .deb into a tar stream, the same on any architecture, so the
# host's (x86-64, run natively) stands in: /usr/bin/dpkg-deb becomes a script that runs it with its own
# loader and libraries from /.host-dpkg-deb, and the root's is diverted to dpkg-deb.distrib, as mmdebstrap's
# eatmydata hook diverts dpkg. dpkg is not installed yet at `add`, so the diversion is written into its
# database by hand (the format dpkg-divert writes); at `remove`, dpkg-divert undoes it.
set -euo pipefail
action=${1:?usage: add|remove ROOT} root=${2:?usage: add|remove ROOT}
dir=/.host-dpkg-deb

case $action in
  add)
    mkdir -p "$root$dir"
    cp -L /usr/bin/dpkg-deb "$root$dir/"
    # The loader and every library ldd names (absolute paths only: linux-vdso has none).
    for lib in $(ldd /usr/bin/dpkg-deb | grep -o '/[^ ]*'); do cp -L "$lib" "$root$dir/"; done
    mv "$root/usr/bin/dpkg-deb" "$root/usr/bin/dpkg-deb.distrib"
    # LD_PRELOAD unset: eatmydata's, an arm64 library, is nothing to the x86-64 loader but a warning a package.
    printf '#!/bin/sh\nunset LD_PRELOAD\nexec %s/ld-linux-x86-64.so.2 --library-path %s %s/dpkg-deb "$@"\n' \
      "$dir" "$dir" "$dir" >"$root/usr/bin/dpkg-deb"
    chmod 0755 "$root/usr/bin/dpkg-deb"
    printf '/usr/bin/dpkg-deb\n/usr/bin/dpkg-deb.distrib\n:\n' >>"$root/var/lib/dpkg/diversions"
    ;;
  remove)
    rm "$root/usr/bin/dpkg-deb"
    chroot "$root" dpkg-divert --quiet --local --rename --remove /usr/bin/dpkg-deb
    rm -r "${root:?}$dir"
    ;;
  *) echo "usage: $0 add|remove ROOT" >&2; exit 2 ;;
esac
