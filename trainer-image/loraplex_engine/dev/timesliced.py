"""The benchmark's baseline arm: one adapter trained at a time, as a system that keeps a
single adapter on the device would. Each step swaps the adapter's weights and optimiser
moments in from host memory and back out, with real copies, so its cost is measured, not
modelled. Not a product mode: the engine trains fused (training_strategy.FusedTraining).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from loraplex_engine.train.algorithms import PolicyLoss
from loraplex_engine.train.rows import TrainRow
from loraplex_engine.train.strategy import AdapterTrainer, StepTotals, TrainOutcome, with_totals


@dataclass
class TimeSlicedTraining(AdapterTrainer):
    """One backward and optimiser step per adapter, swapped in from host buffers."""

    _host_buffers: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)

    def train(self, rows: list[TrainRow], losses: dict[str, PolicyLoss]) -> dict[str, TrainOutcome]:
        outcomes: dict[str, TrainOutcome] = {}
        for exp_id in losses:
            slot = self.model.slot_of(exp_id)
            self._swap(slot, to_device=True)
            mine, gaps = self.rescore([r for r in rows if r.experiment == exp_id])
            self.optimizer.zero_grad()
            stats = self.backward(mine, losses)
            outcomes |= with_totals(self.step_finite([exp_id]), [StepTotals.of(gaps, stats)])
            self._swap(slot, to_device=False)
        return outcomes

    def _swap(self, slot: int, to_device: bool) -> None:
        """Real copies of one slot's weights and moments to/from host buffers."""
        buffers = self._host_buffers.setdefault(slot, {})
        for key, tensor in self._slot_tensors(slot).items():
            if to_device and key in buffers:
                tensor.copy_(buffers[key], non_blocking=True)
            elif not to_device:
                buffers[key] = tensor.detach().to("cpu", copy=True)

    def _slot_tensors(self, slot: int) -> dict[str, torch.Tensor]:
        """Views of what one adapter owns: its rank's rows of A and columns of B, and their
        moments, in the layers it targets. A one-adapter-at-a-time system swaps exactly
        this; copying the whole stacked slot would overcharge the baseline."""
        tensors: dict[str, torch.Tensor] = {}
        for path, layer in self.model.lora_layers.items():
            r = layer.rank_of(slot)
            if not r:
                continue
            for pname, p, part in (
                ("A", layer.lora_A, (slot, slice(0, r))),
                ("B", layer.lora_B, (slot, slice(None), slice(0, r))),
            ):
                tensors[f"{path}.{pname}"] = p.data[part]
                tensors[f"{path}.{pname}.m"] = self.optimizer.exp_avg[p][part]
                tensors[f"{path}.{pname}.v"] = self.optimizer.exp_avg_sq[p][part]
        return tensors
