"""kill -9 of a real engine (`loraplex-engine serve`) while its continual experiment
publishes a version every step: after each kill only whole versions are visible (each
matches its manifest's hash, numbered 1..N with no gap), and the experiment, resumed on
a fresh engine, continues the sequence at N+1 with N as its parent."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
from loraplex_engine.store.versions import VersionStore

from tests.support.server_process import EngineServer, wait_until
from tests.support.server_specs import put_body, small_spec

pytestmark = pytest.mark.slow

EXP = "team.kill"
RUN = "run-k"


def _whole(store: VersionStore) -> list[int]:
    listed = store.list("team", "kill")
    for n in listed:
        m = store.read("team", "kill", n, verify=True)  # raises unless whole
        assert m.version == n and m.run_id == RUN
    assert listed == list(range(1, len(listed) + 1)), listed
    return listed


def test_sigkill_while_publishing_and_resume(tiny_model_dir: Path, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    store = VersionStore(root)
    spec = small_spec(max_steps=0) | {"publish": {"everySteps": 1, "keep": 1000}}
    rng = random.Random(3)
    seen = 0
    for round_ in range(3):
        srv = EngineServer(tiny_model_dir, root, max_adapters=2, max_rank=16, workdir=tmp_path)
        srv.start()
        try:
            with srv.client() as api:
                r = api.put(f"/v1/experiments/{EXP}", json=put_body(EXP, spec, run_id=RUN))
                assert r.status_code == 201, r.text
                if round_:  # resumed: the next version continues the sequence
                    wait_until(lambda s=seen: len(store.list("team", "kill")) > s, timeout=120)
                    assert store.read("team", "kill", seen + 1).parent == seen
                wait_until(lambda s=seen: len(store.list("team", "kill")) >= s + 3, timeout=120)
                time.sleep(rng.uniform(0.0, 0.2))  # then kill -9 wherever it is
        finally:
            srv.kill()
        listed = _whole(store)
        assert len(listed) >= seen + 3
        seen = len(listed)
