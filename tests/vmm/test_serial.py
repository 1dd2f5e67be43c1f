"""The serial console's ring without a VM: its size stays bounded however much a guest writes,
and pages name the same lines across rotations."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

from aenv.vmm import serial
from aenv.vmm.serial import OLDER_LOG, SERIAL_LOG, SerialPump, SerialRing, read_lines

CAPACITY = 64 * 1024


def ring_bytes(workdir: Path) -> int:
    return sum(
        (workdir / name).stat().st_size for name in (SERIAL_LOG, OLDER_LOG) if (workdir / name).exists()
    )


def test_a_flood_keeps_the_ring_within_its_capacity(tmp_path: Path) -> None:
    ring = SerialRing(tmp_path, CAPACITY)
    for n in range(20_000):
        ring.write(f"line {n}\r\n".encode())
        assert ring_bytes(tmp_path) <= CAPACITY + 2 * serial.MAX_LINE
    ring.close()
    first, page = read_lines(tmp_path, 0, 100_000)
    assert page[-1] == "line 19999" and len(page) < 20_000  # the oldest lines were dropped
    assert page == [f"line {n}" for n in range(first, 20_000)]  # whole lines, in order, numbered


def test_lines_keep_their_numbers_across_rotations_and_reopening(tmp_path: Path) -> None:
    ring = SerialRing(tmp_path, CAPACITY)
    for n in range(5_000):
        ring.write(f"line {n}\n".encode())
    ring.close()
    ring = SerialRing(tmp_path, CAPACITY)  # as after a resume or a node restart
    for n in range(5_000, 12_000):
        ring.write(f"line {n}\n".encode())
    ring.close()
    assert read_lines(tmp_path, 11_990, 5) == (11_990, [f"line {n}" for n in range(11_990, 11_995)])
    first, oldest = read_lines(tmp_path, 0, 3)
    assert first > 0 and oldest == [f"line {n}" for n in range(first, first + 3)]
    assert read_lines(tmp_path, 12_000, 10) == (12_000, [])


def test_an_endless_line_is_cut_and_an_unfinished_one_waits(tmp_path: Path) -> None:
    ring = SerialRing(tmp_path, CAPACITY)
    for _ in range(100):
        ring.write(b"y" * 4096)  # no newline ever
        assert ring_bytes(tmp_path) <= CAPACITY + 2 * serial.MAX_LINE
    ring.write(b"\nhalf a li")
    assert read_lines(tmp_path, 0, 10)[1][-1].startswith("y")  # the unfinished line is not shown
    ring.write(b"ne\n")
    ring.close()
    assert read_lines(tmp_path, 0, 10_000)[1][-1] == "half a line"


def test_a_sandbox_without_a_console_has_no_lines(tmp_path: Path) -> None:
    assert read_lines(tmp_path / "gone", 0, 10) == (0, [])
    assert read_lines(tmp_path, 5, 10) == (5, [])


def test_the_pump_copies_the_socket_into_the_ring(tmp_path: Path) -> None:
    async def scenario() -> None:
        ours, qemu = socket.socketpair()
        ours.setblocking(False)
        pump = SerialPump(tmp_path, ours)
        qemu.sendall(b"[    0.000000] Linux version\r\nboot done\r\n")
        qemu.close()  # QEMU exits
        await asyncio.wait_for(pump.task, 30)
        await pump.stop()

    asyncio.run(scenario())
    assert read_lines(tmp_path, 0, 10) == (0, ["[    0.000000] Linux version", "boot done"])


def test_the_ring_follows_its_directory_when_renamed(tmp_path: Path) -> None:
    """A warm VM's directory becomes its sandbox's while its console is being written."""
    (tmp_path / "warm").mkdir()
    ring = SerialRing(tmp_path / "warm", CAPACITY)
    ring.write(b"restored\n")
    (tmp_path / "warm").rename(tmp_path / "sandbox")
    for n in range(5_000):
        ring.write(f"line {n}\n".encode())
    ring.close()
    assert read_lines(tmp_path / "sandbox", 4_998, 10) == (4_998, ["line 4997", "line 4998", "line 4999"])
