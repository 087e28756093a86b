"""``loraplex-engine plan``: the planner (memory/planner.py) on a config.json, JSON to stdout."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from loraplex_engine.settings.values import parse_bytes
from loraplex_engine.spec.api_types import DEFAULT_MICRO_BATCH_TOKENS, DEFAULT_ROLLOUT_KV_TOKENS


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan", help="peak memory per phase and training FLOPs of a workload, from a config.json"
    )
    p.add_argument("--config", required=True, help="a config.json (or a model directory)")
    p.add_argument("--device-memory", default="80GiB", help="device memory (default 80GiB)")
    p.add_argument("--name", help="model name in the output (default: its model_type)")
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument(
        "--targets",
        help="comma-separated module names (default: what the engine wraps: every linear, "
        "the head too when untied)",
    )
    p.add_argument("--prompts-per-tenant", type=int, default=4)
    p.add_argument("--completions-per-prompt", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--completion-tokens", type=int, default=1024)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--checkpointing", action="store_true", help="gradient checkpointing on")
    p.add_argument("--micro-batch-tokens", type=int, default=DEFAULT_MICRO_BATCH_TOKENS)
    p.add_argument(
        "--rollout-kv-tokens",
        type=int,
        default=DEFAULT_ROLLOUT_KV_TOKENS,
        help="KV-cache tokens of one rollout micro-batch (the engine's serve flag)",
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=1,
        help="ranks of one engine; the plan is one rank's, with its share of the rows",
    )
    p.add_argument(
        "--shard-base",
        action="store_true",
        help="shard the frozen base over the ranks with FSDP2 (LoRA slots replicated)",
    )
    p.add_argument(
        "--cut-layers",
        help="measure on the model cut to these two depths (e.g. 2,3) and extend linearly "
        "to its depth: seconds instead of minutes (default: every layer)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from loraplex_engine.memory.planner import Workload, load_config, plan

    try:
        config = load_config(args.config)
        workload = Workload(
            adapters=args.adapters,
            rank=args.rank,
            targets=tuple(args.targets.split(",")) if args.targets else None,
            prompts_per_tenant=args.prompts_per_tenant,
            completions_per_prompt=args.completions_per_prompt,
            prompt_tokens=args.prompt_tokens,
            completion_tokens=args.completion_tokens,
            dtype=args.dtype,
            checkpointing=args.checkpointing,
            micro_batch_tokens=args.micro_batch_tokens,
            rollout_kv_tokens=args.rollout_kv_tokens,
            world_size=args.world_size,
            shard_base=args.shard_base,
        )
        cut = _cut_layers(args.cut_layers)
        device = parse_bytes(args.device_memory)
        say = None if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
        result = plan(config, workload, device, name=args.name, progress=say, cut_layers=cut)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1))
    return 0


def _cut_layers(text: str | None) -> tuple[int, int] | None:
    """``--cut-layers 2,3``: two depths, the first smaller (ValueError naming the flag)."""
    if text is None:
        return None
    try:
        low, high = (int(n) for n in text.split(","))
    except ValueError:
        raise ValueError(f"--cut-layers: want two depths like 2,3, got {text!r}") from None
    if not 1 <= low < high:
        raise ValueError(f"--cut-layers: want two depths a < b, at least 1, got {text!r}")
    return low, high
