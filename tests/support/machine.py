"""How busy this machine is now, for time limits that must hold under load.

A limit a test sets on the engine (a collective's timeout, "exits within N s") is a
number of seconds of the engine's work. On a machine with more runnable processes than
cores each gets about cores/runnable of a core, so that work takes runnable/cores times
as long: on the 2-core CI machine running installs and other tests beside an engine's two
ranks, a 5 s gloo timeout that an idle machine never reaches was reached. Limits scale by
the load seen when the test starts (the 1-minute load average, plus the test's own work).
"""

from __future__ import annotations

import os


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def load_factor() -> float:
    """How many times longer CPU work takes now than on an idle machine (>= 1)."""
    runnable = os.getloadavg()[0] + 1.0  # the load average does not count the test yet
    return max(1.0, runnable / cores())


def scaled(seconds: float) -> float:
    """``seconds`` of an idle machine's time, as long as it takes on this one now."""
    return seconds * load_factor()
