"""Start a data-parallel group on one machine, torchrun-style (parallel/distributed.py forms it).

``loraplex-engine run --world-size N``: this process is rank 0; it serves the rendezvous
store on loopback, starts ranks 1..N-1 as the same CLI command with ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set (what torchrun
sets), waits for each to check in while watching that none has exited, then forms the
group. A process started with ``RANK`` already set (by this launcher, or by torchrun for
every rank) joins through env:// instead.

Failure is loud: a worker that exits before it checks in fails the launcher at once,
naming its rank and exit code; one that dies later fails rank 0's next collective
(gloo reports the closed connection; a stalled one, the group's timeout); when rank 0
leaves on an error, its workers are killed; when it finishes, they must exit 0.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist

from loraplex_engine.parallel import distributed
from loraplex_engine.parallel.distributed import JOINED_KEY, LOOPBACK, World
from loraplex_engine.spec.errors import RankFailed, UsageError

STARTUP_TIMEOUT_S = 300.0  # for a worker to load the model and check in
EXIT_TIMEOUT_S = 60.0  # for a released worker to exit
POLL_S = 0.1


@contextmanager
def data_parallel(
    world_size: int,
    worker_argv: Sequence[str],
    device: torch.device,
    timeout_s: float = distributed.DEFAULT_TIMEOUT_S,
    on_worker_exit: Callable[[str], None] | None = None,
) -> Iterator[World | None]:
    """This process's World in a formed group; None for one rank started without RANK.

    ``worker_argv``: the CLI arguments (after ``loraplex-engine``) a worker runs with.
    ``on_worker_exit`` (rank 0, the server): a watcher thread calls it with the reason
    (``rank 1 was killed by signal 9``) as soon as a started worker exits non-zero, after
    killing the others, instead of waiting for a collective to notice; it is not
    expected to return (the server exits).
    """
    from_env = distributed.world_from_env()
    if from_env is not None:
        if from_env.size != world_size:
            raise UsageError(f"--world-size {world_size} but WORLD_SIZE={from_env.size}")
        if from_env.rank > 0:
            distributed.announce(from_env, timeout_s)
        with _joined(from_env, device, timeout_s):
            yield from_env
        return
    if world_size < 1:
        raise UsageError(f"--world-size must be at least 1, got {world_size}")
    if not timeout_s > 0:
        raise UsageError(f"--dist-timeout must be > 0 seconds, got {timeout_s}")
    if world_size == 1:
        yield None
        return
    world = World(0, world_size)
    store = distributed.serve_store(world_size, timeout_s)
    workers = _spawn(world_size, store.port, worker_argv)
    done = threading.Event()
    try:
        _wait_for_check_in(store, workers)
        if on_worker_exit is not None:
            _watch(workers, done, on_worker_exit)
        try:
            with _joined(world, device, timeout_s, store):
                yield world
        except RuntimeError as e:
            # A dead worker shows on rank 0 as a collective's connection error (gloo's
            # RuntimeError, DistError): name the rank. A user error (the same on every
            # rank) stays itself.
            _check_alive(workers, e)
            raise
        done.set()  # a released worker exits 0; one that fails to is reported below
        _wait_for_exit(workers)
    finally:
        done.set()
        _kill(workers)


def _watch(
    workers: dict[int, subprocess.Popen[bytes]],
    done: threading.Event,
    on_exit: Callable[[str], None],
) -> None:
    """Poll the workers until ``done``; the first one to exit non-zero is reported."""

    def run() -> None:
        while not done.wait(POLL_S):
            for rank, proc in workers.items():
                code = proc.poll()
                if code is not None and code != 0 and not done.is_set():
                    _kill(workers)
                    on_exit(f"rank {rank} {_exited(code)}")
                    return

    threading.Thread(target=run, name="rank-watch", daemon=True).start()


@contextmanager
def _joined(
    world: World, device: torch.device, timeout_s: float, store: dist.Store | None = None
) -> Iterator[None]:
    """In the group for the block; leaves it in order when the block ends: with a barrier
    when it finished, at once when it raised (distributed.leave). The block must not
    hold the engine when it ends (the group would outlive its leave)."""
    distributed.join(world, device, timeout_s, store)
    try:
        yield
    except BaseException:
        distributed.leave(clean=False)
        raise
    distributed.leave()


def _spawn(world_size: int, port: int, argv: Sequence[str]) -> dict[int, subprocess.Popen[bytes]]:
    """Ranks 1..N-1 as ``python -m loraplex_engine.cli <argv>``; their stderr is ours
    (a worker's error shows), their stdout (progress rank 0 prints already) is dropped."""
    workers = {}
    for rank in range(1, world_size):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": LOOPBACK,
            "MASTER_PORT": str(port),
        }
        workers[rank] = subprocess.Popen(
            [sys.executable, "-m", "loraplex_engine.cli", *argv],
            env=env,
            stdout=subprocess.DEVNULL,
        )
    return workers


def _wait_for_check_in(store: dist.Store, workers: dict[int, subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    waiting = set(workers)
    while waiting:
        _check_alive(workers)
        waiting = {r for r in waiting if not store.check([JOINED_KEY.format(rank=r)])}
        if waiting and time.monotonic() > deadline:
            raise RankFailed(
                f"ranks {sorted(waiting)} did not start within {STARTUP_TIMEOUT_S:.0f}s"
            )
        if waiting:
            time.sleep(POLL_S)


def _check_alive(
    workers: dict[int, subprocess.Popen[bytes]], cause: Exception | None = None
) -> None:
    for rank, proc in workers.items():
        code = proc.poll()
        if code is not None:
            raise RankFailed(f"rank {rank} {_exited(code)}") from cause


def _wait_for_exit(workers: dict[int, subprocess.Popen[bytes]]) -> None:
    for rank, proc in workers.items():
        try:
            code = proc.wait(EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise RankFailed(f"rank {rank} did not exit within {EXIT_TIMEOUT_S:.0f}s") from None
        if code != 0:
            raise RankFailed(f"rank {rank} {_exited(code)}")


def _exited(code: int) -> str:
    if code < 0:
        return f"was killed by signal {-code}"
    return f"exited with code {code} (its error is above)"


def _kill(workers: dict[int, subprocess.Popen[bytes]]) -> None:
    for proc in workers.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
