"""Ctrl-C and SIGTERM on `loraplex-engine run`: a clean stop, not a traceback.

The first signal while experiments train asks the runner to stop after the tick in
progress (a tick half done would checkpoint half an update); the runner then checkpoints
every experiment at its step and writes what was done. A signal before training starts,
or a second one, stops at once (:class:`Interrupted`). The exit status is the shell's for
a signal: 128 + its number (130 SIGINT, 143 SIGTERM).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from loraplex_engine.spec.errors import Interrupted

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """What the signal handler saw; the runner polls :attr:`signum` between ticks."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.armed = False  # training: a first signal asks, not stops

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_status(self) -> int:
        return 128 + (self.signum or 0)

    def handle(self, signum: int, _frame: FrameType | None) -> None:
        if not self.armed or self.signum is not None:
            raise Interrupted(signum)
        self.signum = signum
        name = signal.Signals(signum).name
        print(
            f"\n{name}: stopping after this step to checkpoint every experiment "
            "(again to quit now, without)",
            file=sys.stderr,
            flush=True,
        )


@contextmanager
def stop_on_signals() -> Iterator[StopRequest]:
    """SIGINT and SIGTERM handled by a :class:`StopRequest` (main thread only), the
    previous handlers restored after. A worker rank of --world-size ignores both: rank 0
    stops, checkpoints and releases it (as under `serve`)."""
    stop = StopRequest()
    worker = os.environ.get("RANK", "0") != "0"
    handler = signal.SIG_IGN if worker else stop.handle
    previous: dict[int, Any] = {}
    try:
        for signum in SIGNALS:
            previous[signum] = signal.signal(signum, handler)
    except ValueError:  # not the main thread (an embedding caller): leave signals alone
        pass
    try:
        yield stop
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
