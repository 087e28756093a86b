"""`loraplex-engine` whose shared device can be made to fail:
`python -m tests.support.faulty_engine serve`.

A fault of the base model or the device (CUDA error, lost GPU) is the one failure that
may fail a whole tick; on CPU no real component produces one on demand. This wrapper runs
the real command line (``loraplex_engine.cli.main``) with the real
:class:`~loraplex_engine.engine.Engine`, except that its next N ticks raise inside the
tick (training or serving), after it has taken the queued completions: N is read from the file
``$LORAPLEX_TEST_FAULTS`` (decremented per fault). No test hook lives in the product: the
wrapper swaps the class ``serve`` imports when it loads the model.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import loraplex_engine.engine
from loraplex_engine import cli


class FaultyEngine(loraplex_engine.engine.Engine):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        faults = Path(os.environ["LORAPLEX_TEST_FAULTS"])

        def failing(tick: Any) -> Any:
            def tick_or_fail(*a: Any, **kw: Any) -> Any:
                left = int(faults.read_text() or 0) if faults.exists() else 0
                if left > 0:
                    faults.write_text(str(left - 1))
                    raise RuntimeError("injected device fault")
                return tick(*a, **kw)

            return tick_or_fail

        # Training ticks and serving ticks (tick/time_share.py) alike.
        self._tick.run = failing(self._tick.run)  # type: ignore[method-assign]
        self._tick.serve = failing(self._tick.serve)  # type: ignore[method-assign]


if __name__ == "__main__":
    loraplex_engine.engine.Engine = FaultyEngine  # type: ignore[misc]
    sys.exit(cli.main(sys.argv[1:]))
