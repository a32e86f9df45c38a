"""Who may call an engine server, with SGLang's two keys.

SGLang serves `--api-key` (every route but health and metrics) and `--admin-api-key` (the control routes:
weights, aborts, LoRA, cache, generation pause). The embedded server applies the same rules to its own
routes, and `miles rollout` always starts its servers (SGLang's too) with an admin token, so no other local
process can load weights, read them, abort requests or join a weight-update group:

- the token is `MILES_ADMIN_TOKEN` when set, else the file `MILES_ADMIN_TOKEN_FILE` names (default
  `~/.config/miles/admin_token`), created with mode 0600 the first time a server needs one;
- `SGLangClient` sends it on control calls, so `miles train` on the same machine (or with the same variable)
  needs no setting; a server that refuses it is a one-line error naming the fix;
- `miles rollout --api-key KEY` also closes generation and the info routes to holders of `KEY`, which clients
  read from `MILES_API_KEY`.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from miles.config import ConfigError

TOKEN_ENV = "MILES_ADMIN_TOKEN"
TOKEN_FILE_ENV = "MILES_ADMIN_TOKEN_FILE"
#: An API key for every other route but health and metrics (`miles rollout --api-key`; off by default, as in
#: SGLang, whose `/generate` is open on loopback).
API_KEY_ENV = "MILES_API_KEY"

#: The routes only the admin token opens (as SGLang marks them): weights, aborts, LoRA, the cache, pausing.
ADMIN_PATHS = frozenset(
    {
        "/abort_request",
        "/flush_cache",
        "/pause_generation",
        "/continue_generation",
        "/update_weight_version",
        "/get_weights_by_name",
        "/update_weights_from_disk",
        "/init_weights_update_group",
        "/begin_weight_update",
        "/end_weight_update",
        "/update_weights_from_distributed",
        "/destroy_weights_update_group",
        "/load_lora_adapter",
        "/unload_lora_adapter",
    }
)
#: Open whatever the keys: probes and scrapers carry no secrets (as in SGLang).
OPEN_PREFIXES = ("/health", "/ready", "/metrics")


def token_file() -> Path:
    """Where the admin token lives when `MILES_ADMIN_TOKEN` is unset."""
    return Path(os.environ.get(TOKEN_FILE_ENV) or Path.home() / ".config" / "miles" / "admin_token")


def api_key() -> str | None:
    """The API key servers require and clients send on the other routes: `MILES_API_KEY`, or None."""
    return os.environ.get(API_KEY_ENV) or None


def admin_token(*, create: bool = False) -> str | None:
    """The admin token: `MILES_ADMIN_TOKEN`, else the token file (made, 0600, when `create` and missing)."""
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV]
    path = token_file()
    if path.is_file():
        mode = path.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(TOKEN_FILE_ENV, f"{path} is readable by other users; chmod 600 {path}")
        token = path.read_text().strip()
        if token:
            return token
    if not create:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another server made it first: use theirs
        return admin_token(create=False) or token
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def refusal(
    path: str, authorization: str | None, *, api_key: str | None, admin_key: str | None
) -> int | None:
    """401 when a request to `path` lacks the key it needs, else None: control routes need the admin key (the
    API key when the server has only that), other routes the API key when the server has one."""
    if path.startswith(OPEN_PREFIXES):
        return None
    scheme, _, given = (authorization or "").partition(" ")
    given = given.strip() if scheme.lower() == "bearer" else ""

    def holds(key: str) -> bool:
        return bool(given) and secrets.compare_digest(given.encode(), key.encode())

    needed = (admin_key or api_key) if path in ADMIN_PATHS else api_key
    if needed is None or holds(needed):
        return None
    return 401
