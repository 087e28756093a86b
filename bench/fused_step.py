"""Time one fused multi-adapter train step against the same adapters stepped one by one.

    .venv/bin/python bench/fused_step.py [--preset tiny|bench] [--rows 4] [--seq 48]

Fused: one forward/backward over every tenant's rows (base matmul once), one optimiser step.
Sequential: per adapter, forward/backward over its own rows, then its optimiser step (what a
time-sliced engine does, without the swap copies). Also times the LoRA-delta strategies of
one layer (the engine's grouped bmm vs a per-row gather bmm vs a per-segment loop).
Medians of --repeat runs after --warmup; torch threads fixed by --threads.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from loraplex_engine.dev.tiny_model import build_model
from loraplex_engine.lora.layers import LoRAConfig, MultiLoRALinear
from loraplex_engine.lora.model import MultiLoRAModel
from loraplex_engine.lora.routing import Routing
from loraplex_engine.train.optim import AdamWSettings, PerAdapterAdamW
from transformers import AutoModelForCausalLM

DEVICE = "cpu"
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def median_times(fns: list[Callable[[], None]], warmup: int, repeat: int) -> list[float]:
    """Median seconds of each fn; runs are interleaved (ABAB...) so load noise hits all alike."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, ts in zip(fns, times, strict=True):
            _sync()
            t0 = time.perf_counter()
            fn()
            _sync()
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make_engine(model_dir: Path, n: int, rank: int) -> tuple[MultiLoRAModel, PerAdapterAdamW]:
    base = AutoModelForCausalLM.from_pretrained(model_dir).to(DEVICE)
    model = MultiLoRAModel(base, 8, rank)
    opt = PerAdapterAdamW(model)
    for i in range(n):
        model.add_adapter(f"e{i}", LoRAConfig(rank, 2.0 * rank, target_modules=ALL), seed=i)
        opt.add_adapter(f"e{i}", AdamWSettings(lr=1e-3))
    for layer in model.lora_layers.values():  # nonzero B, as after some training
        torch.nn.init.normal_(layer.lora_B, std=0.01)
    return model, opt


def loss_of(model: MultiLoRAModel, ids: torch.Tensor, slots: torch.Tensor, n: int) -> torch.Tensor:
    logits = model(ids, slot_ids=slots).logits
    per_row = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    return per_row.mean(1).view(n, -1).mean(1).sum()  # sum of each adapter's mean loss


def time_steps(
    args: argparse.Namespace, model_dir: Path, vocab: int, n: int
) -> tuple[float, float]:
    """Median seconds of (fused step, sequential steps) for ``n`` adapters."""
    model, opt = make_engine(model_dir, n, args.rank)
    ids = torch.randint(4, vocab, (n * args.rows, args.seq), device=DEVICE)
    slots = torch.arange(1, n + 1, device=DEVICE).repeat_interleave(args.rows)

    def fused() -> None:
        loss_of(model, ids, slots, n).backward()
        opt.step(range(1, n + 1))
        opt.zero_grad()

    def sequential() -> None:
        for s in range(1, n + 1):
            rows = slots == s
            loss_of(model, ids[rows], slots[rows], 1).backward()
            opt.step([s])
            opt.zero_grad()

    tf, ts = median_times([fused, sequential], args.warmup, args.repeat)
    return tf, ts


def bench_steps(args: argparse.Namespace, model_dir: Path, vocab: int) -> None:
    print(f"\ntrain step, {args.rows} rows x {args.seq} tokens per adapter, rank {args.rank}")
    print(f"{'adapters':>8} {'fused s':>9} {'sequential s':>13} {'seq/fused':>10}")
    for n in (1, 4, 8):
        tf, ts = time_steps(args, model_dir, vocab, n)
        print(f"{n:>8} {tf:>9.4f} {ts:>13.4f} {ts / tf:>10.2f}")


def delta_gather(layer: MultiLoRALinear, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Alternative: copy each row's A/B (rows x rank x in per layer)."""
    h = torch.bmm(x, layer.lora_A[ids].mT)
    return torch.bmm(h, layer.lora_B[ids].mT) * layer.scale[ids].view(-1, 1, 1)


def delta_loop(layer: MultiLoRALinear, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Alternative: a Python loop over slots, scattering each segment back."""
    out = x.new_zeros(*x.shape[:-1], layer.out_features)
    for s in ids.unique().tolist():
        rows = (ids == s).nonzero().flatten()
        d = (x[rows] @ layer.lora_A[s].T) @ layer.lora_B[s].T * layer.scale[s]
        out = out.index_add(0, rows, d)
    return out


def bench_layer(args: argparse.Namespace, hidden: int) -> None:
    print(f"\none layer's LoRA delta, forward+backward, {hidden}x{hidden}, 8 adapters, rank 16")
    print(f"{'shape':>22} {'grouped bmm':>12} {'gather bmm':>11} {'segment loop':>13}")
    layer = MultiLoRALinear(torch.nn.Linear(hidden, hidden, bias=False, device=DEVICE), 9, 16)
    for s in range(1, 9):
        layer.set_slot(s, 16, 2.0, 0.0)
    torch.nn.init.normal_(layer.lora_B)
    for rows, seq, label in ((8 * args.rows, args.seq, "train"), (64, 1, "decode")):
        x = torch.randn(rows, seq, hidden, device=DEVICE)
        ids = torch.arange(1, 9, device=DEVICE).repeat_interleave(rows // 8)
        plan = Routing.build(ids)
        fns = {
            "grouped": lambda x=x, plan=plan: layer._delta(x, plan),
            "gather": lambda x=x, ids=ids: delta_gather(layer, x, ids),
            "loop": lambda x=x, ids=ids: delta_loop(layer, x, ids),
        }
        runs = [lambda f=f: f().sum().backward() for f in fns.values()]
        times = dict(zip(fns, median_times(runs, 2, args.repeat), strict=True))
        shape = f"{label} {rows}x{seq}"
        print(
            f"{shape:>22} {times['grouped'] * 1e3:>10.2f}ms {times['gather'] * 1e3:>9.2f}ms"
            f" {times['loop'] * 1e3:>11.2f}ms"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny", choices=["tiny", "bench"])
    p.add_argument("--rows", type=int, default=4, help="sequences per adapter")
    p.add_argument("--seq", type=int, default=48)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    args = p.parse_args()
    global DEVICE
    DEVICE = args.device
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model_dir = Path(".cache/models") / f"{args.preset}-llama"
    if not (model_dir / "config.json").exists():
        build_model(model_dir, preset=args.preset)
    config = AutoModelForCausalLM.from_pretrained(model_dir).config
    print(f"model {model_dir} ({args.preset}), {DEVICE}, torch threads {args.threads}")
    bench_steps(args, model_dir, min(config.vocab_size, 200))
    bench_layer(args, config.hidden_size)


if __name__ == "__main__":
    main()
