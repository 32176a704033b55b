#!/usr/bin/env bash
# Make a Debian bookworm base image from the Debian mirror, for builders that cannot pull the
# public base (`docker.io/library/debian:bookworm-slim`): debootstrap's minbase variant, apt lists
# and caches removed, committed with buildah (or imported with podman/docker) under IMAGE.
#
#   deploy/images/debootstrap-base.sh IMAGE BUILDER [BUILDER_GLOBAL_FLAGS...]
#
# Needs root (debootstrap) and the Debian mirror (DEBIAN_MIRROR, default deb.debian.org).
set -euo pipefail

image=${1:?usage: debootstrap-base.sh IMAGE BUILDER [FLAGS...]}
builder=${2:?usage: debootstrap-base.sh IMAGE BUILDER [FLAGS...]}
shift 2
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

command -v debootstrap >/dev/null || {
    echo "debootstrap-base.sh: debootstrap not found (apt-get install debootstrap)" >&2
    exit 2
}
work=$(mktemp -d "${TMPDIR:-/tmp}/pdserve-base.XXXXXX")
trap 'rm -rf "$work"' EXIT

echo "debootstrap-base.sh: debootstrap bookworm (minbase) from $mirror" >&2
debootstrap --variant=minbase bookworm "$work/rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 || {
    tail -n 30 "$work/debootstrap.log" >&2
    echo "debootstrap-base.sh: debootstrap failed (log above)" >&2
    exit 1
}
# What the official slim image drops too: package lists, caches, logs.
rm -rf "$work/rootfs"/var/lib/apt/lists/* "$work/rootfs"/var/cache/apt/*.bin \
    "$work/rootfs"/var/cache/apt/archives/*.deb "$work/rootfs"/var/log/*.log
tar -C "$work/rootfs" --numeric-owner -cf "$work/rootfs.tar" .

case "$(basename "$builder")" in
    buildah)
        ctr=$("$builder" "$@" from scratch)
        "$builder" "$@" add "$ctr" "$work/rootfs.tar" /
        "$builder" "$@" config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
            --cmd /bin/bash --label org.opencontainers.image.base.name=debian:bookworm "$ctr"
        "$builder" "$@" commit --rm "$ctr" "$image" >/dev/null
        ;;
    *)  # podman and docker both import a root filesystem tarball.
        "$builder" "$@" import --change 'CMD ["/bin/bash"]' "$work/rootfs.tar" "$image" >/dev/null
        ;;
esac
echo "debootstrap-base.sh: base image $image ready" >&2
