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
# What the official slim image drops too: documentation, manuals, translations (also for packages
# installed later), package lists, caches, logs.
cat >"$work/rootfs/etc/dpkg/dpkg.cfg.d/slim" <<'CFG'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
CFG
echo 'Acquire::Languages "none";' >"$work/rootfs/etc/apt/apt.conf.d/99no-languages"
find "$work/rootfs/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
rm -rf "$work/rootfs"/usr/share/man/* "$work/rootfs"/usr/share/info/* \
    "$work/rootfs"/var/lib/apt/lists/* "$work/rootfs"/var/cache/apt/*.bin \
    "$work/rootfs"/var/cache/apt/archives/*.deb "$work/rootfs"/var/log/*.log
find "$work/rootfs/usr/share/locale" -mindepth 1 -maxdepth 1 -not -name locale.alias \
    -exec rm -rf {} +
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
