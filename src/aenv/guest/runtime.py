"""The guest agent's own runtime: the host's Debian CPython with its loader, libraries and stdlib.

init and envd must run in any image: no Python, no bash, glibc or musl or no libc at all. So the
tools drive carries the interpreter together with the shared libraries it and its extension
modules link against (their whole closure, glibc included) and its standard library. The guest
starts it through the shipped dynamic loader (``ld-linux-x86-64.so.2 --library-path LIB
python3``), so nothing of the image's libraries is used and nothing is put in the environment:
the processes envd starts exec the image's own programs on the image's own libraries.

Also shipped the same way: iproute2's ``ip``, which init uses to set up the network.

Layout (relative to the tools mount; ``aenv.agent.init`` holds the guest paths)::

    runtime/lib/ld-linux-x86-64.so.2, libc.so.6, ...   the loader and every library
    runtime/bin/python3, runtime/bin/ip
    runtime/python/lib/python3.X/...                    PYTHONHOME: stdlib and lib-dynload

Needs the host's Debian ``python3`` (libpython3.X-stdlib) and ``iproute2``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from aenv.agent import init as guest
from aenv.guest.cache import cached_build, file_digest, inputs_key, tree_digest

# Debian's interpreter, not whatever `python3` is first on PATH (a pyenv or venv one would come
# without its libraries in the system's places).
INTERPRETER = Path(os.path.realpath("/usr/bin/python3"))
PROGRAMS = {"python3": INTERPRETER, "ip": Path("/usr/sbin/ip")}
# glibc dlopens libgcc_s when a thread exits (pthread_exit unwinds); Python threads do exit.
DLOPENED = ("libgcc_s.so.1",)
# What envd and init never use: tests, GUIs and terminals, databases, the static libpython, docs.
STDLIB_EXCLUDED = (
    "config-*",
    "test",
    "idlelib",
    "tkinter",
    "turtledemo",
    "turtle.py",
    "ensurepip",
    "lib2to3",
    "pydoc_data",
    "distutils",
    "sqlite3",
    "dbm",
    "curses",
    "__pycache__",
    "site-packages",
    "dist-packages",
    "EXTERNALLY-MANAGED",
)
DYNLOAD_EXCLUDED = re.compile(
    r"^(_test|_ctypes_test|xxlimited|_xxtestfuzz|_curses|readline|_dbm|_sqlite3|nis)"
)
PRODUCT = "runtime"  # the directory, as its paths are relative to the tools mount
_LDD_LINE = re.compile(r"^\s*(?:\S+ => )?(/\S+) \(0x[0-9a-f]+\)$")


def python_version() -> str:
    """``3.X`` of the shipped interpreter (decides the stdlib's directory and the wheels to vendor)."""
    match = re.fullmatch(r"python(3\.\d+)", INTERPRETER.name)
    if match is None or not INTERPRETER.is_file():
        raise RuntimeError(f"no Debian python3 at {INTERPRETER}: install the host's python3 package")
    return match.group(1)


def stdlib() -> Path:
    return Path("/usr/lib") / f"python{python_version()}"


def _extensions() -> list[Path]:
    return sorted(p for p in (stdlib() / "lib-dynload").glob("*.so") if not DYNLOAD_EXCLUDED.match(p.name))


def shared_libraries(binaries: list[Path]) -> list[Path]:
    """Every library the binaries load (the loader included), as ldd resolves them on this host."""
    out = subprocess.run(["ldd", *map(str, binaries)], capture_output=True, text=True, check=True).stdout
    found = {Path(m.group(1)) for line in out.splitlines() if (m := _LDD_LINE.match(line))}
    return sorted(found - set(binaries))


def add_libraries(out: Path, packages: Path) -> None:
    """Ship the libraries that the extension modules under ``packages`` (envd's vendored wheels,
    installed on top of the runtime) link against and the runtime lacks, beside its own under
    ``out``.

    The loader looks in the runtime first and then in the image: a wheel built for an older
    glibc links ``libpthread.so.0``, which a glibc of our version no longer needs, and the
    image's copy, of another glibc, fails against the shipped libc. Modules with a Python
    fallback then silently run without their C code; the others do not load at all.
    Libraries a wheel bundles itself (found through its RPATH) stay where they are.
    """
    lib = out / _relative(guest.RUNTIME_LIB)
    modules = sorted(packages.rglob("*.so"))
    for library in shared_libraries(modules) if modules else []:
        if not library.is_relative_to(packages) and not (lib / library.name).exists():
            shutil.copy2(library.resolve(), lib / library.name)


def _find_library(name: str) -> Path:
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        words = line.split()
        if words and words[0] == name and "x86-64" in line:
            return Path(words[-1])
    raise RuntimeError(f"{name} not found on this host")


def _libraries() -> list[Path]:
    return [*shared_libraries([*PROGRAMS.values(), *_extensions()]), *map(_find_library, DLOPENED)]


def runtime_key() -> str:
    """Hash of the programs, libraries and stdlib the runtime is made of, and of this builder."""
    files = [*PROGRAMS.values(), *_extensions(), *_libraries()]
    return inputs_key(
        builder=file_digest(Path(__file__)),
        files=[f"{p}:{file_digest(p)}" for p in files],
        stdlib=tree_digest(stdlib(), "*.py"),
        excluded=STDLIB_EXCLUDED,
    )


def _relative(guest_path: str) -> Path:
    return Path(guest_path).relative_to(guest.TOOLS)


def _build(out: Path) -> None:
    lib = out / _relative(guest.RUNTIME_LIB)
    lib.mkdir(parents=True)
    for library in _libraries():
        shutil.copy2(library.resolve(), lib / library.name)
    (lib / Path(guest.LOADER).name).chmod(0o755)
    programs = out / _relative(guest.RUNTIME_BIN)
    programs.mkdir()
    for name, program in PROGRAMS.items():
        shutil.copy2(program, programs / name)
    home = out / _relative(guest.PYTHON_HOME) / "lib" / stdlib().name
    shutil.copytree(stdlib(), home, ignore=shutil.ignore_patterns(*STDLIB_EXCLUDED))
    for module in (home / "lib-dynload").glob("*.so"):
        if DYNLOAD_EXCLUDED.match(module.name):
            module.unlink()
    compile_tree(home)


def compile_tree(root: Path) -> None:
    """Byte-compile ``root`` with the shipped interpreter itself: the drive is read-only, so the
    guest could never write .pyc files, and only this interpreter's bytecode is sure to match."""
    subprocess.run(
        [
            str(INTERPRETER),
            "-m",
            "compileall",
            "-q",
            "-j",
            "0",
            "--invalidation-mode",
            "unchecked-hash",
            str(root),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )


def ensure_runtime() -> tuple[Path, str]:
    """Directory (cached, built if missing) whose ``runtime`` subtree goes on the tools drive, and its key."""
    key = runtime_key()
    return cached_build("runtime", key, _build, PRODUCT), key
