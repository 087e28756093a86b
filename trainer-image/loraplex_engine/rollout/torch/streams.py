"""The torch rollout beside training on CUDA: one cohort generates on a side stream while
another trains on the default stream (``--schedule pipelined``; docs/design/pipeline.md,
"Where the overlap happens").

The torch rollout decodes with the trainer's own model, so the two share the frozen base
(read by both, written by neither) and the stacked adapter slots (lora/layers.py), which
the optimiser writes slot by slot (train/optim.py). They may run at once only when
nothing one of them writes is read by the other, and when both working sets fit:

- **disjoint slots**: no experiment generates in the tick that trains it (on-policy
  cohorts; a stale experiment's own update would be read half-written: double-buffered
  slots are not built), no queued completion reads a slot being trained, and no client
  model trains (its slots are not known in advance);
- **per-thread state**: routing is per thread (lora/layers.py ``router``); the train
  flag and gradient checkpointing are per module, so the overlap needs checkpointing off
  (it also means memory is tight) and no dropout where the rollout reads (attention
  dropout in the base's config, LoRA dropout on a slot it decodes);
- **memory**: the training micro-batch's activations plus the rollout's KV cache fit in
  what the static bytes leave of the plan (memory/capacity_plan.py): both budgets fill
  that space when derived, so the check takes this tick's own tokens (``fits``);
- **stream order**: the side stream waits for an event recorded on the default stream
  when the rollout is launched (the last sync and update are done), and the default
  stream waits for the side stream when the tick joins the rollout (its KV cache and
  outputs are freed before the next update reuses the memory).

On any other device, or when one of these fails, the stages run one after the other as
before (:func:`overlap_blocker` says why). Pure checks here, tested on the CPU; the
streams themselves need a GPU (bench/gpu_device.py ``torch_pipelined``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from loraplex_engine.spec.api_types import MemoryPlan


@dataclass(frozen=True)
class StaticFacts:
    """What does not change while the engine runs: whether overlap can ever apply."""

    device_type: str
    torch_rollout: bool  # the sampler is the trainer's model (TorchRollout)
    single_process: bool  # no data parallelism, no lockstep (a sharded base)
    checkpointing: bool  # gradient checkpointing flips the decoder layers' train flag
    attention_dropout: float  # the base config's (applied while the model trains)


def static_blocker(f: StaticFacts) -> str | None:
    """Why the torch rollout can never overlap training on this engine (None: it may)."""
    if f.device_type != "cuda":
        return "not on CUDA"
    if not f.torch_rollout:
        return "the sampler is not the trainer's model"
    if not f.single_process:
        return "data parallel or lockstep ranks"
    if f.checkpointing:
        return "gradient checkpointing is on"
    if f.attention_dropout:
        return "the base model has attention dropout"
    return None


@dataclass(frozen=True)
class TickFacts:
    """This tick's cohorts, as the overlap needs to know them."""

    rollout_slots: frozenset[int]  # every slot the rollout batch reads (jobs' included)
    trained_slots: frozenset[int]  # the slots this tick's update writes
    dropout_slots: frozenset[int]  # slots with LoRA dropout
    client_train: bool  # client models train in this tick (their slots unknown here)
    train_tokens: int  # tokens of the rows to train
    train_adapters: int
    rollout_tokens: int  # prompt + new tokens the rollout may hold in its KV cache


def overlap_blocker(plan: MemoryPlan | None, t: TickFacts) -> str | None:
    """Why this tick's rollout may not run beside its update (None: it may)."""
    if t.client_train:
        return "a client model trains"
    if t.rollout_slots & t.trained_slots:
        return "a slot is read by the rollout and written by the update"
    if t.rollout_slots & t.dropout_slots:
        return "a slot the rollout reads has LoRA dropout"
    if plan is None or not fits(plan, t.train_tokens, t.train_adapters, t.rollout_tokens):
        return "the two working sets do not fit together"
    return None


def fits(plan: MemoryPlan, train_tokens: int, adapters: int, rollout_tokens: int) -> bool:
    """A training micro-batch of this tick's rows (at most the plan's budget) and the
    rollout's KV cache (at most its budget) fit together in what the static bytes leave
    of the planned device memory; False where the plan does not know the costs."""
    known = (plan.device_bytes, plan.activation_fixed_bytes, plan.kv_bytes_per_token)
    if any(x is None for x in known):
        return False
    assert plan.device_bytes is not None and plan.activation_fixed_bytes is not None
    assert plan.kv_bytes_per_token is not None
    free = int(plan.device_bytes * (1.0 - plan.headroom)) - plan.static_bytes
    tokens = min(train_tokens, plan.micro_batch_tokens)
    train = (
        plan.activation_fixed_bytes
        + (plan.activation_bytes_per_token or 0) * tokens
        + (plan.activation_bytes_per_adapter or 0) * adapters
    )
    kv_tokens = min(rollout_tokens, plan.rollout_kv_tokens or rollout_tokens)
    return train + plan.kv_bytes_per_token * kv_tokens <= free


class SideStream:
    """The side stream a rollout thread decodes on, and the events that order it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def launch(self) -> torch.cuda.Event:
        """Recorded on the tick thread's (default) stream before the rollout starts: the
        last sync and update are done when the side stream passes it."""
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        return ready

    @contextmanager
    def generating(self, ready: torch.cuda.Event) -> Iterator[None]:
        """On the rollout thread: its kernels on the side stream, after ``ready``. The
        backend's results reach the host (a sync of this stream) before the block ends."""
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            yield
        self.stream.synchronize()

    def join(self) -> None:
        """On the tick thread, after the rollout thread ended: the default stream waits
        for everything the side stream did (its KV cache is freed before reuse)."""
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
