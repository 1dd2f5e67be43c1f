"""The interactive shell in a pseudo-terminal: keys, resize, Ctrl-C, exit status, terminal restored."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pty
import re
import select
import signal
import struct
import termios
import time

import pytest

from .conftest import CLI

pytestmark = pytest.mark.vm


class Terminal:
    """The CLI on the slave side of a pty; the test types on and reads the master side."""

    def __init__(self, cli: CLI, *args: str, rows: int = 30, cols: int = 100) -> None:
        pid, fd = pty.fork()
        if pid == 0:  # the child: become the CLI
            env = cli.env | {"TERM": "xterm"}
            os.chdir(cli.home)
            os.execve(cli.command()[0], cli.command(*args), env)
        self.pid, self.fd = pid, fd
        self.resize(rows, cols)
        self.seen = b""

    def resize(self, rows: int, cols: int) -> None:
        """TIOCSWINSZ on the master: the kernel sends SIGWINCH to the CLI as a terminal would."""
        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    def send(self, data: bytes) -> None:
        os.write(self.fd, data)

    def expect(self, pattern: bytes, timeout: float = 60) -> re.Match[bytes]:
        deadline = time.monotonic() + timeout
        while True:
            if match := re.search(pattern, self.seen):
                self.seen = self.seen[match.end() :]
                return match
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{pattern!r} not seen; output so far: {self.seen[-2000:]!r}")
            if select.select([self.fd], [], [], min(left, 1.0))[0]:
                try:
                    self.seen += os.read(self.fd, 65536)
                except OSError:  # EIO: the CLI exited and closed the slave
                    time.sleep(0.1)

    def wait(self, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                if select.select([self.fd], [], [], 0.2)[0]:
                    self.seen += os.read(self.fd, 65536)
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        raise AssertionError(f"the CLI did not exit; output: {self.seen[-2000:]!r}")

    def modes(self) -> list:
        return termios.tcgetattr(self.fd)

    def close(self) -> None:
        with contextlib.suppress(ChildProcessError, ProcessLookupError):
            if os.waitpid(self.pid, os.WNOHANG)[0] == 0:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
        os.close(self.fd)


def test_interactive_shell(cli: CLI, sandbox: str) -> None:
    term = Terminal(cli, "connect", sandbox)
    cooked = term.modes()
    try:
        term.expect(rb"\$ ")  # the remote prompt: the session is up and the local terminal raw
        term.send(b"export PS1='READY> '\r")
        term.expect(b"READY> ")
        # Raw mode: the local terminal neither echoes nor interprets; the remote PTY does.
        assert not term.modes()[3] & (termios.ECHO | termios.ICANON | termios.ISIG)

        term.send(b"stty size\r")
        term.expect(rb"30 100\r\n")
        term.resize(40, 120)
        time.sleep(0.5)
        term.send(b"stty size\r")
        term.expect(rb"40 120\r\n")

        term.send(b"echo $((6 * 7))\r")
        term.expect(rb"[\r\n]42\r\n")
        term.send(b"sleep 600\r")
        time.sleep(1.0)
        started = time.monotonic()
        term.send(b"\x03")  # Ctrl-C reaches the remote sleep, not the CLI
        term.expect(b"READY> ")
        assert time.monotonic() - started < 30
        # Typed once bash has run the line (the echo shows it): keys that arrive while bash hands
        # the terminal back from readline can be taken in readline's mode (no CR to NL), and cat
        # then waits for a line forever.
        term.send(b"echo cat-$((2 + 3)); cat\r")
        term.expect(b"cat-5\r\n")
        term.send(b"typed\r")
        term.expect(b"typed\r\n")
        term.send(b"\x04")  # Ctrl-D ends remote cat, the shell stays
        term.expect(b"READY> ")

        term.send(b"exit 3\r")
        assert term.wait() == 3
        restored = term.modes()
        assert restored[3] == cooked[3] and restored[0] == cooked[0] and restored[1] == cooked[1]
        assert f"Connection to sandbox {sandbox} closed.".encode() in term.seen
    finally:
        term.close()


def test_start_attaches_and_rm_deletes(cli: CLI) -> None:
    term = Terminal(cli, "start", "base", "--rm", "--metadata", "purpose=rm-test")
    try:
        term.send(b"echo inside-$((1+1))\r")
        term.expect(b"inside-2")
        term.send(b"exit\r")
        assert term.wait() == 0
    finally:
        term.close()
    assert cli.ok("ls", "--metadata", "purpose=rm-test").json() == []


def test_session_ends_cleanly_when_the_sandbox_is_paused(cli: CLI, sandbox: str) -> None:
    term = Terminal(cli, "cn", sandbox)
    cooked = term.modes()
    try:
        term.expect(rb"\$ ")  # the remote prompt: keys typed before it would be echoed locally
        term.send(b"echo attached\r")
        term.expect(b"attached")
        cli.ok("pause", sandbox)
        assert term.wait(120) == 255
        assert term.modes()[3] == cooked[3]
        term.expect(b"has been paused")
    finally:
        term.close()
    assert cli.ok("resume", sandbox).json()[0]["sandboxID"] == sandbox
