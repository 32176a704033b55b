#!/usr/bin/env bash
# Build a pdserve image with whichever builder is here: docker (with a reachable daemon), podman
# or buildah (daemonless). `make image` / `make image-gpu` call it.
#
#   deploy/images/build.sh cpu|gpu [--print-image]
#
# --print-image prints the name it would tag and exits (the chart's tests compare it with the
# images the chart and its examples name).
#
# Environment (all optional):
#   IMAGE_BUILDER     docker, podman or buildah (default: the first one found, in that order)
#   BUILDER_FLAGS     global flags for the builder, e.g. "--storage-driver vfs"
#   IMAGE             full name to tag (default: pdserve/pdserve-cpu:<appVersion> for cpu,
#                     pdserve/pdserve:<appVersion> for gpu; the Helm chart's names)
#   BASE_IMAGE        the images' base (default docker.io/library/debian:bookworm-slim); when
#                     it cannot be pulled, a bookworm base is made with debootstrap instead
#                     (localhost/pdserve-base:bookworm), as `make image-base` does
#   TORCH_WHEEL_DIR   a folder holding torch-2.13.0+cpu-*.whl: install torch from it instead of
#                     the PyTorch CPU index (default: pip's find-links folder, when it has one;
#                     set but empty: the index only)
#   TORCH_INDEX_URL   the index of torch 2.13.0+cpu (default https://download.pytorch.org/whl/cpu)
#   BUILD_CA_DIR      extra CA certificates (*.crt) trusted by the build stage only, for a TLS
#                     proxy in front of the registries (default /usr/local/share/ca-certificates);
#                     never copied into the final image
#   PDSERVE_SOURCE    the org.opencontainers.image.source label
set -euo pipefail

variant=${1:?usage: build.sh cpu|gpu [--print-image]}
print_only=${2:-}
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
images=deploy/images

log() { echo "build.sh: $*" >&2; }
die() {
    log "$*"
    exit 2
}

case "$variant" in
    cpu) containerfile=$images/Containerfile.cpu ;;
    gpu) containerfile=$images/Containerfile.gpu ;;
    *) die "unknown image '$variant' (cpu or gpu)" ;;
esac

app_version=$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\} *$/\1/p' deploy/helm/pdserve/Chart.yaml)
[ -n "$app_version" ] || die "no appVersion in deploy/helm/pdserve/Chart.yaml"
if [ "$variant" = cpu ]; then
    image=${IMAGE:-pdserve/pdserve-cpu:$app_version}
else
    image=${IMAGE:-pdserve/pdserve:$app_version}
fi

if [ "$print_only" = --print-image ]; then
    echo "$image"
    exit 0
fi
[ -z "$print_only" ] || die "unknown option '$print_only'"

# The builder: the first that can build here.
pick_builder() {
    if [ -n "${IMAGE_BUILDER:-}" ]; then
        command -v "$IMAGE_BUILDER" >/dev/null || die "IMAGE_BUILDER=$IMAGE_BUILDER is not on PATH"
        echo "$IMAGE_BUILDER"
        return
    fi
    if command -v docker >/dev/null && docker info >/dev/null 2>&1; then
        echo docker
    elif command -v podman >/dev/null; then
        echo podman
    elif command -v buildah >/dev/null; then
        echo buildah
    else
        local docker_note="not on PATH"
        command -v docker >/dev/null && docker_note="on PATH but its daemon does not answer"
        die "no image builder found: looked for docker ($docker_note), podman and buildah on PATH;" \
            "install one (Debian: apt-get install buildah) or set IMAGE_BUILDER"
    fi
}
builder=$(pick_builder)
read -r -a flags <<<"${BUILDER_FLAGS:-}"
b() { "$builder" "${flags[@]}" "$@"; }

build_args=(
    --build-arg "PDSERVE_VERSION=$app_version"
    --build-arg "PDSERVE_SOURCE=${PDSERVE_SOURCE:-https://github.com/pdserve/pdserve}"
    --build-arg "PDSERVE_REVISION=$(git rev-parse HEAD 2>/dev/null || echo unknown)"
)
# Podman and buildah run RUN steps with chroot isolation: it needs no OCI runtime, which is
# what works inside containers and sandboxes (their default runtime may not start there).
case "$builder" in
    buildah | podman) build_args+=(--isolation "${BUILD_ISOLATION:-chroot}") ;;
esac

# Files that only the build stage sees: extra CAs and local torch wheels (git ignores both).
rm -f "$images"/wheels/*.whl "$images"/build-certs/*.crt
ca_dir=${BUILD_CA_DIR-/usr/local/share/ca-certificates}
if [ -n "$ca_dir" ] && compgen -G "$ca_dir/*.crt" >/dev/null; then
    cp "$ca_dir"/*.crt "$images/build-certs/"
    log "the build stage trusts the extra CAs of $ca_dir"
fi

image_present() { b image inspect "$1" >/dev/null 2>&1; }

base=${BASE_IMAGE:-docker.io/library/debian:bookworm-slim}
if ! image_present "$base" && ! b pull "$base" >/dev/null 2>&1; then
    if [ -n "${BASE_IMAGE:-}" ]; then
        die "BASE_IMAGE=$base is neither here nor pullable"
    fi
    base=localhost/pdserve-base:bookworm
    log "cannot pull docker.io/library/debian:bookworm-slim: using $base (debootstrap)"
    image_present "$base" || "$images/debootstrap-base.sh" "$base" "$builder" "${flags[@]}"
fi
build_args+=(--build-arg "BASE_IMAGE=$base")

if [ "$variant" = cpu ]; then
    # TORCH_WHEEL_DIR set but empty: no local wheel, the index only.
    wheel_dir=${TORCH_WHEEL_DIR-${PIP_FIND_LINKS:-$(pip config get global.find-links 2>/dev/null || true)}}
    wheels=()
    if [ -n "$wheel_dir" ]; then
        mapfile -t wheels < <(compgen -G "$wheel_dir/torch-2.13.0+cpu-*.whl" || true)
    fi
    if [ "${#wheels[@]}" -gt 0 ]; then
        cp "${wheels[@]}" "$images/wheels/"
        build_args+=(--build-arg TORCH_INDEX_URL=)
        log "torch 2.13.0+cpu from the local wheel in $wheel_dir"
    else
        [ -z "${TORCH_WHEEL_DIR:-}" ] || die "no torch-2.13.0+cpu-*.whl in TORCH_WHEEL_DIR=$TORCH_WHEEL_DIR"
        index=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
        build_args+=(--build-arg "TORCH_INDEX_URL=$index")
        log "torch 2.13.0+cpu from $index"
    fi
fi

log "building $image with $builder from $containerfile"
start=$(date +%s)
b build "${build_args[@]}" -f "$containerfile" -t "$image" .
log "built $image in $(($(date +%s) - start)) s"
b images "$image" >&2
