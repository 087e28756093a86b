"""The multi-LoRA linear layer: one frozen base linear, many stacked adapter slots.

Each row of a batch carries a slot id. ``y = base(x)`` runs once for all rows; the LoRA delta
``scale[s] * (x A[s]^T) B[s]^T`` is then added to the rows of each slot ``s``. Slot 0 holds no
adapter: its rows skip the delta, so they equal the frozen base exactly.

Rows are grouped by slot and padded to the largest group, so the delta is two batched matmuls
over ``[groups, rows*tokens, in]`` with each slot's A/B read once (not copied per row, which
would cost ``rows * rank * in`` memory per layer, ruinous in KV-cache decoding). On CUDA in
bf16 the delta is instead grouped matmuls at each slot's own rank (lora/grouped.py).
"""

from __future__ import annotations

import math
import threading

import torch
from torch import Tensor, nn

from loraplex_engine.lora.config import LoRAConfig
from loraplex_engine.lora.grouped import (
    Path,
    check_mode,
    choose_path,
    fused_grouped_mm,
    grouped_delta,
    grouped_mm_blocker,
    kernel_env,
    reference_grouped_mm,
)
from loraplex_engine.lora.routing import Router, Routing

__all__ = ["LoRAConfig", "MultiLoRALinear"]


class MultiLoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus ``slots`` LoRA adapters stacked and zero-padded to ``max_rank``.

    ``lora_A: [slots, max_rank, in]`` and ``lora_B: [slots, out, max_rank]`` are one parameter
    each; a slot only ever receives gradient from its own rows, so per-slot optimisation is a
    matter of slicing (see train/optim.py). Padding beyond a slot's rank stays exactly zero: its
    gradient is zero and AdamW keeps a zero parameter with zero gradient at zero.
    """

    def __init__(
        self,
        base_layer: nn.Linear,
        slots: int,
        max_rank: int,
        dtype: torch.dtype | None = None,
        grouped_mm: str = "auto",
    ) -> None:
        super().__init__()
        # "auto" | "always" | "never": when the delta runs as grouped matmuls (lora/grouped.py).
        self.grouped_mm = check_mode(grouped_mm)
        self.base_layer = base_layer
        self.base_layer.requires_grad_(False)
        out_f, in_f = base_layer.weight.shape
        # Masters in ``dtype`` (the engine passes fp32 whatever the base's dtype).
        kw = {"device": base_layer.weight.device, "dtype": dtype or base_layer.weight.dtype}
        self.lora_A = nn.Parameter(torch.zeros(slots, max_rank, in_f, **kw))
        self.lora_B = nn.Parameter(torch.zeros(slots, out_f, max_rank, **kw))
        # Zero scale means "no contribution": slot 0, free slots, adapters not targeting us.
        self.register_buffer("scale", torch.zeros(slots, **kw), persistent=False)
        self.register_buffer("dropout", torch.zeros(slots, **kw), persistent=False)
        self._dropout_slots: set[int] = set()  # host-side copy: no device sync per forward
        self._ranks: dict[int, int] = {}  # slots that contribute here -> their rank
        # The routing of the forward under way, per thread: the pipelined tick's rollout
        # may decode on one thread while the update trains on another (rollout/torch/
        # streams.py); a plain dict (not threading.local) so the module still deep-copies.
        self._routers: dict[int, Router] = {}

    @property
    def router(self) -> Router | None:
        """The router of this thread's forward (None: every row is the base's)."""
        return self._routers.get(threading.get_ident())

    @router.setter
    def router(self, router: Router | None) -> None:
        if router is None:
            self._routers.pop(threading.get_ident(), None)
        else:
            self._routers[threading.get_ident()] = router

    @property
    def dropout_slots(self) -> frozenset[int]:
        """Slots with LoRA dropout here (applied while the module is in train mode)."""
        return frozenset(self._dropout_slots)

    @property
    def in_features(self) -> int:
        return self.lora_A.shape[2]

    @property
    def out_features(self) -> int:
        return self.lora_B.shape[1]

    def rank_of(self, slot: int) -> int:
        """The rank ``slot`` uses here; 0 when it does not target this layer."""
        return self._ranks.get(slot, 0)

    def ranks(self) -> dict[int, int]:
        """Slot -> rank of every slot that contributes here."""
        return dict(self._ranks)

    @torch.no_grad()
    def set_slot(
        self,
        slot: int,
        rank: int,
        scale: float,
        dropout: float,
        generator: torch.Generator | None = None,
    ) -> None:
        """Init a slot PEFT-style: A kaiming-uniform (a=sqrt(5)), B zero; ``scale=0`` clears it."""
        self.lora_A[slot].zero_()
        self.lora_B[slot].zero_()
        self.scale[slot] = scale
        self.dropout[slot] = dropout
        self._dropout_slots.discard(slot)
        self._ranks.pop(slot, None)
        if scale:
            self._ranks[slot] = rank
        if dropout:
            self._dropout_slots.add(slot)
        if scale:
            a = torch.empty(rank, self.in_features, dtype=torch.float32)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
            self.lora_A[slot, :rank] = a

    def forward(self, x: Tensor) -> Tensor:
        y = self.base_layer(x)
        plan = self.router.plan(x.shape[0]) if self.router is not None else None
        # Skip layers no adapter in this batch targets: wrapped-but-unused projections
        # (an engine wraps every linear; most adapters target a few) cost nothing.
        if plan is None or plan.slot_set.isdisjoint(self._ranks):
            return y
        plan, delta = self.routed_delta(x, plan)
        delta = delta.to(y.dtype)
        return y + delta if plan.in_order else y.index_add(0, plan.rows, delta)

    def routed_delta(self, x: Tensor, plan: Routing) -> tuple[Routing, Tensor]:
        """The delta on this layer's path, and the routing whose ``rows`` it is for (the
        grouped path orders the groups by rank)."""
        path = self.path(x.dtype)
        if path != "bmm":
            plan = plan.ranked()
        return plan, self._delta(x, plan, path)

    def path(self, dtype: torch.dtype) -> Path:
        """Which delta computation a forward with activations of ``dtype`` runs."""
        shapes = (self.in_features, self.out_features, self.lora_A.shape[1])
        blocker = grouped_mm_blocker(kernel_env(self.lora_A.device), dtype, shapes)
        return choose_path(self.grouped_mm, blocker)

    def _delta(self, x: Tensor, plan: Routing, path: Path = "bmm") -> Tensor:
        """LoRA delta for ``plan.rows``, in that order: ``[n, *x.shape[1:-1], out]``."""
        # Compute in the activations' dtype (the base's: bf16 on a GPU): A and B are cast,
        # not x, and the cast's backward carries the gradient to the fp32 masters.
        xs = x if plan.in_order else x[plan.rows]
        if self.training and self._dropout_slots:
            xs = self._dropout(xs, self.dropout[plan.slots][plan.group].to(xs.dtype))
        if path != "bmm":
            ranks = [self._ranks.get(s, 0) for s in plan.slot_list]
            mm = fused_grouped_mm if path == "grouped" else reference_grouped_mm
            return grouped_delta(xs, self.lora_A, self.lora_B, self.scale, plan, ranks, mm)
        return self._bmm_delta(xs, plan)

    def _bmm_delta(self, xs: Tensor, plan: Routing) -> Tensor:
        """Groups padded to the largest group and slots to the batch's largest rank."""
        groups = plan.slots.numel()
        if plan.dense:  # equal groups (the usual case): grouping is a reshape, no padding
            padded = xs.reshape(groups, -1, xs.shape[-1])
        else:
            padded = xs.new_zeros((groups, plan.width, *xs.shape[1:]))
            padded = padded.index_put((plan.group, plan.pos), xs).flatten(1, -2)
        # Only the largest rank in the batch: columns past it are zero padding.
        r = max(self._ranks.get(s, 0) for s in plan.slot_set)
        a = self.lora_A[plan.slots, :r].to(xs.dtype)
        b = self.lora_B[plan.slots, :, :r].to(xs.dtype)
        # Scale the rank-sized intermediate, not the output: r/out times fewer multiplies.
        h = torch.bmm(padded, a.mT) * self.scale[plan.slots].to(xs.dtype).view(-1, 1, 1)
        d = torch.bmm(h, b.mT)
        d = d.view(groups, plan.width, *xs.shape[1:-1], -1)
        return d.flatten(0, 1) if plan.dense else d[plan.group, plan.pos]

    @staticmethod
    def _dropout(xs: Tensor, p: Tensor) -> Tensor:
        """Inverted dropout with a per-row probability (each row's slot's)."""
        p = p.view(-1, *([1] * (xs.dim() - 1)))
        keep = torch.rand_like(xs) >= p
        return xs * keep / (1 - p)
