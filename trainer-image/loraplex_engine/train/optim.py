"""Per-adapter AdamW over stacked LoRA parameters.

Equals one ``torch.optim.AdamW`` per adapter: every slot has its own lr, betas, eps,
weight decay, step count and moments, and its own learning-rate schedule
(lr_schedule.lr_factor of its own step count) and gradient clipping (on that adapter's
own gradient norm, so one tenant's spike never scales another's update). Slots that share
settings and step count are updated together with ``torch._foreach_*`` ops on views of the
stacked tensors (contiguous runs of slots become one view), mirroring torch's own AdamW
arithmetic op for op.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

import torch
from torch import Tensor, nn

from loraplex_engine.lora.model import MultiLoRAModel, check_state_dict
from loraplex_engine.spec.errors import AdapterError, UnknownAdapterError
from loraplex_engine.train.optim_settings import AdamWSettings, adamw_settings

__all__ = ["AdamWSettings", "PerAdapterAdamW", "adamw_settings"]

# torch.nn.utils.clip_grad_norm_'s guard against a zero norm; kept equal so clipping
# matches it to the last bit of arithmetic it shares.
_CLIP_EPS = 1e-6


class PerAdapterAdamW:
    """AdamW state per adapter slot of a MultiLoRAModel."""

    def __init__(self, model: MultiLoRAModel) -> None:
        self.model = model
        self.params: list[nn.Parameter] = [
            p for layer in model.lora_layers.values() for p in (layer.lora_A, layer.lora_B)
        ]
        self.exp_avg = {p: torch.zeros_like(p, requires_grad=False) for p in self.params}
        self.exp_avg_sq = {p: torch.zeros_like(p, requires_grad=False) for p in self.params}
        self.settings: dict[int, AdamWSettings] = {}  # slot -> settings
        self.steps: dict[int, int] = {}  # slot -> steps taken
        self._slots: dict[str, int] = {}  # name -> slot, as registered here

    # ---- adapters ----------------------------------------------------------------------

    def add_adapter(self, name: str, settings: AdamWSettings) -> None:
        """Start fresh optimiser state for the model's adapter ``name``."""
        slot = self.model.slot_of(name)
        self._clear(slot)
        self._slots[name], self.settings[slot], self.steps[slot] = slot, settings, 0

    def remove_adapter(self, name: str) -> None:
        slot = self._slot(name)
        self._clear(slot)
        del self._slots[name], self.settings[slot], self.steps[slot]

    def has_adapter(self, name: str) -> bool:
        return name in self._slots

    def configure(self, name: str, settings: AdamWSettings) -> None:
        """Replace an adapter's settings, keeping its step count and moments (a resumed
        run takes its settings from its spec and its schedule position from its state)."""
        self.settings[self._slot(name)] = settings

    def step_count(self, name: str) -> int:
        return self.steps[self._slot(name)]

    def _slot(self, name: str) -> int:
        if name not in self._slots:
            raise UnknownAdapterError(f"optimiser has no adapter named {name!r}")
        return self._slots[name]

    def _clear(self, slot: int) -> None:
        for p in self.params:
            self.exp_avg[p][slot].zero_()
            self.exp_avg_sq[p][slot].zero_()

    # ---- stepping ----------------------------------------------------------------------

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def slots_with_grad(self) -> list[int]:
        """Slots whose gradient is nonzero somewhere (one device sync)."""
        grads = [p.grad.flatten(1).ne(0).any(1) for p in self.params if p.grad is not None]
        if not grads:
            return []
        return torch.stack(grads).any(0).nonzero().flatten().tolist()

    @torch.no_grad()
    def step(self, slots: Iterable[int] | None = None) -> list[int]:
        """Update the given slots, or those with a nonzero gradient; returns the slots stepped.

        torch's AdamW steps a parameter whose gradient is all zeros but not one whose gradient
        is None; stacked slots cannot tell these apart, so pass ``slots`` (the adapters that
        were in the batch) to step an adapter whose gradient happens to be exactly zero.
        """
        active = sorted(set(self.slots_with_grad() if slots is None else slots) - {0})
        self._check_slots(active)
        self._clip_grads(active)
        groups: dict[tuple[AdamWSettings, int], list[int]] = {}
        for slot in active:
            self.steps[slot] += 1
            groups.setdefault((self.settings[slot], self.steps[slot]), []).append(slot)
        for (settings, step), group in groups.items():
            self._update(group, settings, step)
        return active

    def _check_slots(self, slots: list[int]) -> None:
        """Every slot to step must hold, in the model, the adapter registered here for it."""
        in_model = {slot: name for name, slot in self.model.adapters().items()}
        mine = {slot: name for name, slot in self._slots.items()}
        for slot in slots:
            if slot not in mine or in_model.get(slot) != mine[slot]:
                raise AdapterError(
                    f"slot {slot} holds adapter {in_model.get(slot)!r} in the model but"
                    f" {mine.get(slot)!r} in the optimiser (no optimiser settings);"
                    " call add_adapter"
                )

    def grad_norms(self) -> Tensor:
        """Per slot, the 2-norm of its gradient over every stacked parameter: the norm
        torch.nn.utils.clip_grad_norm_ sees over that adapter's own parameters (the rank
        padding and untargeted layers of a slot hold zero gradient and add nothing)."""
        squares = [
            p.grad.flatten(1).float().pow(2).sum(1) for p in self.params if p.grad is not None
        ]
        return torch.stack(squares).sum(0).sqrt()

    def _clip_grads(self, slots: list[int]) -> None:
        """Scale each clipped slot's gradient to at most its max_grad_norm, by its own norm
        alone; slots without clipping (and those not stepped) keep a factor of 1."""
        limits = {s: limit for s in slots if (limit := self.settings[s].max_grad_norm) is not None}
        if not limits:
            return
        norms = self.grad_norms()
        # Exactly 1 for every other slot, whatever its norm (even a non-finite one).
        coef = torch.ones_like(norms)
        index = torch.tensor(list(limits), device=norms.device)
        max_norm = torch.tensor(list(limits.values()), device=norms.device, dtype=norms.dtype)
        coef[index] = (max_norm / (norms[index] + _CLIP_EPS)).clamp(max=1.0)
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(coef.view(-1, *([1] * (p.grad.dim() - 1))).to(p.grad.dtype))

    def _update(self, slots: list[int], s: AdamWSettings, step: int) -> None:
        params, grads, m, v = [], [], [], []
        for p in self.params:
            if p.grad is None:  # like torch: a parameter without gradient is not stepped
                continue
            for run in _runs(slots):
                params.append(p.data[run])
                grads.append(p.grad[run])
                m.append(self.exp_avg[p][run])
                v.append(self.exp_avg_sq[p][run])
        if not params:
            return
        beta1, beta2 = s.betas
        lr = s.lr_at(step)
        # Same arithmetic as torch.optim.adam._single_tensor_adam (decoupled weight decay).
        if s.weight_decay:
            torch._foreach_mul_(params, 1 - lr * s.weight_decay)
        torch._foreach_lerp_(m, grads, 1 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)
        step_size = lr / (1 - beta1**step)
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, (1 - beta2**step) ** 0.5)
        torch._foreach_add_(denom, s.eps)
        torch._foreach_addcdiv_(params, m, denom, value=-step_size)

    # ---- per-adapter state -------------------------------------------------------------

    def state_dict(self, name: str) -> dict[str, Any]:
        """Settings, step and moments of one adapter, moments keyed like its PEFT weights."""
        slot = self._slot(name)
        return {
            "settings": asdict(self.settings[slot]),
            "step": self.steps[slot],
            "exp_avg": _clone(self.model.adapter_views(name, self.exp_avg.__getitem__)),
            "exp_avg_sq": _clone(self.model.adapter_views(name, self.exp_avg_sq.__getitem__)),
        }

    def load_state_dict(self, name: str, state: dict[str, Any]) -> None:
        """Restore one adapter's optimiser state (registering it if new); validates first."""
        settings = AdamWSettings(**state["settings"])
        step = int(state["step"])
        m_views = self.model.adapter_views(name, self.exp_avg.__getitem__)
        v_views = self.model.adapter_views(name, self.exp_avg_sq.__getitem__)
        check_state_dict(m_views, state["exp_avg"], what=f"optimiser exp_avg of {name!r}")
        check_state_dict(v_views, state["exp_avg_sq"], what=f"optimiser exp_avg_sq of {name!r}")
        self.add_adapter(name, settings)
        self.steps[self._slots[name]] = step
        for views, given in ((m_views, state["exp_avg"]), (v_views, state["exp_avg_sq"])):
            for key, view in views.items():
                view.copy_(given[key])


def _runs(slots: list[int]) -> list[slice]:
    """Sorted slots as slices of contiguous runs: [1, 2, 3, 5] -> [1:4, 5:6]."""
    runs: list[slice] = []
    for s in slots:
        if runs and runs[-1].stop == s:
            runs[-1] = slice(runs[-1].start, s + 1)
        else:
            runs.append(slice(s, s + 1))
    return runs


def _clone(views: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in views.items()}
