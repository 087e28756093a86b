"""Reading what the file trackers wrote, with each tool's own code where it has a reader.

- TensorBoard: its EventAccumulator, as the TensorBoard UI loads a run directory.
- W&B offline runs: the ``.wandb`` transaction log ``wandb sync`` uploads. wandb 0.31 ships
  no Python reader for it (its Go core reads it), so this is one: the LevelDB log format
  (32 KiB blocks of crc32c, length, type-framed chunks) behind W&B's 7-byte file header,
  each whole record W&B's own protobuf ``Record`` message. A wrong framing reads garbage
  and fails the protobuf parse, never a silent pass.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = 7  # crc32c (4), length (2), type (1)
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
WANDB_MAGIC = b":W&B"


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] of one TensorBoard run directory."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _chunks(data: bytes) -> list[bytes]:
    """The records of a LevelDB-format log (W&B's header skipped), reassembled."""
    assert data[:4] == WANDB_MAGIC, data[:8]
    records, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # block trailer: padding
            pos += left
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        if length == 0 and kind == 0:  # zero padding at the end of what was written
            break
        body = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == FULL:
            records.append(body)
        elif kind == FIRST:
            pending = body
        elif kind == MIDDLE:
            pending += body
        elif kind == LAST:
            records.append(pending + body)
        else:
            raise ValueError(f"unknown chunk type {kind} at {pos}")
    return records


def _key(item: Any) -> str:
    return item.key or ".".join(item.nested_key)


def wandb_history(root: Path, wait_s: float = 30.0) -> list[dict[str, Any]]:
    """Every history row (``run.log``) of the one offline run under ``root``, in order,
    once the log holds the run's exit record: W&B's core process writes the file on its
    own after ``run.finish()`` returns (``wait_s`` bounds the wait; no speed expected)."""
    from wandb.proto import wandb_internal_pb2

    deadline = time.monotonic() + wait_s
    while True:
        (path,) = root.glob("wandb/offline-run-*/run-*.wandb")
        records = [wandb_internal_pb2.Record.FromString(raw) for raw in _chunks(path.read_bytes())]
        kinds = [r.WhichOneof("record_type") for r in records]
        if "exit" in kinds:
            break
        assert time.monotonic() < deadline, f"no exit record in {path}: {kinds}"
        time.sleep(0.1)
    return [
        {_key(i): json.loads(i.value_json) for i in r.history.item}
        for r, kind in zip(records, kinds, strict=True)
        if kind == "history"
    ]
