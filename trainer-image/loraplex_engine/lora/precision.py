"""Which dtype the engine computes in, and the switches that go with it.

The frozen base is loaded in the engine's ``dtype`` (bf16 by default on CUDA, fp32 on
the CPU); the LoRA master weights, their gradients and the Adam moments stay fp32 (a
bf16 weight cannot take a small update: bf16 keeps ~3 significant digits); each LoRA
layer computes in its input's dtype (lora/layers.py casts A and B, not the activations); the
log-probs and the loss are fp32 (train/chunked_logprobs.py, algorithms). On CUDA, fp32
matmuls (the LoRA update's own maths, an fp32 base) may use TF32. And how much of the
device is free (the capacity plan's and the vLLM worker's measure).
"""

from __future__ import annotations

import torch

from loraplex_engine.spec.api_types import DTYPE_NAMES

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}

# Adapter masters and optimiser state: always fp32, whatever the base.
MASTER_DTYPE = torch.float32


def default_dtype_name(device: torch.device | str) -> str:
    """bf16 on CUDA (what GPUs train in), fp32 elsewhere (exact CPU tests and demos)."""
    return "bfloat16" if torch.device(device).type == "cuda" else "float32"


def resolve_dtype(name: str | None, device: torch.device | str) -> torch.dtype:
    """``name`` (one of ``DTYPES``; None: the device's default) as a torch dtype."""
    chosen = default_dtype_name(device) if name is None else name
    if chosen not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {chosen!r}")
    return DTYPES[chosen]


def dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, d in DTYPES.items() if d == dtype)


def enable_tf32(device: torch.device) -> None:
    """TF32 for fp32 matmuls and convolutions on CUDA (no effect on the CPU)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def cuda_free_and_total(device: torch.device) -> tuple[int, int] | None:
    """(free, total) bytes of a CUDA device now; None on any other device."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total)
