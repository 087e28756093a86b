"""One JSONL row checked and parsed, and a whole file checked in a child process.

Standard library only: a file of a million rows is checked at admission by this module
run as a script (``python -I jsonl_rows.py FD END MAX_LINE [KEY...]``, the descriptor inherited,
at the lowest CPU priority), so that the parse neither holds the engine's GIL against its
tick, nor takes the cores the tick needs, nor grows the engine's memory.
A row's problem is one line naming the line number; the script prints it and exits 1.
"""

from __future__ import annotations

import json
import os
import sys

KEYS = ("prompt", "answer")
CHUNK_BYTES = 4 << 20
BLANK = b" \t\r\n\x0b\x0c"


def row_shape(keys: tuple[str, ...] = KEYS) -> str:
    inner = ", ".join(f"{json.dumps(k)}: str" for k in keys)
    return f"row must be {{{inner}}}"


ROW_SHAPE = row_shape()


def parse_row(raw: bytes, keys: tuple[str, ...] = KEYS) -> tuple[str, ...] | str:
    """The values of ``keys`` (the prompt's and the answer's), or why the line is not a
    row. Every failure is caught: a 200k-deep nesting (RecursionError), a line too big to
    parse (MemoryError), bytes that are not UTF-8 or a lone surrogate (UnicodeError) are
    the tenant's data, not ours."""
    try:
        row = json.loads(raw.decode("utf-8"))
        if not isinstance(row, dict):
            return row_shape(keys)
        for k in keys:  # the first key that is not text, named (the tenant's own, clipped)
            if k not in row:
                return f"{row_shape(keys)} (it has no {k[:64]!r})"
            if not isinstance(row[k], str):
                return f"{row_shape(keys)} (its {k[:64]!r} is {_kind(row[k])})"
        values = tuple(row[k] for k in keys)
        for value in values:
            value.encode("utf-8")  # lone surrogates
        return values
    except json.JSONDecodeError as e:
        return f"invalid JSON ({e.msg})"
    except UnicodeError:
        return "not valid UTF-8 text"
    except RecursionError:
        return "invalid JSON (nested too deeply)"
    except MemoryError:
        return "too large to parse"
    except Exception as e:  # any other parse failure is still the row's
        return f"invalid JSON ({type(e).__name__})"


def _kind(value: object) -> str:
    """A JSON value's kind, as a row's problem names it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return "a list" if isinstance(value, list) else "an object"


def check_file(fd: int, end: int, max_line: int, keys: tuple[str, ...] = KEYS) -> str | None:
    """The first problem among the newline-terminated lines of ``fd`` before ``end``, as
    ``"LINE: why"``; None if every non-blank one is a row."""
    offset, line_no, carry = 0, 0, b""
    while offset < end:
        chunk = carry + os.pread(fd, min(CHUNK_BYTES, end - offset), offset)
        if len(chunk) == len(carry):
            return None  # the file shrank under us: the caller's index decides
        offset += len(chunk) - len(carry)
        lines = chunk.split(b"\n")
        carry = lines.pop()
        for raw in lines:
            line_no += 1
            if len(raw) > max_line:
                return f"{line_no}: line of {len(raw)} bytes is over the limit of {max_line}"
            if raw.strip(BLANK):
                parsed = parse_row(raw, keys)
                if isinstance(parsed, str):
                    return f"{line_no}: {parsed}"
        if len(carry) > max_line:
            return f"{line_no + 1}: line is over the limit of {max_line} bytes"
    return None


def lowest_priority() -> None:
    """The check takes only the CPU the engine leaves: its tick runs beside it."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)


if __name__ == "__main__":
    lowest_priority()
    keys = tuple(sys.argv[4:]) or KEYS
    problem = check_file(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), keys)
    if problem is not None:
        print(problem)
    sys.exit(problem is not None)
