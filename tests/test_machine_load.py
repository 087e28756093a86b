"""Time limits scale with the machine's load (tests/support/machine.py)."""

from __future__ import annotations

import os

import pytest

from tests.support import machine


@pytest.mark.parametrize(
    ("load", "cores", "factor"),
    [(0.0, 2, 1.0), (1.0, 2, 1.0), (7.0, 2, 4.0), (3.0, 16, 1.0), (31.0, 16, 2.0)],
)
def test_limits_grow_with_the_runnable_processes_per_core(
    monkeypatch: pytest.MonkeyPatch, load: float, cores: int, factor: float
) -> None:
    monkeypatch.setattr(os, "getloadavg", lambda: (load, 0.0, 0.0))
    monkeypatch.setattr(machine, "cores", lambda: cores)
    assert machine.load_factor() == factor
    assert machine.scaled(5.0) == 5.0 * factor


def test_cores_are_the_ones_this_process_may_run_on() -> None:
    assert 1 <= machine.cores() <= (os.cpu_count() or 1)
