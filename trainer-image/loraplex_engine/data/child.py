"""The dataset reader process: reads one dataset, checks every row, and writes the rows
to the engine's spool (data/spool.py), then exits.

The engine starts it at admission (``python -I -c ...``, the job as JSON on stdin, the
credentials in it rather than in argv or the environment) with the descriptors it needs:
the spool's three files and, for a local dataset, its allowed directory. It runs at the
lowest CPU priority under an address-space limit, so hostile bytes (a decompression
bomb, a malformed file that crashes a parser) cost the engine neither cores, memory nor
its process: whatever happens here is one line on stdout and an exit status.

Spool layout: one file of the prompts' UTF-8 bytes back to back, one of the answers', and
an index of ``spool.INDEX`` records, one a row: where its prompt and its answer end.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from collections.abc import Iterable
from typing import Any

import numpy as np

from loraplex_engine.data.spool import INDEX


class Limits:
    def __init__(self, job: dict[str, Any]):
        self.max_rows = int(job["max_rows"])
        self.max_bytes = int(job["max_bytes"])
        self.max_row_bytes = int(job["max_row_bytes"])


def write_spool(batches: Iterable[Any], fds: dict[str, int], limits: Limits, shown: str) -> int:
    """Every batch into the spool; the number of rows written. DataError past a limit."""
    from loraplex_engine.data.formats import DataError

    rows, ends = 0, np.zeros(2, dtype=np.int64)
    with (
        open(fds["prompts"], "wb", buffering=1 << 20, closefd=False) as prompts,
        open(fds["answers"], "wb", buffering=1 << 20, closefd=False) as answers,
        open(fds["index"], "wb", buffering=1 << 20, closefd=False) as index,
    ):
        for (p_len, p_data), (a_len, a_data) in batches:
            rows += len(p_len)
            if rows > limits.max_rows:
                raise DataError(f"{shown}: over this engine's limit of {limits.max_rows} rows")
            if int(ends.sum()) + len(p_data) + len(a_data) > limits.max_bytes:
                raise DataError(
                    f"{shown}: over this engine's limit of {limits.max_bytes} bytes of "
                    "prompts and answers"
                )
            prompts.write(p_data)
            answers.write(a_data)
            record = np.empty(len(p_len), dtype=INDEX)
            record["prompt_end"] = ends[0] + np.cumsum(p_len)
            record["answer_end"] = ends[1] + np.cumsum(a_len)
            index.write(record.tobytes())
            if len(record):
                ends[:] = record[-1].tolist()
    return rows


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
    from loraplex_engine.data.formats import DataError, read_batches

    shown = job["shown"]
    limits = Limits(job)
    try:
        batches = read_batches(
            opener_of(job), job["format"], job["split"], tuple(job["columns"]), limits.max_row_bytes
        )
        count = write_spool(batches, job["fds"], limits, shown)
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
