"""Published adapter versions: immutable, numbered PEFT directories with a manifest, and
the aliases (``latest``, ``stable``, user-named) that point at them.

Layout, beside the experiment's runs (store/run_store.py)::

    <root>/<namespace>/<name>/_versions/v<N>/   adapter_config.json
                                                adapter_model.safetensors
                                                manifest.json
    <root>/<namespace>/<name>/_versions/aliases.json

``_versions`` is not a valid run id (it starts with "_"), so pruning runs never takes it;
it lives under the namespace's directory, so the namespace's checkpoint quota counts it.
Versions are numbered per experiment name, across its runs: ``v<N>`` is never reused, and
any engine continues the sequence (the next number is the newest on disk + 1).

Atomic: a version is written into a hidden temp directory, fsynced and renamed into place
(checkpoint.atomic_dir), so a reader (this engine, another, a vLLM fleet) sees a whole
version or none; a writer killed half-way leaves a ``.v<N>.tmp-*`` directory that no
listing shows and the next publish on the owning engine removes. The manifest's
``contentHash`` (sha256 over the adapter files) lets a reader check what it loaded.
Aliases are one JSON file replaced atomically (temp file, fsync, rename).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from loraplex_engine.spec.errors import CheckpointError
from loraplex_engine.store import checkpoint as ckpt
from loraplex_engine.store.quota import CheckpointQuota, tree_bytes

VERSIONS_DIR = "_versions"
MANIFEST = "manifest.json"
ALIASES = "aliases.json"
# The last publish.requestToken published: outlives retention of its version.
REQUEST = "request.json"
MANIFEST_FORMAT = 1
# "v" and a number from 1 (no leading zeros: one spelling per version).
VERSION_NAME = re.compile(r"v([1-9][0-9]{0,8})")
LEFTOVER = re.compile(r"\.(v[1-9][0-9]{0,8}|aliases\.json|request\.json)\.(tmp|old)-.+")
# The files whose bytes the content hash covers, in this order.
HASHED_FILES = (ckpt.ADAPTER_CONFIG, ckpt.ADAPTER_WEIGHTS)

log = logging.getLogger("loraplex_engine.store.versions")


class Manifest(BaseModel):
    """What a version is: the experiment and run it came from, its parent (the version
    published before it under this name), the base model, its step and scores."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")

    format: int = MANIFEST_FORMAT
    version: int = Field(ge=1)
    experiment: str
    run_id: str
    parent: int | None = None
    base_model: str
    base_model_hash: str
    step: int = Field(ge=0)
    # Named scores of the version (versions/policy.py scores_of): meanReward over the
    # steps since its parent; evalReward and evalPassAtK of the eval at eval_step (the
    # latest at or before its step, spec.eval).
    scores: dict[str, float] = Field(default_factory=dict)
    eval_step: int | None = None
    # The promotion gate's verdict at publish (None: the spec has no gate), and why not.
    gate_passed: bool | None = None
    gate_note: str | None = None
    # The publish.requestToken this version answered (None: another trigger).
    request_token: str | None = None
    content_hash: str
    created_at: str

    def to_json(self) -> dict[str, object]:
        return self.model_dump(by_alias=True, mode="json")


def version_name(n: int) -> str:
    return f"v{n}"


def parse_version(text: str) -> int | None:
    """``"v3"`` -> 3; None for anything else."""
    m = VERSION_NAME.fullmatch(text)
    return int(m.group(1)) if m else None


def content_hash(directory: Path) -> str:
    """sha256 over each hashed file's name and bytes (streamed)."""
    h = hashlib.sha256()
    for name in HASHED_FILES:
        h.update(name.encode() + b"\0")
        with open(directory / name, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        h.update(b"\0")
    return "sha256:" + h.hexdigest()


class VersionStore:
    """Reads and writes the versions of experiments under one checkpoint root."""

    def __init__(self, root: Path, quota: CheckpointQuota | None = None) -> None:
        self.root = root
        self.quota = quota

    def dir(self, namespace: str, name: str) -> Path:
        return self.root / namespace / name / VERSIONS_DIR

    def path(self, namespace: str, name: str, version: int) -> Path:
        return self.dir(namespace, name) / version_name(version)

    def list(self, namespace: str, name: str) -> list[int]:
        """The whole versions of an experiment, oldest first (temp directories never
        match; a directory without its manifest is no version)."""
        try:
            entries = list(self.dir(namespace, name).iterdir())
        except OSError:
            return []
        found = []
        for p in entries:
            n = parse_version(p.name)
            if n is not None and (p / MANIFEST).is_file():
                found.append(n)
        return sorted(found)

    def read(self, namespace: str, name: str, version: int, verify: bool = False) -> Manifest:
        """A version's manifest; ``verify``: its files' hash checked against it."""
        directory = self.path(namespace, name, version)
        file = directory / MANIFEST
        try:
            manifest = Manifest.model_validate_json(file.read_bytes())
        except FileNotFoundError as e:
            raise CheckpointError(f"no version {version_name(version)} ({file} is missing)") from e
        except (OSError, ValidationError) as e:
            raise CheckpointError(f"{file} is not a valid manifest: {e}") from e
        if verify:
            actual = content_hash(directory)
            if actual != manifest.content_hash:
                raise CheckpointError(
                    f"{directory}: content hash {actual} is not the manifest's "
                    f"{manifest.content_hash}"
                )
        return manifest

    def remove_leftovers(self, namespace: str, name: str) -> int:
        """What a killed writer left (``.v<N>.tmp-*``, ``.aliases.json.tmp-*``). Only for
        an experiment this engine holds: another engine's write looks the same."""
        directory = self.dir(namespace, name)
        found = [p for p in directory.glob(".*") if LEFTOVER.fullmatch(p.name)]
        for p in found:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        if found:
            log.info("removed %d half-written versions in %s", len(found), directory)
        return len(found)

    def publish(
        self,
        namespace: str,
        name: str,
        write: Callable[[Path], None],
        manifest: Callable[[int, int | None, str], Manifest],
        keep: int,
        protected: Iterable[int] = (),
        estimate_bytes: int = 0,
    ) -> Manifest:
        """Publish the next version: ``write(dir)`` writes the PEFT files, then
        ``manifest(number, parent, content_hash)`` describes it. Retention runs after:
        the newest ``keep`` and the ``protected`` ones (pinned, aliased) stay. With a
        quota, a publish that would take the namespace past it is refused first
        (CheckpointQuotaError), counting what its retention frees."""
        self.remove_leftovers(namespace, name)
        existing = self.list(namespace, name)
        number = (existing[-1] + 1) if existing else 1
        parent = existing[-1] if existing else None
        doomed = versions_to_prune([*existing, number], keep, protected)
        if self.quota is not None:
            writing = tree_bytes(self.path(namespace, name, parent)) if parent else estimate_bytes
            freeing = [self.path(namespace, name, n) for n in doomed]
            self.quota.check(
                self.root,
                namespace,
                writing,
                freeing,
                advice="lower publish.keep or unpin versions",
            )
        target = self.path(namespace, name, number)
        with ckpt.atomic_dir(target) as tmp:
            write(tmp)
            made = manifest(number, parent, content_hash(tmp))
            (tmp / MANIFEST).write_text(json.dumps(made.to_json(), indent=2) + "\n")
        for n in doomed:
            shutil.rmtree(self.path(namespace, name, n), ignore_errors=True)
        return made

    def read_aliases(self, namespace: str, name: str) -> dict[str, int]:
        """Alias -> version number; {} when none were written. Entries that do not parse
        are dropped (the file is the engine's own; a reader never fails on it)."""
        file = self.dir(namespace, name) / ALIASES
        try:
            raw = json.loads(file.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            log.warning("%s is unreadable: %s", file, e)
            return {}
        out: dict[str, int] = {}
        if isinstance(raw, dict):
            for alias, ref in raw.items():
                n = parse_version(ref) if isinstance(ref, str) else None
                if n is not None:
                    out[str(alias)] = n
        return out

    def write_aliases(self, namespace: str, name: str, aliases: Mapping[str, int]) -> None:
        """Replace the aliases file atomically: readers see the old one or the new one."""
        body = json.dumps({a: version_name(n) for a, n in sorted(aliases.items())}, indent=2)
        self._replace(namespace, name, ALIASES, body)

    def read_token(self, namespace: str, name: str) -> str | None:
        """The last requestToken published: the request file's, or a newer manifest's (a
        writer killed between the version and the file)."""
        token, number = None, 0
        try:
            raw = json.loads((self.dir(namespace, name) / REQUEST).read_text())
            if isinstance(raw, dict) and isinstance(raw.get("requestToken"), str):
                token, number = raw["requestToken"], int(raw.get("version", 0))
        except (OSError, ValueError, TypeError):
            pass
        for n in reversed(self.list(namespace, name)):
            if n <= number:
                break
            try:
                m = self.read(namespace, name, n)
            except CheckpointError:
                continue
            if m.request_token is not None:
                return m.request_token
        return token

    def write_token(self, namespace: str, name: str, token: str, version: int) -> None:
        body = json.dumps({"requestToken": token, "version": version})
        self._replace(namespace, name, REQUEST, body)

    def _replace(self, namespace: str, name: str, file: str, body: str) -> None:
        directory = self.dir(namespace, name)
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{file}.tmp-", dir=directory)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(body + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, directory / file)
            _fsync_dir(directory)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- retention (pure) --------------------------------------------------------------------


def versions_to_prune(
    existing: Iterable[int], keep: int, protected: Iterable[int] = ()
) -> list[int]:
    """Which versions to remove, oldest first: all but the newest ``keep`` and the
    ``protected`` ones (pinned by the spec, or an alias's target: a served name never
    loses its version)."""
    ordered = sorted(set(existing))
    newest = set(ordered[-keep:]) if keep > 0 else set()
    safe = newest | set(protected)
    return [n for n in ordered if n not in safe]
