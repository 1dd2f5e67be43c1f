"""aenv guest init (PID 1): prepare the system, keep envd running, shut down cleanly.

Runs, like envd, on the Python runtime of the read-only tools drive (``aenv.guest.runtime``),
started through the drive's own dynamic loader: nothing is needed from the image (no Python, no
shell, any libc or none), and nothing of the runtime leaks into the image's processes. It uses
the standard library only. Every step and every problem goes to /dev/console, which the host
keeps as the sandbox's serial log. Kernel command line keys: ``aenv.hostname=``,
``aenv.dns=``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import signal
import sys
import time

TOOLS = "/opt/aenv"
# The shipped runtime (built by aenv.guest.runtime, which takes these paths from here).
RUNTIME = f"{TOOLS}/runtime"
EXEC_HELPER = f"{TOOLS}/bin/aenv-exec"  # built from exec.c beside this file (aenv.guest.tools)
RUNTIME_LIB = f"{RUNTIME}/lib"
RUNTIME_BIN = f"{RUNTIME}/bin"
LOADER = f"{RUNTIME_LIB}/ld-linux-x86-64.so.2"
PYTHON_HOME = f"{RUNTIME}/python"
NO_CERTIFICATES = f"{TOOLS}/no-certificates"  # never exists: the drive is read-only
GUEST_IP = "169.254.0.21/30"
GATEWAY = "169.254.0.22"
DEFAULT_HOSTNAME = "aenv"
DEFAULT_DNS = "8.8.8.8"
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# envd restarts at once after a first crash, then backs off to at most 2 s while it keeps failing.
BACKOFF_FIRST, BACKOFF_MAX, STABLE_AFTER = 0.2, 2.0, 30.0
ENVD_STATE = "/run/aenv/envd.json"
# envd is the sandbox's only way in: the guest's OOM killer must pick anything else first.
ENVD_OOM_SCORE_ADJ = -1000
TERM_GRACE = 2.0

MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_RDONLY, MS_REMOUNT = 0x2, 0x4, 0x8, 0x1, 0x20
MNT_DETACH = 0x2
RB_AUTOBOOT, RB_DISABLE_CAD = 0x01234567, 0

# (source, target, fstype, flags, data): what a Debian userland expects to find mounted.
# /tmp stays on the root disk, as in E2B sandboxes: it keeps user xattrs and costs no guest RAM.
MOUNTS = (
    ("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, ""),
    ("sysfs", "/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, ""),
    ("devtmpfs", "/dev", "devtmpfs", MS_NOSUID, "mode=0755"),
    ("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "gid=5,mode=0620,ptmxmode=0666"),
    ("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777"),
    ("tmpfs", "/run", "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755"),
    ("cgroup2", "/sys/fs/cgroup", "cgroup2", MS_NOSUID | MS_NODEV | MS_NOEXEC, ""),
)
DEV_LINKS = {
    "/dev/fd": "/proc/self/fd",
    "/dev/stdin": "/proc/self/fd/0",
    "/dev/stdout": "/proc/self/fd/1",
    "/dev/stderr": "/proc/self/fd/2",
    "/dev/ptmx": "pts/ptmx",
}

_libc = ctypes.CDLL(None, use_errno=True)
_console_fd = 2


def log(message: str) -> None:
    """One line to the console, stamped with seconds since boot."""
    try:
        stamp = _read("/proc/uptime").split()[0]
    except OSError:
        stamp = "?"
    with contextlib.suppress(OSError):
        os.write(_console_fd, f"aenv-init [{stamp}] {message}\n".encode(errors="replace"))


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def parse_cmdline(cmdline: str) -> dict[str, str]:
    """The ``aenv.*`` keys of a kernel command line, without the prefix (last one wins)."""
    options = {}
    for word in cmdline.split():
        key, sep, value = word.partition("=")
        if key.startswith("aenv.") and sep:
            options[key.removeprefix("aenv.")] = value
    return options


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source: str, target: str, fstype: str | None, flags: int = 0, data: str = "") -> None:
    _check(
        _libc.mount(
            source.encode() if source else None,
            target.encode(),
            fstype.encode() if fstype else None,
            flags,
            data.encode() if data else None,
        ),
        f"mount {target}",
    )


def mount_filesystems() -> None:
    """Mount the API filesystems; each failure is logged and the boot goes on."""
    for source, target, fstype, flags, data in MOUNTS:
        if os.path.ismount(target):
            continue
        try:
            if fstype == "cgroup2" and "cgroup2" not in _read("/proc/filesystems"):
                log("cgroup2 not supported by this kernel; skipping")
                continue
            os.makedirs(target, exist_ok=True)
            mount(source, target, fstype, flags, data)
        except OSError as e:
            log(f"warning: {e}")
    for link, dest in DEV_LINKS.items():
        if not os.path.lexists(link):
            try:
                os.symlink(dest, link)
            except OSError as e:
                log(f"warning: symlink {link}: {e}")


def set_hostname(name: str) -> None:
    with open("/proc/sys/kernel/hostname", "w") as f:
        f.write(name)
    os.makedirs("/etc", exist_ok=True)  # an image may come without one
    with open("/etc/hostname", "w") as f:
        f.write(name + "\n")
    try:
        with open("/etc/hosts") as f:
            lines = [line for line in f.read().splitlines() if not line.startswith("127.0.1.1")]
    except FileNotFoundError:
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
    with open("/etc/hosts", "w") as f:
        f.write("\n".join([*lines, f"127.0.1.1\t{name}"]) + "\n")


def shipped(program: str, *args: str) -> list[str]:
    """argv running one of the tools drive's programs on the drive's own loader and libraries.

    ``--library-path`` applies to that process only: what it execs uses the image's libraries."""
    return [LOADER, "--library-path", RUNTIME_LIB, f"{RUNTIME_BIN}/{program}", *args]


def spawn(argv: list[str], env: dict[str, str] | None = None) -> int:
    """Start a child with a clean signal mask and the console as stdout and stderr."""
    actions = [
        (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
        (os.POSIX_SPAWN_DUP2, _console_fd, 1),
        (os.POSIX_SPAWN_DUP2, _console_fd, 2),
    ]
    return os.posix_spawn(
        argv[0],
        argv,
        env if env is not None else {"PATH": PATH},
        file_actions=actions,
        setsigmask=(),
        setsid=True,
    )


def run(argv: list[str], stdin: bytes = b"") -> int:
    """Run a command to completion (during startup, before the reaping loop takes over)."""
    read_end, write_end = os.pipe()
    actions = [
        (os.POSIX_SPAWN_DUP2, read_end, 0),
        (os.POSIX_SPAWN_CLOSE, write_end),
        (os.POSIX_SPAWN_DUP2, _console_fd, 1),
        (os.POSIX_SPAWN_DUP2, _console_fd, 2),
    ]
    pid = os.posix_spawn(argv[0], argv, {"PATH": PATH}, file_actions=actions, setsigmask=())
    os.close(read_end)
    os.write(write_end, stdin)
    os.close(write_end)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def configure_network(dns: str) -> None:
    """Static addressing on the point-to-point link to the host's tap (docs/design.md, Platform)."""
    commands = [b"link set lo up"]
    if os.path.exists("/sys/class/net/eth0"):
        commands += [
            f"addr add {GUEST_IP} dev eth0".encode(),
            b"link set eth0 up",
            f"route add default via {GATEWAY} dev eth0".encode(),
        ]
    else:
        log("no eth0: the VM has no network device; loopback only")
    code = run(shipped("ip", "-force", "-batch", "-"), b"\n".join(commands) + b"\n")
    if code != 0:
        log(f"warning: ip exited {code}")
    if os.path.islink("/etc/resolv.conf"):
        os.unlink("/etc/resolv.conf")
    with open("/etc/resolv.conf", "w") as f:
        f.write(f"nameserver {dns}\n")


def envd_env() -> dict[str, str]:
    """envd's own environment; the processes it starts get one of their own (see envd's process)."""
    return {
        "PATH": PATH,
        "PYTHONHOME": PYTHON_HOME,
        "PYTHONPATH": f"{TOOLS}/lib",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
        "HOME": "/root",
        "USER": "root",
        "LANG": "C.UTF-8",
        # envd opens no TLS connection, yet aiohttp makes two client TLS contexts when imported;
        # loading the image's CA certificates into them took ~1.8 s of envd's start under TCG.
        "SSL_CERT_FILE": NO_CERTIFICATES,
        "SSL_CERT_DIR": NO_CERTIFICATES,
    }


class Envd:
    """envd as a supervised child: restarted with exponential backoff whenever it exits."""

    def __init__(self) -> None:
        self.pid = 0
        self.started = 0.0
        self.backoff = BACKOFF_FIRST
        self.restart_at: float | None = time.monotonic()

    def start(self) -> None:
        self.restart_at = None
        # -S: envd's packages come from PYTHONPATH; skipping site saves start time under TCG.
        argv = shipped(
            "python3", "-S", "-m", "aenv_envd", "--host-peer", GATEWAY, "--state-file", ENVD_STATE,
            "--exec-helper", EXEC_HELPER,
        )  # fmt: skip
        try:
            self.pid = spawn(argv, envd_env())
        except OSError as e:
            log(f"cannot start envd: {e}")
            self.exited(None)
            return
        self.started = time.monotonic()
        protect_from_oom(self.pid)
        log(f"envd started (pid {self.pid})")

    def exited(self, status: int | None) -> None:
        self.pid = 0
        now = time.monotonic()
        if status is not None:
            log(f"envd exited with code {os.waitstatus_to_exitcode(status)} after {now - self.started:.1f} s")
        if now - self.started > STABLE_AFTER:
            self.backoff = BACKOFF_FIRST
        self.restart_at = now + self.backoff
        log(f"restarting envd in {self.backoff:.1f} s")
        self.backoff = min(self.backoff * 2, BACKOFF_MAX)

    def timeout(self) -> float | None:
        return None if self.restart_at is None else max(0.0, self.restart_at - time.monotonic())


def protect_from_oom(pid: int) -> None:
    """Exempt envd from the OOM killer (its children raise their own score again, see envd)."""
    try:
        with open(f"/proc/{pid}/oom_score_adj", "w") as f:
            f.write(str(ENVD_OOM_SCORE_ADJ))
    except OSError as e:
        log(f"warning: cannot protect envd from the OOM killer: {e}")


def reap(envd: Envd) -> None:
    """Collect every exited child so no zombie stays; notice when it was envd."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid == envd.pid:
            envd.exited(status)


def _wait_children(deadline: float) -> bool:
    """Reap until no child is left or the deadline passes; True when none is left."""
    while time.monotonic() < deadline:
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            return True
        time.sleep(0.02)
    return False


def shutdown(reason: str) -> None:
    """Stop every process, flush and unmount the disks, then reboot (QEMU -no-reboot exits)."""
    log(f"shutting down ({reason})")
    for sig, grace in ((signal.SIGTERM, TERM_GRACE), (signal.SIGKILL, 1.0)):
        try:
            os.kill(-1, sig)
        except ProcessLookupError:
            break
        if _wait_children(time.monotonic() + grace):
            break
    os.sync()
    try:
        with open("/proc/mounts") as f:
            targets = [line.split()[1] for line in f]
    except OSError:
        targets = []
    for target in reversed(targets):
        if target == "/":
            continue
        if _libc.umount2(target.encode(), 0) != 0 and ctypes.get_errno() not in (errno.EINVAL, errno.ENOENT):
            _libc.umount2(target.encode(), MNT_DETACH)
    try:
        mount("", "/", None, MS_REMOUNT | MS_RDONLY)
    except OSError as e:
        log(f"warning: {e}")
    os.sync()
    log("reboot")
    _libc.reboot(RB_AUTOBOOT)


def boot() -> Envd:
    mount_filesystems()
    options = parse_cmdline(_read("/proc/cmdline"))
    log(f"init started (python {sys.version.split()[0]}, options {options})")
    steps = (
        ("hostname", lambda: set_hostname(options.get("hostname") or DEFAULT_HOSTNAME)),
        ("network", lambda: configure_network(options.get("dns") or DEFAULT_DNS)),
    )
    for name, step in steps:
        try:
            step()
        except Exception as e:
            log(f"warning: {name} setup failed: {e!r}")
    os.environ.clear()
    os.environ.update({"PATH": PATH, "HOME": "/root"})
    return Envd()


def main() -> None:
    global _console_fd
    try:
        _console_fd = os.open("/dev/console", os.O_WRONLY | os.O_NOCTTY)
    except OSError:
        _console_fd = 2
    signals = {signal.SIGCHLD, signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    _libc.reboot(RB_DISABLE_CAD)  # Ctrl-Alt-Del arrives as SIGINT: a clean shutdown
    try:
        envd = boot()
        while True:
            if envd.restart_at is not None and envd.restart_at <= time.monotonic():
                envd.start()
            info = signal.sigtimedwait(signals, envd.timeout() if envd.timeout() is not None else 3600.0)
            if info is None:
                continue
            if info.si_signo == signal.SIGCHLD:
                reap(envd)
            else:
                shutdown(signal.Signals(info.si_signo).name)
                return
    except BaseException:
        import traceback  # only on this path: every import costs boot time under TCG

        log("fatal error in init:\n" + traceback.format_exc())
        shutdown("init failed")


if __name__ == "__main__":
    if os.getpid() != 1:
        sys.exit("aenv init must run as PID 1 inside the guest")
    main()
