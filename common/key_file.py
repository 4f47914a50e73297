"""Shared secrets from a file: the client API's keys and the scheduler <-> worker token.

A file holds one secret per line (blank lines and `#` comments skipped), so that a secret can be
rotated by listing old and new together for a while: a checker accepts every one listed, a
sender sends the first. The file is read again when its modification time changes (a mounted
Kubernetes Secret is replaced in place), and an unreadable or emptied file keeps the secrets read
before. A presented secret is compared with every accepted one through hmac.compare_digest of
their SHA-256 digests: the time taken depends neither on where they first differ nor on their
lengths.

Nothing here imports either service: the scheduler and the worker both use it.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from collections.abc import Iterable
from typing import Any

logger = logging.getLogger(__name__)


def _digest(secret: str | bytes) -> bytes:
    return hashlib.sha256(secret.encode() if isinstance(secret, str) else secret).digest()


def parse_keys(text: str) -> list[str]:
    keys = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keys.append(line)
    return keys


class KeyFile:
    """The accepted secrets, from a list or from a file that is read again when it changes."""

    what = "key"  # how errors and logs name the secret
    recheck_s = 0.0  # the file's modification time is looked at no more often than this

    def __init__(self, keys: Iterable[str] = (), path: str | None = None) -> None:
        self.path = path
        self._mtime: float | None = None
        self._next_look = 0.0
        self._keys: list[str] = list(keys)
        self._digests: list[bytes] = [_digest(k) for k in self._keys]
        if path is not None:
            self._reload(force=True)
        if not self._digests:
            raise ValueError(f"no {self.what} given{f' in {path!r}' if path else ''}: the file "
                             f"holds one {self.what} per line")

    @classmethod
    def from_file(cls, path: str) -> Any:
        return cls(path=path)

    def _reload(self, force: bool = False) -> None:
        assert self.path is not None
        if not force and self.recheck_s:
            now = time.monotonic()
            if now < self._next_look:
                return
            self._next_look = now + self.recheck_s
        try:
            mtime = os.stat(self.path).st_mtime
            if not force and mtime == self._mtime:
                return
            with open(self.path) as f:
                keys = parse_keys(f.read())
        except OSError as e:
            if force:
                raise ValueError(f"cannot read the {self.what} file {self.path!r}: "
                                 f"{e.strerror}") from None
            logger.warning("keeping the current %ss: %s", self.what, e)
            return
        if not keys and not force:
            logger.warning("the %s file %r is empty now: keeping the current %ss", self.what,
                           self.path, self.what)
            return
        self._keys = keys
        self._digests = [_digest(k) for k in keys]
        self._mtime = mtime

    def check(self, presented: str | bytes) -> bool:
        if self.path is not None:
            self._reload()
        given = _digest(presented)
        ok = False
        for digest in self._digests:  # no early exit: every key costs the same
            ok |= hmac.compare_digest(given, digest)
        return ok

    def current(self) -> str:
        """The secret a sender presents: the file's first (the newest, during a rotation)."""
        if self.path is not None:
            self._reload()
        return self._keys[0]


class WorkerToken(KeyFile):
    """The token the scheduler presents to its workers (`--worker-token-file` on both), and that
    a worker presents when it registers (metadata WORKER_TOKEN_HEADER: `authorization` carries
    the client API key there)."""

    what = "worker token"
    # Every step's call presents and checks it: looking at the file once a second, sending and
    # checking cost ~2.7 us a call, against ~14 us with a stat each time (same run, a loaded
    # 2-core machine); a rotation waits that second.
    recheck_s = 1.0


WORKER_TOKEN_HEADER = "x-batchwire-worker-token"


def header_value(metadata: Iterable[tuple[str, Any]] | None, name: str) -> str | None:
    for key, value in metadata or ():
        if key.lower() == name:
            return value.decode("latin-1") if isinstance(value, bytes) else str(value)
    return None


def bearer_token(metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    """The secret of the first `authorization: Bearer <secret>` entry, or None."""
    for name, value in metadata or ():
        if name.lower() != "authorization":
            continue
        text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
        scheme, _, token = text.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
        return None
    return None


def bearer_metadata(secret: str | None) -> tuple[tuple[str, str], ...] | None:
    """gRPC call metadata that presents secret (None: nothing to present)."""
    return (("authorization", f"Bearer {secret}"),) if secret else None


__all__ = ["WORKER_TOKEN_HEADER", "KeyFile", "WorkerToken", "bearer_metadata", "bearer_token",
           "header_value", "parse_keys"]
