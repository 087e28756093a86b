"""The process-group registry the test helpers start children with kills what they fork."""

from __future__ import annotations

import time

from tests.support import child_processes


def test_kill_group_ends_the_child_and_what_it_forked() -> None:
    proc = child_processes.spawn(["sh", "-c", "sleep 300 & sleep 300"], "sleeper")
    time.sleep(0.2)  # let the shell fork its background sleep
    assert f"sleeper (pid {proc.pid})" in child_processes.survivors()
    child_processes.kill_group(proc)
    assert proc.returncode is not None
    assert not any(s.startswith("sleeper") for s in child_processes.survivors())


def test_a_forked_grandchild_keeps_the_group_alive_until_killed() -> None:
    # The leader exits at once; its background sleep is still in the group.
    proc = child_processes.spawn(["sh", "-c", "sleep 300 &"], "orphan-maker")
    proc.wait(10)
    time.sleep(0.2)
    assert any(s.startswith("orphan-maker") for s in child_processes.survivors())
    child_processes.kill_group(proc)
    assert not any(s.startswith("orphan-maker") for s in child_processes.survivors())
