"""The multi-LoRA delta as grouped matmuls over rows sorted by slot, each slot at its own rank.

The bmm path (lora/layers.py) pads every slot group to the largest group and every slot to the
largest rank in the batch: a rank-8 tenant next to a rank-64 one pays rank 64, and a
small group pays for the largest. Here the routed rows (already sorted by slot by
``Routing.build``) are flattened to tokens and cut into *runs*: consecutive slot groups
whose rank in this layer is the same. Each run is two grouped matmuls (one segment per
slot, ``offs`` marking where each ends): ``x @ A[:r]^T`` then ``@ B[:, :r]^T`` with the
run's own ``r``; no padding of rows or ranks beyond rounding ``r`` up to the kernel's
16-byte alignment (those columns are the slot's zero padding, so the result is exact).

On CUDA with bf16 on sm90/sm100 the matmuls are ``torch._grouped_mm``'s fused CUTLASS
kernel. Elsewhere torch's ``_grouped_mm`` falls back to a loop of matmuls that copies
``offs`` to the host (a device sync per call), so ``auto`` keeps the bmm path there; the
``always`` mode runs the same algorithm through ``reference_grouped_mm`` (that loop,
written out), which is what lets the CPU tests check it against the bmm path.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor

from loraplex_engine.spec.errors import AdapterError

if TYPE_CHECKING:
    from loraplex_engine.lora.routing import Routing

MODES = ("auto", "always", "never")
# The engine's ``--lora-kernel`` names (api_types.LORA_KERNELS) -> a layer's mode.
KERNEL_MODES = {"auto": "auto", "bmm": "never", "grouped": "always"}
Path = Literal["bmm", "grouped", "reference"]
# torch._grouped_mm needs every stride but the unit one to be a multiple of 16 bytes:
# 8 bf16 elements (the only dtype its fused kernel takes).
ALIGN = 8
# Compute capability majors torch builds the bf16 grouped kernel for (Hopper, Blackwell).
FUSED_MAJORS = (9, 10)

GroupedMM = Callable[[Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class KernelEnv:
    """What the fused kernel's availability depends on, for one device."""

    device_type: str
    capability: tuple[int, int] | None  # CUDA compute capability; None off CUDA
    has_op: bool  # this torch has ``torch._grouped_mm``
    rocm: bool  # a ROCm build: no CUTLASS grouped kernel


@functools.cache
def kernel_env(device: torch.device) -> KernelEnv:
    """Query the device once (the capability is fixed for a process)."""
    capability = None
    if device.type == "cuda":
        capability = tuple(torch.cuda.get_device_capability(device))
    return KernelEnv(
        device.type,
        capability,  # type: ignore[arg-type]
        hasattr(torch, "_grouped_mm"),
        torch.version.hip is not None,
    )


def grouped_mm_blocker(env: KernelEnv, dtype: torch.dtype, shapes: Sequence[int]) -> str | None:
    """Why the fused grouped kernel cannot run here, or None when it can.

    ``shapes`` is ``(in_features, out_features, max_rank)`` of the layer; ranks are rounded
    up to ``ALIGN`` (never past ``max_rank``), so all three must be aligned.
    """
    if env.device_type != "cuda":
        return f"not on CUDA ({env.device_type})"
    if not env.has_op:
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if env.rocm:
        return "ROCm build: no fused grouped kernel"
    if dtype != torch.bfloat16:
        # fp16/fp32 reach torch's fallback: a per-group loop with a host sync per call,
        # slower than one bmm.
        return f"the fused kernel is bf16-only, activations are {dtype}"
    if env.capability is None or env.capability[0] not in FUSED_MAJORS:
        return f"the fused kernel needs sm90/sm100, device is {env.capability}"
    unaligned = [n for n in shapes if n % ALIGN]
    if unaligned:
        return f"dims {list(shapes)} not all multiples of {ALIGN} (16 bytes of bf16)"
    return None


def can_use_grouped_mm(env: KernelEnv, dtype: torch.dtype, shapes: Sequence[int]) -> bool:
    return grouped_mm_blocker(env, dtype, shapes) is None


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise AdapterError(f"grouped_mm must be one of {list(MODES)}, got {mode!r}")
    return mode


def choose_path(mode: str, blocker: str | None) -> Path:
    """``never``: bmm. ``auto``: the fused kernel when nothing blocks it, else bmm.
    ``always``: the grouped algorithm, fused when possible, else its reference loop."""
    check_mode(mode)
    if mode == "never":
        return "bmm"
    if blocker is None:
        return "grouped"
    return "reference" if mode == "always" else "bmm"


def kernel_rank(rank: int, max_rank: int) -> int:
    """``rank`` rounded up to the kernel's alignment, within the slot's ``max_rank``
    columns (the columns past a slot's rank are zero, so the product is unchanged)."""
    return min(-(-rank // ALIGN) * ALIGN, max_rank) if rank else 0


def rank_runs(ranks: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(rank, first, end)`` for each maximal run of consecutive groups of one nonzero rank.

    Groups of rank 0 (slots that do not target this layer) are in no run: their delta is
    zero. Fewer runs is fewer kernel launches; every run costs only its own rank.
    """
    runs: list[tuple[int, int, int]] = []
    for g, r in enumerate(ranks):
        if r and runs and runs[-1][0] == r and runs[-1][2] == g:
            runs[-1] = (r, runs[-1][1], g + 1)
        elif r:
            runs.append((r, g, g + 1))
    return runs


def reference_grouped_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """``torch._grouped_mm(a, b, offs=offs)`` for 2-D ``a`` and 3-D ``b``, as a loop:
    rows ``offs[i-1]:offs[i]`` of ``a`` times ``b[i]`` (reads ``offs`` on the host)."""
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    return torch.cat([a[s:e] @ b[i] for i, (s, e) in enumerate(zip(starts, ends, strict=True))])


def fused_grouped_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    return _ContiguousGrad.apply(torch._grouped_mm(a, b, offs=offs))  # type: ignore[no-any-return]


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient dense: the grouped kernel's backward
    rejects the stride-0 gradients that ``sum()`` and broadcasts hand back."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, t: Tensor) -> Tensor:  # type: ignore[override]
        return t.view_as(t)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> Tensor:  # type: ignore[override]
        return grad.contiguous()


def grouped_delta(
    xs: Tensor,
    lora_a: Tensor,
    lora_b: Tensor,
    scale: Tensor,
    plan: Routing,
    ranks: Sequence[int],
    mm: GroupedMM,
) -> Tensor:
    """The LoRA delta of ``xs`` (``plan.rows``, in order) as ``[n, *xs.shape[1:-1], out]``.

    ``ranks[g]`` is group ``g``'s slot's rank in this layer (0: no contribution).
    Computes in ``xs.dtype``; A and B are cast (the cast's backward reaches the masters).
    """
    tokens = xs[0].numel() // xs.shape[-1]  # tokens per row
    flat = xs.reshape(-1, xs.shape[-1])
    max_rank = lora_a.shape[1]
    out_f = lora_b.shape[1]
    row_scale = scale[plan.row_slots].to(xs.dtype)
    pieces: list[Tensor] = []
    done = 0  # rows emitted so far
    for r, first, end in rank_runs([kernel_rank(r, max_rank) for r in ranks]):
        lo, hi = plan.starts[first], plan.starts[end]
        if lo > done:  # groups no adapter here targets: zero delta
            pieces.append(flat.new_zeros((lo - done) * tokens, out_f))
        slots = plan.slots[first:end]
        offs = plan.token_offs(first, end, tokens)
        a = lora_a[slots, :r].to(xs.dtype)
        b = lora_b[slots, :, :r].to(xs.dtype)
        h = mm(flat[lo * tokens : hi * tokens], a.mT, offs)
        # Scale the rank-sized intermediate, as the bmm path does.
        h = (h.view(hi - lo, tokens, r) * row_scale[lo:hi].view(-1, 1, 1)).view(-1, r)
        pieces.append(mm(h, b.mT, offs))
        done = hi
    if done < plan.rows.numel():
        pieces.append(flat.new_zeros((plan.rows.numel() - done) * tokens, out_f))
    d = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return d.view(*xs.shape[:-1], out_f)


def delta_flops(
    plan: Routing, ranks: Sequence[int], tokens: int, shapes: Sequence[int]
) -> dict[str, int]:
    """Forward FLOPs (2 per multiply-add) of the LoRA delta on each path, for ``tokens``
    per row and the layer's ``shapes = (in_features, out_features, max_rank)``.

    bmm: every group padded to the largest group, every slot to the batch's largest rank.
    grouped: each run's rows at its own (aligned) rank, no row padding.
    """
    in_f, out_f, max_rank = shapes
    bmm = 2 * len(plan.counts) * plan.width * tokens * max(ranks) * (in_f + out_f)
    grouped = sum(
        2 * (plan.starts[end] - plan.starts[first]) * tokens * r * (in_f + out_f)
        for r, first, end in rank_runs([kernel_rank(r, max_rank) for r in ranks])
    )
    return {"grouped": grouped, "bmm": bmm}
