"""Client work inside fair share: co-tenant B's pace alone vs beside tenant A's Tinker
clients hammering small steps. A benchmark, not a test: it prints numbers.

    .venv/bin/python bench/client_fair_share.py [--seconds 8] [--clients 4]

One real ``loraplex-engine serve --tinker-keys`` with the tiny model (tests' fixture),
``--max-prompt-tokens 64 --max-step-tokens 4096``. A (team-a) runs ``--clients`` SDK
training clients, each looping ``forward_backward`` (one 32-token datum) + ``optim_step``
as fast as it can. B (team-b) is measured alone, beside A, and alone again, twice:

- ``experiment``: B is an experiment (tests' small spec), its steps/s from its status;
- ``tinker_loop``: B is an SDK client looping its own small step, its steps/s counted.

The target: B keeps >= 70% of its pace alone (the mean of the two windows alone). The big
``forward_backward`` and many-samples patterns are tests/engine/tenancy/test_client_fair_share.py.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the test helpers, as tests.support

from tinker import types  # noqa: E402

from tests.support.fair_share_setup import KEY_A, KEY_B, LIMITS  # noqa: E402
from tests.support.server_process import EngineServer, wait_until  # noqa: E402
from tests.support.tenant_api import put, spec, status  # noqa: E402
from tests.support.tinker_clients import close_all, service_client, sft  # noqa: E402
from tests.support.tiny_models import tiny_model  # noqa: E402


def step(tc: object, data: list[types.Datum]) -> None:
    fb = tc.forward_backward(data, "cross_entropy")  # type: ignore[attr-defined]
    opt = tc.optim_step(types.AdamParams(learning_rate=1e-4))  # type: ignore[attr-defined]
    fb.result()
    opt.result()


def hammer(models: list[object]) -> tuple[threading.Event, list[threading.Thread]]:
    data = [sft([1, 40, 41, 42], list(range(100, 128)))]
    stop = threading.Event()

    def loop(tc: object) -> None:
        while not stop.is_set():
            step(tc, data)

    threads = [threading.Thread(target=loop, args=(m,)) for m in models]
    for t in threads:
        t.start()
    return stop, threads


def ratio(rate: Callable[[], float], models: list[object]) -> tuple[float, float, float]:
    alone = rate()
    stop, threads = hammer(models)
    beside = rate()
    stop.set()
    for t in threads:
        t.join(120)
    after = rate()
    return alone, beside, after


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--clients", type=int, default=4)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp())
    keys = work / "keys.txt"
    keys.write_text(f"team-a {KEY_A}\nteam-b {KEY_B}\n")
    srv = EngineServer(tiny_model(), work / "ckpt", max_adapters=8, workdir=work,
                       extra_args=[*LIMITS, "--tinker-keys", str(keys)])  # fmt: skip
    with srv:
        a = service_client(srv.url, KEY_A)
        base = a.get_server_capabilities().supported_models[0].model_name
        models = [
            a.create_lora_training_client(base_model=base, rank=4).result()
            for _ in range(args.clients)
        ]
        results = {}
        with srv.client() as api:
            assert put(api, "team-b.b", spec()).status_code == 201
            wait_until(lambda: status(api, "team-b.b")["step"] >= 3)

            def experiment_rate() -> float:
                s0, t0 = status(api, "team-b.b")["step"], time.monotonic()
                time.sleep(args.seconds)
                return (status(api, "team-b.b")["step"] - s0) / (time.monotonic() - t0)

            results["experiment"] = ratio(experiment_rate, models)
            api.delete("/v1/experiments/team-b.b")
        b = service_client(srv.url, KEY_B)
        tb = b.create_lora_training_client(base_model=base, rank=4).result()
        mine = [sft([1, 50, 51], [200, 201, 202, 203])]

        def loop_rate() -> float:
            n, t0 = 0, time.monotonic()
            while time.monotonic() - t0 < args.seconds:
                step(tb, mine)
                n += 1
            return n / (time.monotonic() - t0)

        results["tinker_loop"] = ratio(loop_rate, models)
        close_all()
    for name, (alone, beside, after) in results.items():
        print(f"B {name}: alone {alone:.1f}/{after:.1f} steps/s, beside A {beside:.1f}: "
              f"{beside / ((alone + after) / 2):.2f} of alone")  # fmt: skip


if __name__ == "__main__":
    main()
