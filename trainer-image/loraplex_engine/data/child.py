"""The dataset reader process: reads one dataset, checks every row, and writes the rows
to the engine's spool (data/spool.py), then exits.

The engine starts it at admission (``python -I -c ...``, the job as JSON on stdin, the
credentials in it rather than in argv or the environment) with the descriptors it needs:
the spool's two files and, for a local dataset, its allowed directory. It runs at the
lowest CPU priority under an address-space limit, so hostile bytes (a decompression
bomb, a malformed file that crashes a parser) cost the engine neither cores, memory nor
its process: whatever happens here is one line on stdout and an exit status.

Spool layout: the data file holds each row's prompt then answer, UTF-8; the index file
one ``INDEX`` record a row (the data offset, the prompt's and the answer's length).
"""

from __future__ import annotations

import json
import os
import resource
import struct
import sys
from collections.abc import Iterable
from typing import Any

INDEX = struct.Struct("<qII")


class Limits:
    def __init__(self, job: dict[str, Any]):
        self.max_rows = int(job["max_rows"])
        self.max_bytes = int(job["max_bytes"])
        self.max_row_bytes = int(job["max_row_bytes"])


def write_spool(
    rows: Iterable[tuple[str, str]], data_fd: int, index_fd: int, limits: Limits, shown: str
) -> int:
    """Every row into the spool; the number written. DataError past a limit."""
    from loraplex_engine.data.formats import DataError

    count, offset = 0, 0
    with (
        open(data_fd, "wb", buffering=1 << 20, closefd=False) as data,
        open(index_fd, "wb", buffering=1 << 20, closefd=False) as index,
    ):
        for prompt, answer in rows:
            p, a = prompt.encode("utf-8"), answer.encode("utf-8")
            count += 1
            if count > limits.max_rows:
                raise DataError(f"{shown}: over this engine's limit of {limits.max_rows} rows")
            if offset + len(p) + len(a) > limits.max_bytes:
                raise DataError(
                    f"{shown}: over this engine's limit of {limits.max_bytes} bytes of "
                    "prompts and answers"
                )
            data.write(p)
            data.write(a)
            index.write(INDEX.pack(offset, len(p), len(a)))
            offset += len(p) + len(a)
    return count


def opener_of(job: dict[str, Any]) -> Any:
    from loraplex_engine.data import openers

    shown = job["shown"]
    if job["kind"] == "local":
        return openers.LocalOpener(
            job["dir_fd"], tuple(job["parts"]), shown, bool(job["hard_links"])
        )
    if job["scheme"] == "gs":
        fs = openers.gcs_filesystem()
    else:
        fs = openers.s3_filesystem(job["endpoint_url"], job["region"], job["credentials"])
    return openers.ObjectOpener(fs, job["path"], shown)


def run(job: dict[str, Any]) -> tuple[int, str]:
    """Exit status and the line to print."""
    from loraplex_engine.data.formats import DataError, read_rows

    shown = job["shown"]
    limits = Limits(job)
    try:
        rows = read_rows(
            opener_of(job), job["format"], job["split"], tuple(job["columns"]), limits.max_row_bytes
        )
        count = write_spool(rows, job["data_fd"], job["index_fd"], limits, shown)
    except DataError as e:
        return 1, str(e)
    except MemoryError:
        return 1, f"{shown}: needs more than the reader's {job['memory_bytes'] >> 20} MiB"
    except Exception as e:  # a parser's or the network's failure is still the dataset's
        text = (str(e).splitlines() or [""])[0][:200]
        return 1, f"{shown}: cannot be read ({type(e).__name__}: {text})"
    return 0, json.dumps({"rows": count})


def _confine(memory_bytes: int) -> None:
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))


def main() -> None:
    job = json.loads(sys.stdin.read())
    _confine(int(job["memory_bytes"]))
    status, line = run(job)
    print(line, flush=True)
    sys.exit(status)


if __name__ == "__main__":
    main()
