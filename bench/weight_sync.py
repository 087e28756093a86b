#!/usr/bin/env python3
"""Adapter weight sync to the vLLM worker, in memory vs as files, per tick.

    PYTHONPATH=trainer-image LORAPLEX_VLLM_PYTHON=.venv-vllm/bin/python \\
        .venv/bin/python bench/weight_sync.py [--rank 64] [--adapters 4] [--ticks 20] [--model DIR]

The engine's own backend (``VLLMRolloutBackend.sync_adapters``, what each tick runs)
against a real vLLM worker on the ``bench`` preset (hidden 384, 8 layers; built at
``--model``, default .cache/models/bench, if missing), in bf16, with ``--adapters``
adapters of rank ``--rank`` on every linear: each tick sends every adapter's new weights
(two weight sets alternate, so every tick changes them). One worker per transport
(``weight_sync="auto"`` takes the tensors path, ``"files"`` writes one PEFT directory per
adapter), the same weights; each tick syncs both, in alternating order.
Prints, per transport, the sync's seconds per tick (median, mean, min, max) and bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
from loraplex_engine.dev.tiny_model import build_model
from loraplex_engine.rollout.vllm.engine_backend import VLLMRolloutBackend

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / ".cache" / "models" / "bench"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def shapes(config: dict) -> dict[str, tuple[int, int]]:
    """Each target module's (in, out) features in a Llama layer of ``config``."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    kv = config["num_key_value_heads"] * config.get(
        "head_dim", hidden // config["num_attention_heads"]
    )
    return {
        "q_proj": (hidden, hidden),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (hidden, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def random_adapter(config: dict, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """fp32 weights under PEFT's key names, as the engine holds them."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (fan_in, fan_out) in shapes(config).items():
            part = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            out[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.01
            out[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01
    return out


def backend(mode: str, config: dict, args: argparse.Namespace, tick: list[int]):
    """A backend whose worker syncs with ``weight_sync=mode``, its adapters loaded."""
    peft = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": args.rank,
        "lora_alpha": 2 * args.rank,
        "target_modules": list(TARGETS),
        "bias": "none",
    }
    names = [f"a{i}" for i in range(args.adapters)]
    sets = [{n: random_adapter(config, args.rank, 10 * s + i) for i, n in enumerate(names)}
            for s in range(2)]  # fmt: skip

    def export(exp_id: str, dtype: torch.dtype):  # as checkpoint.peft_tensors: cast, CPU
        weights = sets[tick[0] % 2][exp_id]
        return dict(peft), {k: v.to(dtype).contiguous() for k, v in weights.items()}

    options = {
        "python": os.environ.get("LORAPLEX_VLLM_PYTHON"),
        "dtype": "bfloat16",
        "max_adapters": args.adapters,
        "max_rank": args.rank,
        "max_model_len": 128,
        "weight_sync": mode,
    }
    b = VLLMRolloutBackend(args.model, export, options)
    for name in names:
        b.add_adapter(name)
    return b, names


def summarise(mode: str, syncs: list) -> dict:
    seconds = [s.seconds for s in syncs]
    return {
        "weight_sync": mode,
        "transport": sorted({s.transport for s in syncs}),
        "adapters_per_tick": syncs[0].adapters,
        "mb_per_tick": syncs[0].bytes / 1e6,
        "ms_per_tick_median": 1000 * statistics.median(seconds),
        "ms_per_tick_mean": 1000 * statistics.mean(seconds),
        "ms_per_tick_min": 1000 * min(seconds),
        "ms_per_tick_max": 1000 * max(seconds),
        "ticks": len(seconds),
    }


def measure(config: dict, args: argparse.Namespace) -> list[dict]:
    """Both transports, each tick one after the other (the load of a shared box drifts)."""
    tick = [0]
    modes = ("auto", "files")
    backends = {}
    try:
        for mode in modes:
            backends[mode] = backend(mode, config, args, tick)
        syncs: dict[str, list] = {mode: [] for mode in modes}
        for t in range(args.ticks):
            tick[0] = t + 1
            for mode in modes if t % 2 else reversed(modes):
                b, names = backends[mode]
                result = b.sync_adapters(names)
                assert not result.refused and result.sync is not None, result
                syncs[mode].append(result.sync)
    finally:
        for b, _ in backends.values():
            b.close()
    return [summarise(mode, syncs[mode]) for mode in modes]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--ticks", type=int, default=20)
    parser.add_argument("--model", type=Path, default=MODEL)
    args = parser.parse_args()
    if not (args.model / "config.json").exists():
        build_model(args.model, preset="bench")
    config = json.loads((args.model / "config.json").read_text())
    print(json.dumps(measure(config, args), indent=2))


if __name__ == "__main__":
    main()
