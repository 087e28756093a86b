"""Tenant API keys: ``tml-...`` keys, each mapped to one namespace.

``--tinker-keys PATH`` names a file or a directory:

- a **file** of lines ``<namespace> <key>`` (``#`` starts a comment; blank lines skipped);
- a **directory** (a Kubernetes Secret mounted as files): each file's name is a
  namespace and its lines are that namespace's keys.

A key is written either as itself (``tml-...``) or as ``sha256:<64 hex>``, the digest of
the key, so the file need not hold the secret. Only digests are kept in memory; a
presented key is hashed and compared with every digest in constant time
(``hmac.compare_digest``, no early exit), so neither a key nor its namespace leaks
through timing.

The source is re-read when its modification time (or, for a directory, the set of files
and their times) changes, checked at most every ``recheck_s`` seconds: keys rotate
without a restart. A source that cannot be read leaves the last keys in force (logged);
one that reads with bad lines takes effect without them: its good lines and its
removals apply (a revoked key stops even when the same edit mistyped another line), and
each bad line is logged. At start-up (``serve``) a bad line is an error.

A gateway in front of several engines (the chart's ``loraplex-gateway``) authenticates
tenants itself and calls an engine with the engine's admin bearer token plus
``X-Loraplex-Namespace: <namespace>``: :class:`AdminDelegation` accepts that header only
with the admin token (server/middleware.py refuses it before routing otherwise).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import threading
import time
from dataclasses import dataclass

from loraplex_engine.spec.errors import KeyFileError

log = logging.getLogger("loraplex_engine.server.tinker.keys")

KEY_PREFIX = "tml-"
NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")  # DNS-1123 label
DIGEST = re.compile(r"^sha256:([0-9a-f]{64})$")
MIN_KEY_CHARS = 20  # "tml-" and at least 16 characters of secret
RECHECK_S = 1.0


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


@dataclass(frozen=True)
class _Entry:
    digest: bytes
    namespace: str


def _parse_key(text: str, where: str, namespace: str, problems: list[str]) -> _Entry | None:
    if not NAMESPACE.match(namespace) or len(namespace) > 63:
        problems.append(f"{where}: namespace {namespace!r} is not a DNS-1123 label")
        return None
    m = DIGEST.match(text)
    if m:
        return _Entry(bytes.fromhex(m.group(1)), namespace)
    if not text.startswith(KEY_PREFIX) or len(text) < MIN_KEY_CHARS:
        problems.append(
            f"{where}: a key must start with {KEY_PREFIX!r} and have at least "
            f"{MIN_KEY_CHARS} characters, or be sha256:<64 hex digits>"
        )
        return None
    return _Entry(digest(text), namespace)


def _lines(text: str) -> list[tuple[int, str]]:
    out = []
    for i, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if line:
            out.append((i, line))
    return out


@dataclass(frozen=True)
class Parsed:
    """A source's good keys, and its bad lines (each a message naming file and line)."""

    entries: list[_Entry]
    problems: list[str]

    def strict(self) -> list[_Entry]:
        if self.problems:
            raise KeyFileError("\n".join(self.problems))
        return self.entries


def parse_file(text: str, name: str = "keys") -> Parsed:
    entries: list[_Entry] = []
    problems: list[str] = []
    for i, line in _lines(text):
        parts = line.split()
        if len(parts) != 2:
            problems.append(f"{name}:{i}: expected '<namespace> <key>'")
            continue
        entry = _parse_key(parts[1], f"{name}:{i}", parts[0], problems)
        if entry is not None:
            entries.append(entry)
    return Parsed(entries, problems)


def parse_dir(files: dict[str, str]) -> Parsed:
    entries: list[_Entry] = []
    problems: list[str] = []
    for fname, text in sorted(files.items()):
        for i, line in _lines(text):
            entry = _parse_key(line, f"{fname}:{i}", fname, problems)
            if entry is not None:
                entries.append(entry)
    return Parsed(entries, problems)


def _dir_files(path: str) -> list[str]:
    # Secret mounts hold ..data and ..<timestamp> links: hidden names are not namespaces.
    return sorted(
        n
        for n in os.listdir(path)
        if not n.startswith(".") and os.path.isfile(os.path.join(path, n))
    )


class KeyStore:
    """The keys of ``path``; :meth:`namespace_of` answers a presented key's namespace."""

    def __init__(self, path: str, *, recheck_s: float = RECHECK_S) -> None:
        self.path = path
        self.recheck_s = recheck_s
        self._lock = threading.Lock()
        self._entries: list[_Entry] = []
        self._stamp: object = None
        self._checked = 0.0
        self._load(strict=True)

    @classmethod
    def from_entries(cls, pairs: dict[str, str]) -> KeyStore:
        """Keys given in code (tests): key -> namespace."""
        store = cls.__new__(cls)
        store.path = ""
        store.recheck_s = float("inf")
        store._lock = threading.Lock()
        problems: list[str] = []
        entries = [_parse_key(k, "keys", ns, problems) for k, ns in pairs.items()]
        if problems:
            raise KeyFileError("\n".join(problems))
        store._entries = [e for e in entries if e is not None]
        store._stamp = None
        store._checked = time.monotonic()
        return store

    def _stamp_now(self) -> object:
        st = os.stat(self.path)
        if not os.path.isdir(self.path):
            return (st.st_mtime_ns, st.st_size, st.st_ino)
        stamps = []
        for n in _dir_files(self.path):
            s = os.stat(os.path.join(self.path, n))
            stamps.append((n, s.st_mtime_ns, s.st_size, s.st_ino))
        return (st.st_mtime_ns, tuple(stamps))

    def _read(self) -> Parsed:
        if os.path.isdir(self.path):
            files = {}
            for n in _dir_files(self.path):
                with open(os.path.join(self.path, n), encoding="utf-8") as f:
                    files[n] = f.read()
            return parse_dir(files)
        with open(self.path, encoding="utf-8") as f:
            return parse_file(f.read(), os.path.basename(self.path))

    def _load(self, strict: bool) -> None:
        try:
            stamp = self._stamp_now()
            if stamp == self._stamp:
                return
            parsed = self._read()
            entries = parsed.strict() if strict else parsed.entries
        except (OSError, UnicodeDecodeError, KeyFileError) as e:
            if strict:
                raise KeyFileError(f"--tinker-keys {self.path}: {e}") from e
            log.error("tinker keys %s not reloaded, the previous keys stay: %s", self.path, e)
            return
        for problem in parsed.problems:  # not strict: skipped, the rest applies
            log.error("tinker keys %s: line skipped: %s", self.path, problem)
        if not strict:
            log.info("tinker keys %s reloaded: %d key(s)", self.path, len(entries))
        self._entries = entries
        self._stamp = stamp

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now - self._checked < self.recheck_s:
            return
        with self._lock:
            if now - self._checked < self.recheck_s:
                return
            self._checked = now
            self._load(strict=False)

    def namespace_of(self, key: str | None) -> str | None:
        """The namespace of ``key``, or None. Every digest is compared (constant time)."""
        if self.path:
            self._maybe_reload()
        if not key or not key.startswith(KEY_PREFIX):
            return None
        given = digest(key)
        found: str | None = None
        for entry in self._entries:  # no early exit: the time does not say which matched
            if hmac.compare_digest(given, entry.digest) and found is None:
                found = entry.namespace
        return found

    def __len__(self) -> int:
        return len(self._entries)


NAMESPACE_HEADER = "x-loraplex-namespace"


def valid_namespace(name: str) -> bool:
    return len(name) <= 63 and NAMESPACE.match(name) is not None


class AdminDelegation:
    """The engine's admin token acting for a namespace named in ``X-Loraplex-Namespace``
    (a gateway that authenticated the tenant itself)."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("delegation needs the admin token")
        self._expected = f"Bearer {token}".encode()

    def namespace_for(self, authorization: str | None, claimed: str | None) -> str | None:
        """``claimed`` when ``authorization`` is the admin bearer token (constant time)
        and ``claimed`` is a DNS-1123 label; None otherwise."""
        given = (authorization or "").encode()
        if given[:7].lower() == b"bearer ":
            given = b"Bearer " + given[7:].strip()
        if not hmac.compare_digest(given, self._expected):
            return None
        if claimed is None or not valid_namespace(claimed):
            return None
        return claimed
