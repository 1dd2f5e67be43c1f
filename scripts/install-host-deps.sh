#!/usr/bin/env bash
# Install what an aenv node needs on Debian 12 (bookworm) or 13 (trixie), as root; other
# systems are refused unless everything is already present.
# Idempotent: when every package is present and QEMU is >= 10.0 it exits without touching apt.
# --runtime: only what a deployed node runs with (deploy/install.sh, the server image), without
# the packages the test suite alone needs.
set -euo pipefail

runtime_only=false
case "${1:-}" in
    --runtime) runtime_only=true ;;
    "") ;;
    *) echo "usage: $0 [--runtime]" >&2; exit 2 ;;
esac

MIN_QEMU_MAJOR=10
# QEMU comes from bookworm-backports on Debian 12 (bookworm's 7.2 cannot share memory images).
QEMU_PACKAGES=(qemu-system-x86 qemu-utils)
# Guest artifacts: kernel + modules, initramfs (busybox, cpio, kmod's modprobe), rootfs
# (mmdebstrap, e2fsprogs' mkfs.ext4), kernel payloads and modules that may be zstd.
# Host runtime: iproute2 and nftables for sandbox networks (the node loads rules through
# libnftables1 in its own process), python3-venv for the project.
PACKAGES=(
    linux-image-amd64 busybox-static kmod mmdebstrap debian-archive-keyring ca-certificates
    cpio e2fsprogs zstd iproute2 nftables libnftables1 util-linux python3-venv
)
# envd's command starter (src/aenv/agent/exec.c), compiled static for the tools drive.
PACKAGES+=(gcc libc6-dev)
# Volumes: diod serves a sandbox's volumes into its namespace over 9P (aenv.volumes.server),
# under a seccomp filter loaded through libseccomp (pyseccomp, aenv.volumes.jail).
PACKAGES+=(diod libseccomp2)
# Cluster tests (tests/cluster): the scheduler keeps its shared state in a real Redis.
PACKAGES+=(redis-server)
# On-demand loading from an s3 repository (aenv.runtime.lazyfs): libfuse3 and fusermount3.
PACKAGES+=(fuse3)
# The web console's xterm.js is installed with npm (make setup-console); the test suite drives the
# official e2b npm SDK too: Node.js and npm, unless already installed.
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    PACKAGES+=(nodejs npm)
fi
if ! $runtime_only; then
    # Image tests (tests/template): a local OCI registry, skopeo to push test images, htpasswd
    # (apache2-utils) and openssl for its basic and token auth, debugfs/dumpe2fs from e2fsprogs.
    PACKAGES+=(docker-registry skopeo apache2-utils openssl)
    # The console's browser tests (tests/e2e/test_console.py) drive Debian's headless Chromium.
    PACKAGES+=(chromium)
fi

log() { echo "install-host-deps: $*" >&2; }

if [ "$(id -u)" -ne 0 ]; then
    log "must run as root"
    exit 1
fi

qemu_ok() {
    local version
    version=$(qemu-system-x86_64 --version 2>/dev/null | sed -n 's/^QEMU emulator version \([0-9]*\)\..*/\1/p')
    [ -n "$version" ] && [ "$version" -ge "$MIN_QEMU_MAJOR" ] && command -v qemu-img >/dev/null
}

missing_packages() {
    local pkg
    for pkg in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}\n' "$pkg" 2>/dev/null | grep -q '^install ok installed$' || echo "$pkg"
    done
}

missing=$(missing_packages)
if qemu_ok && [ -z "$missing" ]; then
    log "all host dependencies present ($(qemu-system-x86_64 --version | head -1))"
    exit 0
fi

# Checked on Debian 12 and 13 only. Elsewhere the packages differ (Ubuntu has no
# linux-image-amd64, and its LTS releases ship QEMU < 10), so the script refuses rather than
# leave a half-working host; a host that already has everything passed the check above.
. /etc/os-release
export DEBIAN_FRONTEND=noninteractive
qemu_target=()
case "${ID:-}:${VERSION_CODENAME:-}" in
    debian:bookworm)
        list=/etc/apt/sources.list.d/bookworm-backports.list
        if ! grep -rqs '^[^#]*bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
            log "adding bookworm-backports"
            echo "deb http://deb.debian.org/debian bookworm-backports main" > "$list"
        fi
        qemu_target=(-t bookworm-backports)
        ;;
    debian:trixie) ;;
    *)
        log "unsupported system '${PRETTY_NAME:-unknown}': host setup is checked on Debian 12 (bookworm)"
        log "and 13 (trixie) only; a node needs QEMU >= $MIN_QEMU_MAJOR.0 and Debian's guest kernel package."
        log "missing here: ${missing//$'\n'/ }"
        exit 1
        ;;
esac

log "installing: ${missing//$'\n'/ } ${QEMU_PACKAGES[*]}"
apt-get update -q
# shellcheck disable=SC2086  # $missing is a newline-separated package list
apt-get install -y -q --no-install-recommends $missing
apt-get install -y -q --no-install-recommends "${qemu_target[@]}" "${QEMU_PACKAGES[@]}"
# Debian starts the registry as a system service on :5000; tests run their own on loopback.
if command -v systemctl >/dev/null && systemctl is-enabled docker-registry >/dev/null 2>&1; then
    systemctl disable --now docker-registry || true
fi

if ! qemu_ok; then
    log "QEMU >= $MIN_QEMU_MAJOR.0 is required, found: $(qemu-system-x86_64 --version 2>/dev/null | head -1)"
    exit 1
fi
log "done ($(qemu-system-x86_64 --version | head -1))"
