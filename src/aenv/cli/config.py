"""Where the CLI finds its server: `AENV_URL`/`AENV_API_KEY`, else the credentials file `aenv auth` wrote."""

from __future__ import annotations

import json
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

DEFAULT_URL = "http://localhost:8000"


class CLIError(Exception):
    """A failure explained to the user in one sentence; `code` is the process exit status, `status`
    the server's HTTP status when it answered."""

    def __init__(self, message: str, code: int = 1, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.status = status


@dataclass(frozen=True)
class Credentials:
    url: str
    api_key: str


def credentials_path() -> Path:
    """`$XDG_CONFIG_HOME/aenv/credentials`, `~/.config/aenv/credentials` without it (Linux and macOS)."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "aenv" / "credentials"


def read_file(path: Path | None = None) -> dict[str, str]:
    path = path or credentials_path()
    try:
        document = tomllib.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise CLIError(f"cannot read credentials {path}: {exc}; run `aenv auth` to rewrite them") from exc
    return {k: str(v) for k, v in document.items() if k in ("url", "api_key")}


def load() -> Credentials:
    """Environment first (so one shell can point elsewhere), then the file."""
    stored = read_file()
    url = os.environ.get("AENV_URL") or stored.get("url") or DEFAULT_URL
    key = os.environ.get("AENV_API_KEY") or stored.get("api_key")
    if not key:
        raise CLIError(
            f"not authenticated: run `aenv auth` first or set AENV_API_KEY "
            f"(expected credentials at {credentials_path()})"
        )
    return Credentials(normalize_url(url), key)


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url


def save(credentials: Credentials, path: Path | None = None) -> Path:
    """Write TOML with mode 0600 from the start (never world-readable, even briefly)."""
    path = path or credentials_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        # JSON string escapes are valid TOML basic strings.
        f.write(f"url = {json.dumps(credentials.url)}\napi_key = {json.dumps(credentials.api_key)}\n")
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
    return path
