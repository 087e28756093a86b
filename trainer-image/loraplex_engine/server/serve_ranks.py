"""``loraplex-engine serve --world-size N``: one engine over N ranks in one pod.

Rank 0 is the server: it binds the port, answers the API, drives the tick and writes
the checkpoints. OpenAI completions ride in the tick's rollout, which rank 0 sends to
every rank (data_parallel.RolloutMessage): a completion row stays on rank 0 (it streams
to rank 0's client), and under ``--shard-base``, where every forward is a collective,
the other ranks join its forwards in lockstep (dummy ones once out of rows), so a
completion is served whatever the base's sharding, in a tick of its own too. With
``--rollout-backend vllm`` rank 0 alone runs vLLM and decodes every row; the workers
start none and only train. Ranks
1..N-1 are started by rank 0 as the same command line (parallel/launch.py, torchrun's
variables), or by torchrun itself (``RANK`` set: every process joins by env://). A
worker binds nothing: it loads the same model with the same flags, then runs rank 0's
messages (parallel/data_parallel.py: adapter adds and removes, train phases, heartbeats) until
rank 0 releases it.

The pod is one unit. A worker that dies makes rank 0 exit 1 at once with one line
naming the rank (the launcher's watcher, or rank 0's next collective failing), so
Kubernetes restarts the pod and the operator resumes its experiments from their last
checkpoints; a worker exits when rank 0 is gone (its pending collective fails, or its
parent process changed). Workers ignore SIGINT and SIGTERM: rank 0 gets the pod's
SIGTERM, checkpoints, and then releases them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

import torch

from loraplex_engine.parallel import distributed
from loraplex_engine.parallel.distributed import World
from loraplex_engine.parallel.launch import data_parallel
from loraplex_engine.settings.engine import ProcessSettings
from loraplex_engine.spec.errors import RankFailed

if TYPE_CHECKING:
    from loraplex_engine.engine import Engine
    from loraplex_engine.parallel.data_parallel import DataParallelTraining

log = logging.getLogger("loraplex_engine.server.serve")

PROG = "loraplex-engine serve"
PARENT_POLL_S = 0.5  # how often a worker checks that its launcher is still there
# How long rank 0, after a failed collective, lets the launcher's watcher name the dead
# rank before it exits with the collective's own error instead.
NAME_THE_RANK_S = 1.0


def is_worker() -> bool:
    """This process is rank 1..N-1 (``RANK`` set by rank 0's launcher or torchrun)."""
    world = distributed.world_from_env()
    return world is not None and world.rank > 0


def fatal(reason: str) -> NoReturn:
    """Exit the whole engine now, with one line naming why (no drain, no checkpoint:
    the experiments resume from their last checkpoints when the pod restarts)."""
    print(f"{PROG}: error: {reason}; the engine exits", file=sys.stderr, flush=True)
    os._exit(1)


class RankGroup:
    """Rank 0's side of the group, for the server: start and join the workers (in the
    loading thread), serve heartbeats and fail fast (the loop), release them (shutdown)."""

    def __init__(self, settings: ProcessSettings, argv: list[str], device: str) -> None:
        self.size = settings.world_size
        self.timeout_s = settings.dist_timeout
        self.argv = argv
        self.device = torch.device(device)
        self._stack = contextlib.ExitStack()
        self.engine: Engine | None = None
        self.world: World | None = None  # once the group has formed (N > 1)
        self._failed = threading.Lock()

    def start(self) -> World | None:
        """Start ranks 1..N-1 and form the group; None for one rank."""
        if distributed.world_from_env() is not None:  # torchrun's: go when it goes
            _exit_with_parent()
        world = self._stack.enter_context(
            data_parallel(self.size, self.argv, self.device, self.timeout_s, fatal)
        )
        self.world = world
        if world is not None:
            log.info(
                "data parallel over %d ranks (%s)", world.size, distributed.backend_for(self.device)
            )
        return world

    def loaded(self, engine: Engine) -> None:
        """Every rank has loaded its engine (a barrier), so the API's first add finds the
        workers following; heartbeats keep them inside the group's timeout."""
        self.engine = engine
        if engine.ranks is None:
            return
        engine.ranks.heartbeat_s = min(engine.ranks.heartbeat_s, self.timeout_s / 4)
        torch.distributed.barrier()

    def idle(self) -> None:
        """Between ticks with nothing to do: a heartbeat when one is due."""
        if self.engine is not None and self.engine.ranks is not None:
            self.engine.ranks.heartbeat()

    def failed(self, error: BaseException) -> NoReturn:
        """A tick or heartbeat failed on a group of N > 1: the ranks may be mid-collective
        and cannot be brought back in step, so the engine exits. A dead worker is named
        by the launcher's watcher, given a moment to see it."""
        with self._failed:
            time.sleep(NAME_THE_RANK_S)
            fatal(f"a collective failed ({_one_line(error)})")

    @property
    def on_error(self) -> Callable[[BaseException], None] | None:
        """The loop's hook: with workers, any tick error ends the engine (see failed)."""
        if self.engine is None or self.engine.ranks is None:
            return None
        return self.failed

    def close(self) -> bool:
        """Release the workers after the shutdown checkpoints; False if one failed."""
        if self.world is None:  # one rank, or the group never formed
            self._stack.close()
            return True
        if self.engine is None:  # rank 0 never loaded: the workers are not released
            return self._abort(RankFailed("rank 0 did not load its engine"))
        agree = True
        engine, self.engine = self.engine, None  # not held when the group is left
        try:
            if engine.ranks is not None:
                agree = self._compare(engine.ranks)
                engine.ranks.stop()
        except Exception as e:  # a worker is gone
            log.error("releasing the worker ranks failed: %s", _one_line(e))
            return self._abort(e)
        del engine
        try:
            self._stack.close()  # the workers exit 0, the group is destroyed
        except Exception as e:
            log.error("the worker ranks did not stop cleanly: %s", _one_line(e))
            return False
        return agree

    def _compare(self, ranks: DataParallelTraining) -> bool:
        """Before releasing them: every rank ends with rank 0's adapters, bit for bit."""
        disagree = ranks.compare_ranks()
        for line in disagree:
            log.error("ranks disagree: %s", line)
        if not disagree:
            log.info(
                "all %d ranks hold the same %d trained adapters (weights, Adam moments, steps)",
                ranks.world.size,
                len(ranks.fingerprints()),
            )
        return not disagree

    def _abort(self, error: Exception) -> bool:
        """Leave the launcher on ``error``: it kills the workers at once."""
        with contextlib.suppress(Exception):
            self._stack.__exit__(type(error), error, error.__traceback__)
        return False


def run_worker(
    settings: ProcessSettings, device: str, build: Callable[[World | None], Engine]
) -> int:
    """Rank 1..N-1: join, load the same engine, follow rank 0 until it releases us."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    _exit_with_parent()
    size, timeout_s = settings.world_size, settings.dist_timeout
    with data_parallel(size, [], torch.device(device), timeout_s) as world:
        assert world is not None  # RANK is set
        engine = build(world)
        try:
            torch.distributed.barrier()
            assert engine.ranks is not None
            phases = engine.ranks.follow()
        except RuntimeError as e:  # rank 0 is gone (closed connection) or timed out
            # Out at once: leaving the group in order could wait on the dead rank.
            print(f"{PROG}: rank {world.rank}: error: {_one_line(e)}", file=sys.stderr, flush=True)
            os._exit(1)
        engine.close()
        # Before the group is left: a sharded base's DTensors hold it (distributed.leave).
        del engine
    log.info("rank %d released by rank 0 after %d train phases", world.rank, phases)
    return 0


def _exit_with_parent() -> None:
    """A rank whose launcher (rank 0 for a worker it started, or torchrun's agent) is
    gone exits, whatever it is waiting in."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        print(
            f"{PROG}: error: its launcher (pid {parent}) is gone; exiting",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text[:300] or type(error).__name__
