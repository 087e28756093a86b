"""The LoRA delta of one layer on the bmm path vs the grouped path (lora/grouped.py).

    .venv/bin/python bench/grouped_lora.py [--out bench/results/grouped-lora.json]

Three workloads of 8 tenants on one 512x512 layer (max rank 64), bf16 activations,
forward + backward of the delta alone (the base matmul is the same on both paths):

- ``mixed ranks``: ranks 8, 8, 16, 16, 32, 32, 64, 64, 4 rows of 16 tokens each: bmm pays
  rank 64 for every tenant, grouped each its own;
- ``uneven groups``: rank 32 everywhere, 1 to 10 rows per tenant: bmm pads every group to
  the largest;
- ``uniform``: rank 32, 4 rows each: nothing to save (grouped FLOPs == bmm FLOPs).

FLOPs are counted by ``torch.utils.flop_counter.FlopCounterMode`` on what actually ran
(the bmm path, and the grouped algorithm through its reference loop of matmuls, which is
what the CPU runs) and checked against ``grouped_lora.delta_flops``. Wall time is the
median of ``--repeats`` after a warm-up, on the CPU: there the grouped path is a Python
loop of matmuls, so its time says little about the fused CUDA kernel (bench/gpu_scale.py
times that on a GPU); the FLOPs are what a GPU saves.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from loraplex_engine.lora.grouped import delta_flops
from loraplex_engine.lora.layers import MultiLoRALinear
from loraplex_engine.lora.routing import Routing
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench/results/grouped-lora.json"
# name -> (rank of each tenant, rows of each tenant)
WORKLOADS = {
    "mixed ranks": ([8, 8, 16, 16, 32, 32, 64, 64], [4] * 8),
    "uneven groups": ([32] * 8, [1, 1, 2, 2, 4, 4, 8, 10]),
    "uniform": ([32] * 8, [4] * 8),
}


def mixed_layer(
    in_f: int, out_f: int, ranks: list[int], max_rank: int, device: torch.device
) -> MultiLoRALinear:
    """Tenant ``i`` in slot ``i + 1`` at ``ranks[i]``; base bf16, LoRA masters fp32."""
    torch.manual_seed(0)
    base = nn.Linear(in_f, out_f, bias=False, device=device, dtype=torch.bfloat16)
    layer = MultiLoRALinear(base, len(ranks) + 1, max_rank, dtype=torch.float32)
    for slot, rank in enumerate(ranks, 1):
        layer.set_slot(slot, rank, 2.0, 0.0)
    with torch.no_grad():
        layer.lora_B.normal_(std=1e-2)
        for slot, rank in enumerate(ranks, 1):  # keep padding past each rank zero
            layer.lora_B[slot, :, rank:] = 0
    return layer


def _step(layer: MultiLoRALinear, x: torch.Tensor, plan: Routing, mode: str) -> None:
    """Forward and backward of the delta alone (the base matmul is the same on both)."""
    layer.grouped_mm = mode
    layer.routed_delta(x, plan)[1].float().square().mean().backward()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_s(fns: dict[str, Any], device: torch.device, repeats: int) -> dict[str, float]:
    """Median seconds of each fn after one warm-up; interleaved so noise hits all alike."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(1 + repeats):
        for key, fn in fns.items():
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            if i:
                times[key].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def measure(
    ranks: list[int],
    rows: list[int],
    tokens: int,
    shapes: tuple[int, int, int],
    device: torch.device,
    repeats: int,
    modes: dict[str, str],
    count_flops: bool,
) -> dict[str, Any]:
    """One workload: the FLOPs each path needs, and each path's forward+backward time.

    ``modes`` maps a label to a layer mode (``never`` is bmm; ``always``/``auto`` grouped).
    """
    in_f, out_f, max_rank = shapes
    layer = mixed_layer(in_f, out_f, ranks, max_rank, device)
    slots = torch.arange(1, len(ranks) + 1, device=device).repeat_interleave(
        torch.tensor(rows, device=device)
    )
    # The layer's input needs its gradient too (the layers below it train).
    x = torch.randn(len(slots), tokens, in_f, device=device, dtype=torch.bfloat16)
    x.requires_grad_()
    plan = Routing.build(slots, dict(enumerate(ranks, 1)))
    assert plan is not None
    got: dict[str, Any] = {
        "ranks": ranks, "rows": rows, "tokens_per_row": tokens, "shapes": list(shapes),
        "paths": {k: _path(layer, m) for k, m in modes.items()},
        "formula_forward_flops": delta_flops(plan, ranks, tokens, shapes),
    }  # fmt: skip
    f = got["formula_forward_flops"]
    got["bmm_over_grouped_flops"] = f["bmm"] / f["grouped"]
    if count_flops:
        got["counted_flops"] = {}
        for label, mode in modes.items():
            layer.grouped_mm = mode
            with FlopCounterMode(display=False) as fwd:
                layer.routed_delta(x, plan)
            with FlopCounterMode(display=False) as both:
                _step(layer, x, plan, mode)
            got["counted_flops"][label] = {
                "forward": fwd.get_total_flops(),
                "forward_backward": both.get_total_flops(),
            }
    fns = {label: (lambda m=mode: _step(layer, x, plan, m)) for label, mode in modes.items()}
    got["wall_s"] = median_s(fns, device, repeats)
    return got


def _path(layer: MultiLoRALinear, mode: str) -> str:
    """The computation ``mode`` runs here: bmm, grouped (fused kernel) or reference."""
    layer.grouped_mm = mode
    return layer.path(torch.bfloat16)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--tokens", type=int, default=16, help="tokens per row")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    shapes = (args.hidden, args.hidden, 64)
    cpu = torch.device("cpu")
    modes = {"bmm": "never", "grouped": "always"}
    result: dict[str, Any] = {
        "command": "python bench/grouped_lora.py"
        + (f" {' '.join(argv)}" if argv else ""),
        "torch": torch.__version__, "device": "cpu", "threads": args.threads,
        "dtype": "bfloat16", "workloads": {},
    }  # fmt: skip
    for name, (ranks, rows) in WORKLOADS.items():
        got = measure(ranks, rows, args.tokens, shapes, cpu, args.repeats, modes, True)
        counted = {k: v["forward"] for k, v in got["counted_flops"].items()}
        assert counted == got["formula_forward_flops"], (name, counted)
        result["workloads"][name] = got
        wall = got["wall_s"]
        print(f"{name:>14}: FLOPs bmm/grouped {got['bmm_over_grouped_flops']:.2f}x"
              f" ({counted['bmm']:,} vs {counted['grouped']:,} forward);"
              f" CPU fwd+bwd bmm {wall['bmm'] * 1e3:.1f} ms, grouped (reference loop)"
              f" {wall['grouped'] * 1e3:.1f} ms", flush=True)  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
