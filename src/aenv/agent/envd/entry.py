"""EntryInfo construction: stat data rendered the way the reference (Go) envd renders it."""

from __future__ import annotations

import grp
import os
import pwd
import stat
import time
from functools import lru_cache
from typing import Any

XATTR_PREFIX = "user.e2b."

# Go's os.FileMode.String() type letters, in Go's bit order ("dalTLDpSugct").
_GO_TYPE_LETTERS = (
    (stat.S_ISDIR, "d"),
    (stat.S_ISLNK, "L"),
    (lambda m: stat.S_ISBLK(m) or stat.S_ISCHR(m), "D"),
    (stat.S_ISFIFO, "p"),
    (stat.S_ISSOCK, "S"),
    (lambda m: bool(m & stat.S_ISUID), "u"),
    (lambda m: bool(m & stat.S_ISGID), "g"),
    (stat.S_ISCHR, "c"),
    (lambda m: bool(m & stat.S_ISVTX), "t"),
)


def go_mode_string(mode: int) -> str:
    """Render a st_mode like Go's FileMode.String() (e.g. "drwxr-xr-x", "Lrwxrwxrwx", "urwxr-xr-x")."""
    kind = "".join(letter for test, letter in _GO_TYPE_LETTERS if test(mode)) or "-"
    return kind + "".join(c if mode & (1 << (8 - i)) else "-" for i, c in enumerate("rwxrwxrwx"))


@lru_cache(maxsize=256)
def owner_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


@lru_cache(maxsize=256)
def group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def rfc3339(ts_ns: int) -> str:
    secs, nanos = divmod(ts_ns, 1_000_000_000)
    base = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(secs))
    return f"{base}.{nanos:09d}Z" if nanos else f"{base}Z"


def read_metadata(path: str) -> dict[str, str]:
    """`user.e2b.*` xattrs with the prefix stripped (empty where xattrs are unsupported)."""
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return {}
    out = {}
    for name in names:
        if name.startswith(XATTR_PREFIX):
            try:
                out[name[len(XATTR_PREFIX) :]] = os.getxattr(path, name, follow_symlinks=False).decode(
                    errors="replace"
                )
            except OSError:
                continue
    return out


def write_metadata(target: str | int, metadata: dict[str, str]) -> None:
    """Replace all `user.e2b.*` xattrs of a file (a path or an open descriptor) with `metadata`."""
    for name in os.listxattr(target):
        if name.startswith(XATTR_PREFIX):
            os.removexattr(target, name)
    for key, value in metadata.items():
        os.setxattr(target, XATTR_PREFIX + key, value.encode())


def file_type(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "FILE_TYPE_DIRECTORY"
    if stat.S_ISLNK(mode):
        return "FILE_TYPE_SYMLINK"
    return "FILE_TYPE_FILE"


def entry_info(path: str, name: str | None = None, lst: os.stat_result | None = None) -> dict[str, Any]:
    """EntryInfo JSON for `path` (not following a final symlink for identity, but reporting the target's
    type/mode/size as envd does). Raises OSError if `path` is missing."""
    lst = lst or os.lstat(path)
    st = lst
    entry: dict[str, Any] = {"name": name if name is not None else os.path.basename(path) or path}
    if stat.S_ISLNK(lst.st_mode):
        entry["isSymlink"] = True
        try:
            st = os.stat(path)
            entry["symlinkTarget"] = os.path.realpath(path)
        except OSError:
            entry["symlinkTarget"] = os.readlink(path)
    entry.update(
        type=file_type(st.st_mode),
        path=path,
        size=str(st.st_size),
        mode=stat.S_IMODE(st.st_mode) & 0o777,
        permissions=go_mode_string(lst.st_mode),
        owner=owner_name(lst.st_uid),
        group=group_name(lst.st_gid),
        modifiedTime=rfc3339(lst.st_mtime_ns),
    )
    metadata = read_metadata(path)
    if metadata:
        entry["metadata"] = metadata
    return entry
