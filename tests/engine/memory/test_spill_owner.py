"""Spill directories on a shared checkpoint volume (memory/spill_owner.py): a process
killed with its pages spilled leaves them on the volume, and the next engine's sweep
removes them, never a live engine's. Real processes and real locks (a child python that
claims a directory and is killed with SIGKILL)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from loraplex_engine.memory import spill_owner

CHILD = """
import sys
from pathlib import Path
from loraplex_engine.memory import spill_owner
d = spill_owner.claim(Path(sys.argv[1]))
(d.path / "page.safetensors").write_bytes(b"x" * 1000)
print(d.path.name, flush=True)
sys.stdin.read()
"""


def _child(root: Path) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(root)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=os.environ.copy(),
    )  # fmt: skip
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def test_a_killed_owner_s_pages_are_swept_and_a_live_one_s_kept(tmp_path: Path) -> None:
    dead, dead_id = _child(tmp_path)
    live, live_id = _child(tmp_path)
    mine = spill_owner.claim(tmp_path)  # this process: a live owner too
    try:
        dead.send_signal(signal.SIGKILL)
        dead.wait(30)
        where = spill_owner.base(tmp_path)
        assert (where / dead_id / "page.safetensors").exists()  # kill -9 leaves it
        assert spill_owner.sweep(tmp_path) == [dead_id]
        left = sorted(p.name for p in where.iterdir())
        assert left == sorted(
            [live_id, live_id + ".lock", mine.path.name, mine.path.name + ".lock"]
        )
        assert (where / live_id / "page.safetensors").exists()
    finally:
        live.kill()
        live.wait(30)
        mine.release()
    assert spill_owner.sweep(tmp_path) == [live_id]
    assert list(spill_owner.base(tmp_path).iterdir()) == []  # no growth across restarts


def test_a_directory_without_its_lock_has_no_owner(tmp_path: Path) -> None:
    stray = spill_owner.base(tmp_path) / "0123abcd"
    stray.mkdir(parents=True)
    (stray / "page.safetensors").write_bytes(b"x")
    (spill_owner.base(tmp_path) / "feed.lock.tmp").write_bytes(b"")  # died mid-claim
    assert sorted(spill_owner.sweep(tmp_path)) == ["0123abcd", "feed"]
    assert list(spill_owner.base(tmp_path).iterdir()) == []
