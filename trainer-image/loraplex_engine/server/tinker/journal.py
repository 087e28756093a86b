"""A client experiment's journal (issue 29 item 3, docs/design/gateway.md): the model
operations accepted since its last checkpoint, on the checkpoint volume, so that the
engine that takes the experiment after a crash replays them and the client's futures
resolve there.

``<dir>/<seq_id>.op`` holds one request as received (its route, content encoding and
body); ``<dir>/base.json`` says which entries a checkpoint already holds: ``{"steps": N,
"seq": Q}`` = the checkpoint of step N holds every operation up to ``seq_id`` Q. Entries
up to Q are deleted after Q's optimiser step is answered (its checkpoint is written
before that). Replay after restoring the checkpoint of step R: from ``base``, walk the
entries after Q in ``seq_id`` order counting optimiser steps; those up to the optimiser
step that reached R are in the checkpoint (skipped), the rest are run again. So a crash
between a checkpoint and its ``base.json`` update replays nothing twice.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("loraplex_engine.server.tinker")

BASE = "base.json"


@dataclass(frozen=True)
class Entry:
    seq: int
    route: str  # forward_backward, forward, optim_step, save_weights, ...
    body: bytes
    encoding: str | None = None


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Journal:
    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)

    def write(self, entry: Entry) -> None:
        """Before the operation is queued: an operation the client was given a future for
        is on the volume (an ``OSError`` answers the request, and the SDK sends it again)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        doc = {
            "seq": entry.seq,
            "route": entry.route,
            "encoding": entry.encoding,
            "body": base64.b64encode(entry.body).decode(),
        }
        _atomic_write(self.dir / f"{entry.seq}.op", json.dumps(doc).encode())

    def base(self) -> tuple[int, int]:
        try:
            doc = json.loads((self.dir / BASE).read_text())
            return int(doc["steps"]), int(doc["seq"])
        except (OSError, ValueError, KeyError, TypeError):
            return 0, 0

    def entries(self) -> list[Entry]:
        out = []
        for file in self.dir.glob("*.op"):
            try:
                doc = json.loads(file.read_text())
                body = base64.b64decode(doc["body"])
                out.append(Entry(int(doc["seq"]), str(doc["route"]), body, doc.get("encoding")))
            except (OSError, ValueError, KeyError, TypeError):
                log.warning("journal entry %s unreadable: skipped", file)
        return sorted(out, key=lambda e: e.seq)

    def done(self, seq: int, result: Any) -> None:
        """An operation's answer (protobuf bytes or a JSON dict), kept until the checkpoint
        after next: an engine that takes over answers a future whose operation the
        checkpoint holds but whose answer its client had not read yet."""
        raw = result if isinstance(result, bytes) else json.dumps(result).encode()
        doc = {"proto": isinstance(result, bytes), "body": base64.b64encode(raw).decode()}
        with contextlib.suppress(OSError):  # no answer kept: its future would be re-asked
            _atomic_write(self.dir / f"{seq}.done", json.dumps(doc).encode())

    def answer(self, seq: int) -> Any:
        """A kept answer, or None."""
        try:
            doc = json.loads((self.dir / f"{seq}.done").read_text())
            raw = base64.b64decode(doc["body"])
            return raw if doc["proto"] else json.loads(raw)
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def stepped(self, seq: int, every: int) -> None:
        """Optimiser step ``seq`` is answered. When it was a checkpoint's (its step a
        multiple of ``every``: written before the answer), the entries it holds are
        dropped and the base moves past them."""
        steps, base_seq = self.base()
        done = [e for e in self.entries() if base_seq < e.seq <= seq]
        steps += sum(1 for e in done if e.route == "optim_step")
        if every < 1 or steps % every:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        _atomic_write(self.dir / BASE, json.dumps({"steps": steps, "seq": seq}).encode())
        for e in done:
            (self.dir / f"{e.seq}.op").unlink(missing_ok=True)
        for kept in self.dir.glob("*.done"):  # the answers of the window before this one
            if kept.stem.isdigit() and int(kept.stem) <= base_seq:
                kept.unlink(missing_ok=True)

    def to_replay(self, restored_steps: int) -> list[Entry]:
        """The entries the checkpoint of step ``restored_steps`` does not hold."""
        steps, base_seq = self.base()
        pending = [e for e in self.entries() if e.seq > base_seq]
        if steps == restored_steps:
            return pending
        for i, e in enumerate(pending):
            if e.route == "optim_step":
                steps += 1
                if steps == restored_steps:
                    return pending[i + 1 :]
        log.warning(
            "journal %s cannot be lined up with the checkpoint of step %d: not replayed",
            self.dir,
            restored_steps,
        )
        return []

    def held(self, seq: int, restored_steps: int) -> Entry | None:
        """Entry ``seq`` when the checkpoint of step ``restored_steps`` holds it (so it was
        not replayed), else None (replayed, unknown, or the journal cannot be lined up)."""
        steps, base_seq = self.base()
        held = []
        for e in (e for e in self.entries() if e.seq > base_seq):
            if steps == restored_steps:
                break
            held.append(e)
            steps += e.route == "optim_step"
        if steps != restored_steps:
            return None
        return next((e for e in held if e.seq == seq), None)


# The protocol's handlers an entry is run again through, by route (JSON bodies but
# forward_backward's protobuf, which says itself whether it is a forward only).
def replay(proto: Any, model: Any, restored_steps: int) -> None:
    """Runs again, under the same future ids, what the journal holds beyond the restored
    checkpoint (called once, when the protocol adopts the model)."""
    assert model.journal is not None
    entries = model.journal.to_replay(restored_steps)
    if entries:
        log.info("model %s: replaying %d journalled operations", model.id, len(entries))
    for e in entries:
        try:
            if e.route == "forward_backward":
                proto.forward_backward(model.namespace, e.body, e.encoding)
            else:
                getattr(proto, e.route)(model.namespace, json.loads(e.body))
        except Exception:  # that operation's future is lost; the others still run
            log.exception("model %s: journal entry %d (%s) not replayed", model.id, e.seq, e.route)


def find_future(proto: Any, namespace: str, request_id: str) -> Any:
    """The future ``request_id``; a client experiment's (``<model id>#<seq_id>``) on an
    engine that has not adopted its model yet is replayed first, then found, or answered
    from the journal's kept answers (its operation is in the checkpoint)."""
    fut = proto.futures.get(namespace, request_id)
    model_id, sep, seq = request_id.rpartition("#")
    if fut is not None or not sep or not seq.isdigit():
        return fut
    try:
        model = proto.registry.model(namespace, model_id)
    except Exception:  # not a model here (NotFoundError): the future is unknown
        return None
    fut = proto.futures.get(namespace, request_id)
    kept = model.journal.answer(int(seq)) if fut is None and model.journal else None
    if kept is None and fut is None and model.journal is not None:
        # Lost between its checkpoint's write and its answer's: the step is applied (the
        # restored checkpoint holds it); its metrics died with the engine.
        entry = model.journal.held(int(seq), model.restored_steps)
        kept = {"metrics": {}} if entry is not None and entry.route == "optim_step" else None
    if kept is not None:
        fut = proto.futures.new(namespace, "Kept", model_id, request_id)
        fut.finish(kept)
    return fut


def journalled(finish: Any, journal: Journal, seq: int) -> Any:
    """``finish`` (the protocol's: run, then finish or fail the future) that also keeps a
    finished future's answer in the journal."""

    def run(fut: Any, fn: Any) -> None:
        finish(fut, fn)
        if fut.state == "done":
            journal.done(seq, fut.result)

    return run
