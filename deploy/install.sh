#!/usr/bin/env bash
# Install aenv on a Debian 12 or 13 host as systemd services, as root:
#   /opt/aenv                    a venv with the aenv package (from this source tree or --wheel)
#   /etc/aenv/{server,gateway,scheduler}.env    each service's own settings (kept when present)
#   /etc/aenv/cluster.env        the cluster's shared settings and secrets (mode 0600), made when
#                                a gateway or scheduler is enabled, or copied with --cluster-env
#   /etc/systemd/system/aenv-{server,gateway,scheduler}.service, the `aenv` system user
# Re-running it upgrades the package and keeps the configuration. Usage:
#   deploy/install.sh [--enable server,gateway,scheduler] [--wheel FILE] [--cluster-env FILE]
#                     [--skip-host-deps] [--pip-args ARGS] [--root DIR]
#   deploy/install.sh --uninstall [--purge] [--root DIR]
# --enable        enable and (re)start these services (default: install them, start none)
# --skip-host-deps  no scripts/install-host-deps.sh (hosts that run no node: gateway, scheduler)
# --pip-args ARGS more arguments for pip (e.g. "--no-deps --no-index" with a wheel, offline)
# --root DIR      install into DIR as if it were / (also DESTDIR): no apt, no systemctl start,
#                 nothing outside DIR touched (the venv's scripts name DIR/opt/aenv); for tests
# --uninstall     stop and remove the services, units and venv; configuration and node state
#                 (/etc/aenv, /var/lib/aenv) stay unless --purge
set -euo pipefail

SOURCE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEPLOY=$SOURCE/deploy
SERVICES=(server gateway scheduler)

root=${DESTDIR:-}
wheel=""
cluster_env=""
enable=()
pip_args=()
host_deps=true
uninstall=false
purge=false
staging=""

log() { echo "install.sh: $*" >&2; }
die() { log "$*"; exit 1; }
usage() { sed -n '2,21s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; exit "${1:-0}"; }

while [ $# -gt 0 ]; do
    case "$1" in
        --enable) IFS=, read -r -a enable <<< "$2"; shift 2 ;;
        --wheel) wheel=$(realpath "$2"); shift 2 ;;
        --cluster-env) cluster_env=$(realpath "$2"); shift 2 ;;
        --skip-host-deps) host_deps=false; shift ;;
        --pip-args) read -r -a pip_args <<< "$2"; shift 2 ;;
        --root) root=$(realpath -m "$2"); shift 2 ;;
        --uninstall) uninstall=true; shift ;;
        --purge) purge=true; shift ;;
        -h | --help) usage 0 ;;
        *) log "unknown argument: $1"; usage 2 ;;
    esac
done
for name in "${enable[@]}"; do
    [[ " ${SERVICES[*]} " == *" $name "* ]] || die "--enable takes ${SERVICES[*]}, got '$name'"
done
[ "$(id -u)" -eq 0 ] || [ -n "$root" ] || die "must run as root (or with --root DIR)"

VENV=$root/opt/aenv
ETC=$root/etc/aenv
UNITS=$root/etc/systemd/system
SYSUSERS=$root/etc/sysusers.d/aenv.conf

# systemctl against the real host only when it runs systemd; with --root, offline on DIR.
systemd_live() { [ -z "$root" ] && [ -d /run/systemd/system ]; }
systemctl_root() { if [ -n "$root" ]; then systemctl --root="$root" "$@"; else systemctl "$@"; fi; }
enabled() { [[ " ${enable[*]} " == *" $1 "* ]]; }

random_hex() { od -An -N32 -tx1 /dev/urandom | tr -d ' \n'; }

install_packages() {
    if $host_deps && [ -z "$root" ]; then
        bash "$SOURCE/scripts/install-host-deps.sh" --runtime
    elif [ -z "$root" ] && ! python3 -c 'import ensurepip, venv' 2>/dev/null; then
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends python3-venv
    fi
}

install_venv() {
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
    local package=$wheel
    if [ -z "$package" ]; then
        # Built from a copy: an in-tree build would leave build/ behind, whose stale modules
        # later builds would package again.
        staging=$(mktemp -d)
        trap 'rm -rf "$staging"' EXIT
        cp -r "$SOURCE/pyproject.toml" "$SOURCE/src" "$staging/"
        package=$staging
    fi
    log "installing ${wheel:-$SOURCE} into $VENV"
    # The `server` extra: a node's, gateway's and scheduler's dependencies (the bare package is the CLI).
    "$VENV/bin/pip" install -q "${pip_args[@]}" "$package[server]"
    # The same version again still replaces the code (an upgrade from a newer tree or wheel).
    "$VENV/bin/pip" install -q --no-deps --force-reinstall "${pip_args[@]}" "$package"
    install -D -m 0644 "$SOURCE/docs/deploy.md" "$VENV/share/doc/aenv/deploy.md"
}

install_config() {
    install -d -m 0755 "$ETC"
    local name
    for name in "${SERVICES[@]}"; do
        [ -e "$ETC/$name.env" ] || install -m 0644 "$DEPLOY/env/$name.env" "$ETC/$name.env"
    done
    if [ -n "$cluster_env" ]; then
        install -m 0600 "$cluster_env" "$ETC/cluster.env"
    elif [ ! -e "$ETC/cluster.env" ] && { enabled gateway || enabled scheduler; }; then
        log "new cluster: secrets in $ETC/cluster.env (copy it to the cluster's other hosts)"
        (umask 077 && sed -e "s/@API_KEY@/e2b_$(random_hex)/" -e "s/@CLUSTER_SECRET@/$(random_hex)/" \
            "$DEPLOY/env/cluster.env" > "$ETC/cluster.env")
    fi
}

install_units() {
    local name
    for name in "${SERVICES[@]}"; do
        install -D -m 0644 "$DEPLOY/systemd/aenv-$name.service" "$UNITS/aenv-$name.service"
    done
    install -D -m 0644 "$DEPLOY/systemd/aenv.sysusers" "$SYSUSERS"
    if [ -n "$root" ]; then
        systemd-sysusers --root="$root"
    elif command -v systemd-sysusers >/dev/null; then
        systemd-sysusers "$SYSUSERS"
    else
        getent passwd aenv >/dev/null || useradd --system --user-group --no-create-home \
            --home-dir / --shell /usr/sbin/nologin aenv
    fi
    systemd_live && systemctl daemon-reload
    for name in "${enable[@]}"; do
        systemctl_root enable "aenv-$name.service"
        if systemd_live; then
            systemctl restart "aenv-$name.service"
        fi
    done
    systemd_live || [ ${#enable[@]} -eq 0 ] || [ -n "$root" ] \
        || log "systemd is not running here: units installed and enabled, not started"
}

uninstall() {
    local name unit
    for name in "${SERVICES[@]}"; do
        unit=aenv-$name.service
        [ -e "$UNITS/$unit" ] || continue
        # A node stops by pausing its sandboxes (shutdown_action): they are kept in its home.
        if systemd_live; then
            systemctl disable --now "$unit"
        else
            systemctl_root disable "$unit"
        fi
        rm -f "$UNITS/$unit"
    done
    systemd_live && systemctl daemon-reload
    rm -rf "$VENV"
    rm -f "$SYSUSERS"
    if $purge; then
        rm -rf "$ETC" "$root/var/lib/aenv" "$root/var/cache/aenv"
        if [ -n "$root" ] && grep -qs '^aenv:' "$root/etc/passwd"; then
            userdel --root "$root" aenv
        elif [ -z "$root" ] && getent passwd aenv >/dev/null; then
            userdel aenv
        fi
        log "removed aenv, its configuration, state and user"
    else
        log "removed aenv; kept ${root}/etc/aenv and ${root}/var/lib/aenv (--purge removes them)"
    fi
}

if $uninstall; then
    uninstall
    exit 0
fi
install_packages
install_venv
install_config
install_units
log "installed $("$VENV/bin/python" -c 'import aenv; print("aenv", aenv.__version__)') in $VENV"
