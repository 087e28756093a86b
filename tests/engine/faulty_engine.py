"""An engine whose shared device can be made to fail, for ``serve --engine-factory``.

A fault of the base model or the device (CUDA error, lost GPU) is the one failure that
may fail a whole tick; on CPU no real component produces one on demand, so this factory
builds the real :class:`~loraplex_engine.engine.Engine` and makes its next N ticks raise
inside the tick, after the tick has taken the queued completions: N is read from the
file ``$LORAPLEX_TEST_FAULTS`` (decremented per fault). Everything else is the real engine.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from loraplex_engine.engine import Engine


def faulty_engine(model_dir: str, **kwargs: Any) -> Engine:
    engine = Engine(model_dir, **kwargs)
    faults = Path(os.environ["LORAPLEX_TEST_FAULTS"])
    run = engine._tick.run

    def run_or_fail(*args: Any, **kw: Any) -> Any:
        left = int(faults.read_text() or 0) if faults.exists() else 0
        if left > 0:
            faults.write_text(str(left - 1))
            raise RuntimeError("injected device fault")
        return run(*args, **kw)

    engine._tick.run = run_or_fail  # type: ignore[method-assign]
    return engine
