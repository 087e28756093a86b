"""tests/support/client_driver.drive on a real Engine with the tiny model: a tick that
raises is raised by ``drive``, not waited out (the calls no tick took would keep the
driver's pool waiting forever)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from loraplex_engine.spec.training_service import ClientLora, LossCall

from tests.support.client_driver import NS, drive, sft_datum
from tests.support.engine_builders import engine


def test_a_tick_that_raises_is_raised_not_hung(tiny_model_dir: Path, tmp_path: Path) -> None:
    # One model a tick: a failing tick leaves the other two models' calls untaken.
    eng = engine(tiny_model_dir, tmp_path, client_models_per_tick=1)
    ids = ["m0", "m1", "m2"]
    for n, i in enumerate(ids):
        eng.clients.create_model(NS, i, ClientLora(rank=4, seed=n))

    def boom(*args, **kwargs):
        raise RuntimeError("the device fell over")

    eng._tick.run = boom
    raised: list[BaseException] = []

    def run() -> None:
        datum = sft_datum([1, 40, 41], [100, 101, 102])
        try:
            drive(eng, *(lambda i=i: eng.clients.forward_backward(
                NS, i, [datum], LossCall("cross_entropy")) for i in ids), timeout=600)  # fmt: skip
        except BaseException as e:
            raised.append(e)

    driver = threading.Thread(target=run, daemon=True)
    driver.start()
    try:
        driver.join(60)
        assert not driver.is_alive(), "drive hung on a tick that raised"
        assert len(raised) == 1
        with pytest.raises(RuntimeError, match="fell over"):
            raise raised[0]
    finally:
        eng.clients.refuse("test over")  # a hung driver's calls are answered: it ends
        driver.join(60)
        eng.close()
