"""A client model and the operations queued on it: what a request thread waits on and
a tick resolves (clients/ticking.py)."""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from loraplex_engine.clients.fused import SlotGrads
from loraplex_engine.spec.training_service import ClientModelInfo

OpKind = Literal[
    "forward", "forward_backward", "optim_step", "save_state", "load_state", "unload", "sample"
]
TRAIN_KINDS = ("forward", "forward_backward")
# A Tinker client fetches these answers later (the SDK's retrieve_future): clients/gather.py.
DETACHED_KINDS = ("forward", "forward_backward", "optim_step")


@dataclass
class Op:
    """One call, answered once: a result or an error."""

    kind: OpKind
    payload: Any = None
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None
    queued_at: float = field(default_factory=time.monotonic)  # the gather's bound
    # Its place among the model's calls not taken yet: the SDK's seq_id (None: after
    # every numbered call), then arrival (ClientModel.put).
    order: int | None = None
    # Its caller fetches the answer later (the Tinker layer: the SDK's retrieve_future),
    # and says so (ClientModels.retrieved); else the answer is delivered when wait returns.
    detached: bool = False

    def resolve(self, result: Any = None, error: BaseException | None = None) -> None:
        if not self.done.is_set():
            self.result, self.error = result, error
            self.done.set()

    def wait(self) -> Any:
        """Blocks until a tick answers (or the engine refuses: the loop stopped)."""
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.result


@dataclass(eq=False)  # hashed by identity
class ClientModel:
    info: ClientModelInfo
    name: str  # its adapter's name in the model and the optimiser
    # Weight versions: +1 at every optimiser step and load (sampling compares it with
    # the version a sampler_weights state saved); the incarnation tells two loads of one
    # model id apart.
    version: int = 0
    incarnation: str = field(default_factory=lambda: uuid.uuid4().hex)
    grads: SlotGrads | None = None  # accumulated since its last optim_step
    queue: deque[Op] = field(default_factory=deque)
    generator: torch.Generator = field(default_factory=torch.Generator)  # saved with weights
    unloaded: bool = False
    # A client experiment's (clients/experiments.py): optimiser steps taken, the
    # checkpoint cadence (every, keep; every 0: none) and who hears of each checkpoint.
    steps: int = 0
    checkpoints: tuple[int, int] = (0, 0)
    on_checkpoint: Callable[[Any], None] | None = None
    # When its client last queued a call (monotonic): a client experiment's idleness,
    # which the operator reads to enforce spec.client.idleSeconds.
    last_call: float = field(default_factory=time.monotonic)
    # Answers of detached calls a tick took that its client has not fetched yet: until it
    # has, its next call is not on its way (clients/gather.py).
    outstanding: int = 0

    def idle_seconds(self, now: float) -> float:
        """Seconds since its client's last call; 0 while a call is queued."""
        return 0.0 if self.queue else max(0.0, now - self.last_call)

    def put(self, op: Op) -> None:
        """Queue ``op`` after every queued op of a lower or equal order: the one queue
        that orders the model's calls (a tick takes a prefix of it)."""
        rank = _rank(op)
        i = len(self.queue)
        while i and _rank(self.queue[i - 1]) > rank:
            i -= 1
        self.queue.insert(i, op)


def _rank(op: Op) -> float:
    return float("inf") if op.order is None else float(op.order)


def adapter_name(namespace: str, model_id: str) -> str:
    """A client model's adapter name: never an experiment id (those have no ':')."""
    return f"tinker:{namespace}/{model_id}"
