"""How close two trainings of the same maths must end, when only the order of float sums
differs (data-parallel ranks, a sharded base, another micro-batch packing, another CPU
kernel path), and why.

The unit is one Adam step: ``lr * steps`` is as far as a weight can move in ``steps``
steps (|m/(sqrt(v) + eps)| <= ~1 with bias correction). Two kinds of element differ:

- **The bulk.** A gradient that stands above the rounding floor differs between two
  summation orders by its relative rounding (fp32, a few hundred summed tokens:
  ~sqrt(n) * 2^-24, under GRAD_RTOL = 1e-5 of test_sharding.py); Adam's step is smooth
  there, so the weight differs by about that fraction of each step. Its RMS over an
  adapter, in Adam steps, is bounded by STEP_RMS_TOL = 1e-3: 100x the per-step rounding
  bound, and 1/100 of what a wrong or missing gradient share does (it turns most
  elements' steps by a sizable fraction of a step; measured RMS 0.3e-6 .. 1.7e-5 over
  the three ATEN_CPU_CAPABILITY paths on AMD EPYC, issue 34).
- **The floor.** An element whose gradient is itself at the rounding floor (a sum that
  nearly cancels) has Adam divide a rounding difference δ by sqrt(v) + eps ~ eps = 1e-8:
  its step can turn by up to δ/eps of a step, and the model carries that into the
  next rollouts' gradients. No useful a-priori bound exists per element; a handful of
  the ~8k elements are affected (<= 2 above 1e-5 absolute in every run measured). The
  worst seen: 1.5e-3 of the steps (AMD EPYC, ATEN_CPU_CAPABILITY=default), 3.5e-3
  (Intel Xeon avx512, issue 34's 1.38e-4 at lr 0.01 x 4 steps). STEP_MAX_TOL = 2e-2
  leaves 5x over the worst on either CPU and still refuses an element a whole step off.

The bulk check is the one a wrong gradient fails; the element check keeps any single
weight from drifting unnoticed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

STEP_RMS_TOL = 1e-3
STEP_MAX_TOL = 2e-2
# An adapter that trained moved some lora_B weight (zero at init): Adam's first step with
# a gradient moves it by lr, at least 1/steps of the unit. One that never had a nonzero
# advantage is still exactly 0, and a parity check on it would prove nothing.
MOVED_STEPS = 0.05


@dataclass(frozen=True, repr=False)
class AdapterGap:
    """Two adapters' difference, in Adam steps (``lr * steps``)."""

    rms: float
    worst: float
    moved: float  # max |lora_B| of the reference, in Adam steps

    def __repr__(self) -> str:
        return f"rms {self.rms:.1e} max {self.worst:.1e} (moved {self.moved:.2f})"


def adapter_gap(
    ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor], lr: float, steps: int
) -> AdapterGap:
    assert ref.keys() == got.keys() and ref, (sorted(ref), sorted(got))
    unit = lr * steps
    diff = torch.cat([((ref[k] - got[k]) / unit).flatten() for k in ref])
    moved = max(float(ref[k].abs().max()) for k in ref if "lora_B" in k) / unit
    return AdapterGap(float(diff.pow(2).mean().sqrt()), float(diff.abs().max()), moved)


def adapter_gap_of_files(ref: Path, got: Path, lr: float, steps: int) -> AdapterGap:
    """The gap between two PEFT adapter directories."""
    name = "adapter_model.safetensors"
    return adapter_gap(load_file(ref / name), load_file(got / name), lr, steps)


def assert_same_training(gaps: dict[str, AdapterGap], trained: int | None = None) -> None:
    """At least ``trained`` adapters (None: all) trained, and every one ended where the
    reference did, within the tolerances above."""
    shown = repr(gaps)
    moved = sum(g.moved >= MOVED_STEPS for g in gaps.values())
    assert gaps and moved >= (len(gaps) if trained is None else trained), shown
    assert all(g.rms <= STEP_RMS_TOL for g in gaps.values()), shown
    assert all(g.worst <= STEP_MAX_TOL for g in gaps.values()), shown
