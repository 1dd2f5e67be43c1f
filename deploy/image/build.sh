#!/usr/bin/env bash
# Build the aenv image (deploy/image/Containerfile) with Debian's podman or buildah.
#
# The Containerfile starts FROM debian:bookworm-slim on Docker Hub. Where no public registry is
# reachable, this script first makes an equivalent base here, with mmdebstrap from Debian's
# mirror, imports it as a local image and builds with `--from` pointing at it; the Containerfile
# itself stays unchanged. The local base is made once and reused (--rebuild-base to redo it).
#
#   deploy/image/build.sh                       local base, tag localhost/aenv:latest
#   deploy/image/build.sh --tag aenv:dev        another tag
#   deploy/image/build.sh --from IMAGE          any base image instead of the local one
#   deploy/image/build.sh --registry-base       the Containerfile's FROM, pulled as usual
#   deploy/image/build.sh --host-ca             pip trusts this host's CA bundle during the
#                                               build (TLS through an intercepting proxy)
#   deploy/image/build.sh -- ARGS...            more arguments for `podman build`, e.g.
#                                               --isolation chroot where the OCI runtime cannot
#                                               start containers (a VM without CAP_SYS_RESOURCE)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
CONTAINERFILE=$ROOT/deploy/image/Containerfile
TAG=localhost/aenv:latest
LOCAL_BASE=localhost/aenv-base:bookworm-slim
SUITE=bookworm
base=local
rebuild_base=false
HOST_CA=/etc/ssl/certs/ca-certificates.crt
extra=()

log() { echo "build.sh: $*" >&2; }
usage() { sed -n '2,18s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; exit "${1:-0}"; }

while [ $# -gt 0 ]; do
    case "$1" in
        --tag) TAG=$2; shift 2 ;;
        --from) base=$2; shift 2 ;;
        --registry-base) base=registry; shift ;;
        --rebuild-base) rebuild_base=true; shift ;;
        --host-ca) extra+=(--volume "$HOST_CA:/run/host-ca.crt:ro" --build-arg PIP_CERT=/run/host-ca.crt); shift ;;
        -h | --help) usage 0 ;;
        --) shift; break ;;
        *) log "unknown argument: $1"; usage 2 ;;
    esac
done

if command -v podman >/dev/null; then
    BUILDER=(podman)
elif command -v buildah >/dev/null; then
    BUILDER=(buildah)
else
    log "needs podman or buildah: apt-get install podman (or buildah)"
    exit 1
fi

image_exists() {
    if [ "${BUILDER[0]}" = podman ]; then
        podman image exists "$1"
    else
        buildah inspect --type image "$1" >/dev/null 2>&1
    fi
}

# A minimal Debian root (what debian:*-slim is: the minbase variant) as a single-layer image.
make_local_base() {
    command -v mmdebstrap >/dev/null || { log "needs mmdebstrap: apt-get install mmdebstrap"; exit 1; }
    local tarball
    tarball=$(mktemp --suffix=.tar)
    trap 'rm -f "$tarball"' EXIT
    log "making $LOCAL_BASE with mmdebstrap ($SUITE, minbase)"
    mmdebstrap --variant=minbase --include=ca-certificates \
        --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
        "$SUITE" "$tarball"
    if [ "${BUILDER[0]}" = podman ]; then
        podman import --change 'CMD ["bash"]' "$tarball" "$LOCAL_BASE" >/dev/null
    else
        local container
        container=$(buildah from scratch)
        buildah add "$container" "$tarball" / >/dev/null
        buildah config --cmd bash "$container"
        buildah commit --rm "$container" "$LOCAL_BASE" >/dev/null
    fi
    rm -f "$tarball"
    trap - EXIT
}

from=()
case "$base" in
    local)
        if $rebuild_base || ! image_exists "$LOCAL_BASE"; then
            make_local_base
        fi
        from=(--from "$LOCAL_BASE")
        ;;
    registry) ;;
    *) from=(--from "$base") ;;
esac

log "building $TAG (${from[*]:-FROM as written})"
# Host networking for RUN steps: apt and pip reach their mirrors the way this host does.
if [ "${BUILDER[0]}" = podman ]; then
    podman build --network host "${from[@]}" "${extra[@]}" "$@" -f "$CONTAINERFILE" -t "$TAG" "$ROOT"
else
    buildah build --network host "${from[@]}" "${extra[@]}" "$@" -f "$CONTAINERFILE" -t "$TAG" "$ROOT"
fi
log "built $TAG; try: podman run --rm $TAG --version"
