"""``loraplex-engine serve``'s flags, each also read from ``LORAPLEX_<FLAG>``.

The engine pod is configured mostly through the environment (the images and the operator
set ``LORAPLEX_PORT``, ``LORAPLEX_ROLLOUT_BACKEND``, ...), so a bad value there is
reported like a bad flag, naming the variable, and does not break other subcommands.
The token comes from ``--token-file`` or ``LORAPLEX_TOKEN``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from loraplex_engine.api_types import (
    DEFAULT_MAX_PROMPT_TOKENS,
    DEFAULT_MAX_STEP_TOKENS,
    DEFAULT_MEMORY_HEADROOM,
    DEFAULT_MICRO_BATCH_TOKENS,
    DEFAULT_REWARD_DEADLINE_S,
    DEFAULT_ROLLOUT_KV_TOKENS,
    DTYPE_NAMES,
    LORA_KERNELS,
)
from loraplex_engine.errors import UsageError
from loraplex_engine.memory.plan_cli import parse_bytes
from loraplex_engine.rollout.vllm.config import check_placement, check_vllm_option_names
from loraplex_engine.server.openai.api import DEFAULT_MAX_COMPLETION_TOKENS

log = logging.getLogger("loraplex_engine.server.serve")


def _env(name: str, default: Any = None) -> Any:
    return os.environ.get(f"LORAPLEX_{name}", default)


def _env_flag(name: str) -> bool:
    return str(_env(name, "")).strip().lower() in ("1", "true", "yes", "on")


class _EnvValue(str):
    """A flag's default taken from ``LORAPLEX_<NAME>``, remembering the variable.

    argparse runs a flag's ``type`` over a *string* default only when the flag is not
    given, and only while parsing that subcommand; so a bad value fails ``serve`` alone
    (not every subcommand at parser build time), as a usage error (exit 2) that can
    name the variable."""

    var: str

    def __new__(cls, value: str, var: str) -> _EnvValue:
        obj = super().__new__(cls, value)
        obj.var = var
        return obj


def _env_parsed(name: str, default: Any) -> Any:
    """``LORAPLEX_<NAME>`` for the flag's ``type`` to parse (naming it if bad), else the
    default as it is."""
    raw = _env(name)
    return default if raw is None else _EnvValue(raw, f"LORAPLEX_{name}")


def _invalid(what: str, value: str, hint: str = "") -> argparse.ArgumentTypeError:
    where = f" (from {value.var})" if isinstance(value, _EnvValue) else ""
    return argparse.ArgumentTypeError(f"invalid {what}: {str(value)!r}{where}{hint}")


def _int(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise _invalid("int value", value) from None


def _positive_int(value: str) -> int:
    number = _int(value)
    if number < 1:
        raise _invalid("value", value, "; must be at least 1")
    return number


def _seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:  # also refuses nan
        raise _invalid("seconds value", value)
    return seconds


def _positive_int_or_none(value: str) -> int | None:
    """A positive int; ``auto`` (or empty) for None: the memory plan derives it."""
    if str(value).strip().lower() in ("", "auto"):
        return None
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise _invalid("token count", value, "; a positive integer, or auto")
    return number


def _bytes_or_none(value: str) -> int | None:
    """A byte count (``80GiB``, ``141GB``); ``auto`` (or empty) for None."""
    if str(value).strip().lower() in ("", "auto"):
        return None
    try:
        number = parse_bytes(value)
    except ValueError:
        number = 0
    if number < 1:
        raise _invalid("byte count", value, "; e.g. 80GiB, 141GB, or auto")
    return number


def _fraction(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not 0.0 <= number < 1.0:
        raise _invalid("fraction", value, "; a number in [0, 1)")
    return number


DEVICES = "auto, cpu, cuda or cuda:N"


def _device(value: str) -> str:
    """``--device``: auto (or empty), cpu, cuda or cuda:N (distributed.device_for_rank
    resolves it per rank)."""
    text = str(value).strip().lower() or "auto"
    if text in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", text):
        return text
    raise _invalid("device", value, f"; choose {DEVICES}")


def add_device_argument(p: argparse.ArgumentParser, env: bool = False) -> None:
    """``--device`` of `serve` (``LORAPLEX_DEVICE`` too) and `run`: one parser, one
    resolution (``resolve_device``)."""
    p.add_argument(
        "--device",
        type=_device,
        default=_env_parsed("DEVICE", "auto") if env else "auto",
        metavar="DEVICE",
        help=f"torch device: {DEVICES} (default auto: cuda where torch sees a GPU, else "
        "cpu). With --world-size N, cuda puts rank r on cuda:<LOCAL_RANK> and the ranks "
        "talk over NCCL; on cpu over gloo",
    )


def resolve_device(requested: str, world_size: int) -> str:
    """This process's device for a parsed ``--device`` (its rank from ``LOCAL_RANK``)."""
    import torch

    from loraplex_engine.parallel import distributed

    count = torch.cuda.device_count() if requested != "cpu" else 0
    return distributed.device_for_rank(requested, world_size, distributed.local_rank(), count)


def _dtype(value: str) -> str:
    if value not in DTYPE_NAMES:
        raise _invalid("dtype", value, f"; choose one of {', '.join(DTYPE_NAMES)}")
    return str(value)


def _lora_kernel(value: str) -> str:
    if value not in LORA_KERNELS:
        raise _invalid("LoRA kernel", value, f"; choose one of {', '.join(LORA_KERNELS)}")
    return str(value)


def _bool(value: str) -> bool:
    text = str(value).strip().lower()
    if text not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        raise _invalid("boolean", value, "; use true or false")
    return text in ("1", "true", "yes", "on")


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _log_level(value: str) -> str:
    if value.lower() not in LOG_LEVELS:
        raise _invalid("log level", value, f"; choose one of {', '.join(LOG_LEVELS)}")
    return value.lower()


# Variables that are not simply LORAPLEX_<FLAG>, or that belong to no flag.
_ENV_NOTES = {
    "vllm_option": ("LORAPLEX_VLLM_OPTIONS", "a JSON object of --vllm-option settings"),
    "data_root": ("LORAPLEX_DATA_ROOT", "--data-root directories, separated by ':'"),
    "allow_reward_host": ("LORAPLEX_ALLOW_REWARD_HOST", "--allow-reward-host hosts, by ','"),
}
_ENV_EXTRA = (
    ("LORAPLEX_TOKEN", "the bearer token itself (instead of --token-file)"),
    ("LORAPLEX_VLLM_PYTHON", "python of the environment that holds vLLM (vllm backend)"),
)


def _env_epilog(p: argparse.ArgumentParser) -> str:
    """Every variable `serve` reads, derived from its flags so the list cannot drift."""
    rows = []
    for action in p._actions:
        longs = [s for s in action.option_strings if s.startswith("--")]
        if not longs or action.dest == "help":
            continue
        flag = longs[0]
        var, what = _ENV_NOTES.get(action.dest, (f"LORAPLEX_{action.dest.upper()}", flag))
        rows.append((var, what))
    rows.extend(_ENV_EXTRA)
    width = max(len(var) for var, _ in rows)
    lines = [f"  {var:<{width}}  {what}" for var, what in rows]
    return "environment (a flag given on the command line wins):\n" + "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=_env("MODEL"), help="base model directory (local)")
    p.add_argument("--host", default=_env("HOST", "0.0.0.0"), help="listen address")
    p.add_argument(
        "--port", type=_int, default=_env_parsed("PORT", 8000), help="listen port (0: any free)"
    )
    p.add_argument("--token-file", default=_env("TOKEN_FILE"), help="file holding the bearer token")
    p.add_argument(
        "--insecure-no-auth",
        action="store_true",
        default=_env_flag("INSECURE_NO_AUTH"),
        help="serve /v1 without a token (local experiments only)",
    )
    p.add_argument(
        "--checkpoint-root",
        default=_env("CHECKPOINT_ROOT", "/ckpt"),
        help="checkpoints go to <root>/<namespace>/<name>/<run id>/step-<n>/",
    )
    p.add_argument(
        "--max-adapters", type=_int, default=_env_parsed("MAX_ADAPTERS", 8), help="adapter slots"
    )
    p.add_argument(
        "--max-rank", type=_int, default=_env_parsed("MAX_RANK", 64), help="largest LoRA rank"
    )
    p.add_argument(
        "--max-step-tokens",
        type=_int,
        default=_env_parsed("MAX_STEP_TOKENS", DEFAULT_MAX_STEP_TOKENS),
        help="largest groupSize x promptsPerStep x (--max-prompt-tokens + maxNewTokens) one "
        "experiment's step may cost, checked at PUT (one tenant must not stall the others)",
    )
    p.add_argument(
        "--max-prompt-tokens",
        type=_int,
        default=_env_parsed("MAX_PROMPT_TOKENS", DEFAULT_MAX_PROMPT_TOKENS),
        help="longest prompt a rollout row may have; a longer one fails its experiment",
    )
    add_batch_arguments(p, env=True)
    p.add_argument(
        "--reward-deadline",
        type=_seconds,
        default=_env_parsed("REWARD_DEADLINE", DEFAULT_REWARD_DEADLINE_S),
        metavar="SECONDS",
        help="how long a tick waits for an experiment's reward; a later one trains that "
        "experiment in the tick after it arrives, without holding the others",
    )
    p.add_argument(
        "--rollout-backend",
        choices=["torch", "vllm"],
        default=_env("ROLLOUT_BACKEND", "torch"),
        help="generation backend",
    )
    add_device_argument(p, env=True)
    p.add_argument(
        "--dtype",
        type=_dtype,
        default=_env_parsed("DTYPE", None),
        help=f"the frozen base's dtype, one of {', '.join(DTYPE_NAMES)} (default: bfloat16 "
        "on cuda, float32 on cpu); adapters and optimiser state are float32 whatever it is",
    )
    p.add_argument(
        "--gradient-checkpointing",
        action=argparse.BooleanOptionalAction,
        type=_bool,
        default=_env_parsed("GRADIENT_CHECKPOINTING", None),
        help="recompute each decoder layer in the backward instead of keeping its "
        "activations (default: on for cuda, off for cpu)",
    )
    add_memory_arguments(p)
    p.add_argument(
        "--lora-kernel",
        type=_lora_kernel,
        default=_env_parsed("LORA_KERNEL", "auto"),
        help="the multi-LoRA delta: auto (grouped matmuls at each adapter's own rank where "
        "torch's fused kernel runs: CUDA, bf16, sm90/sm100; else bmm), bmm, or grouped "
        "(also where only its slower reference loop runs)",
    )
    p.add_argument(
        "--vllm-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="option for the vllm rollout backend (value parsed as JSON if it parses), "
        "e.g. max_model_len=4096 gpu_memory_utilization=0.5; repeatable. "
        "LORAPLEX_VLLM_OPTIONS may hold a JSON object of them",
    )
    p.add_argument(
        "--threads",
        type=_int,
        default=_env_parsed("THREADS", 0),
        help="torch CPU threads (0: torch's default)",
    )
    p.add_argument(
        "--max-completion-tokens",
        type=_int,
        default=_env_parsed("MAX_COMPLETION_TOKENS", DEFAULT_MAX_COMPLETION_TOKENS),
        help="largest max_tokens accepted by /v1/completions",
    )
    p.add_argument(
        "--no-checkpoint-on-shutdown",
        action="store_true",
        default=_env_flag("NO_CHECKPOINT_ON_SHUTDOWN"),
        help="skip the final checkpoint of running experiments on SIGTERM",
    )
    p.add_argument(
        "--log-level",
        type=_log_level,
        default=_env_parsed("LOG_LEVEL", "info"),
        help=f"one of {', '.join(LOG_LEVELS)}",
    )
    add_trust_arguments(p)
    add_rank_arguments(p)
    add_shard_base_argument(p, env=True)
    p.epilog = _env_epilog(p)
    p.formatter_class = argparse.RawDescriptionHelpFormatter  # keep the epilog's rows


# --- ranks: one engine over N processes (parallel/serve_ranks.py, parallel/data_parallel.py)


def add_rank_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--world-size",
        type=_positive_int,
        default=_env_parsed("WORLD_SIZE", 1),
        metavar="N",
        help="data-parallel ranks of this engine (one per GPU; gloo on the CPU). This "
        "process is rank 0 (the API, the tick) and starts ranks 1..N-1 itself, unless "
        "RANK is set (torchrun): then each process joins by env:// (default: 1)",
    )
    p.add_argument(
        "--dist-timeout",
        type=_seconds,
        default=_env_parsed("DIST_TIMEOUT", 600.0),
        metavar="SECONDS",
        help="how long a rank waits for the others in a collective (a worker waits a whole "
        "tick for the next train phase) before the engine fails (default: 600)",
    )


# --- memory: the budgets the engine's memory plan derives (memory/capacity_plan.py) ----------


def add_memory_arguments(p: argparse.ArgumentParser) -> None:
    """What `serve` plans its budgets against (the budgets themselves: add_batch_arguments)."""
    p.add_argument(
        "--device-memory",
        type=_bytes_or_none,
        default=_env_parsed("DEVICE_MEMORY", None),
        help="memory the engine plans against, e.g. 80GiB (default auto: on cuda what is "
        "free plus what the engine holds; on cpu none, so nothing is derived)",
    )
    p.add_argument(
        "--memory-headroom",
        type=_fraction,
        default=_env_parsed("MEMORY_HEADROOM", DEFAULT_MEMORY_HEADROOM),
        help="share of --device-memory the plan leaves unused (fragmentation, workspaces)",
    )


def add_batch_arguments(p: argparse.ArgumentParser, env: bool = False) -> None:
    """How much one training micro-batch and one rollout micro-batch may hold (shared by
    `serve`, where LORAPLEX_<FLAG> sets them too, and `run`). Unset (or ``auto``): the
    engine's memory plan derives them where it knows the device's memory, else the
    defaults."""

    def default(name: str) -> Any:
        return _env_parsed(name, None) if env else None

    p.add_argument(
        "--micro-batch-tokens",
        type=_positive_int_or_none,
        default=default("MICRO_BATCH_TOKENS"),
        metavar="N",
        help="padded tokens of one training micro-batch (gradient accumulation over "
        f"them; default auto, else {DEFAULT_MICRO_BATCH_TOKENS})",
    )
    p.add_argument(
        "--rollout-kv-tokens",
        type=_positive_int_or_none,
        default=default("ROLLOUT_KV_TOKENS"),
        metavar="N",
        help="KV-cache tokens of one torch rollout micro-batch (rows x (longest prompt + "
        "largest maxNewTokens)); the rollout decodes micro-batches one after another, so "
        "its cache stays under N tokens whatever the tenants "
        f"(default auto, else {DEFAULT_ROLLOUT_KV_TOKENS})",
    )


def batch_kwargs(args: argparse.Namespace) -> dict[str, int]:
    """The Engine keywords of the flags given (unset: the engine's defaults)."""
    out = {}
    for name in ("micro_batch_tokens", "rollout_kv_tokens"):
        if getattr(args, name, None) is not None:
            out[name] = int(getattr(args, name))
    return out


# --- tenancy and trust: what tenants' datasets and reward URLs may reach (tenancy/trust.py) ---


def add_trust_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--data-root",
        action="append",
        default=None,
        metavar="DIR",
        help="directory of tenants' JSONL datasets, one subdirectory per namespace: "
        "task.dataset x.jsonl of namespace team-a is <DIR>/team-a/x.jsonl; repeatable. "
        "None given: jsonl datasets are refused",
    )
    p.add_argument(
        "--allow-reward-host",
        action="append",
        default=None,
        metavar="HOST:PORT",
        help="rewardUrl host and port allowed even on a loopback, link-local or this pod's "
        "own address (exact name or address; a bare HOST: every port); repeatable",
    )


def data_roots(args: argparse.Namespace) -> tuple[Path, ...]:
    """--data-root (or LORAPLEX_DATA_ROOT, ':'-separated); each must be absolute."""
    raw = args.data_root
    if raw is None:
        raw = [d for d in str(_env("DATA_ROOT", "")).split(":") if d.strip()]
    roots = tuple(Path(d) for d in raw)
    for root in roots:
        if not root.is_absolute():
            raise UsageError(f"--data-root must be an absolute path, not {str(root)!r}")
    return roots


def reward_hosts(args: argparse.Namespace) -> list[str]:
    """--allow-reward-host (or LORAPLEX_ALLOW_REWARD_HOST, ','-separated)."""
    if args.allow_reward_host is not None:
        return list(args.allow_reward_host)
    return [h.strip() for h in str(_env("ALLOW_REWARD_HOST", "")).split(",") if h.strip()]


def read_token(args: argparse.Namespace) -> str | None:
    """The bearer token, or None with --insecure-no-auth. Raises UsageError otherwise."""
    token = None
    if args.token_file:
        try:
            with open(args.token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as e:
            raise UsageError(f"cannot read --token-file {args.token_file}: {e}") from e
        if not token:
            raise UsageError(f"--token-file {args.token_file} is empty")
    elif os.environ.get("LORAPLEX_TOKEN", "").strip():
        token = os.environ["LORAPLEX_TOKEN"].strip()
    if token is None and not args.insecure_no_auth:
        raise UsageError(
            "no token: give --token-file FILE or LORAPLEX_TOKEN "
            "(or --insecure-no-auth to serve /v1 without auth)"
        )
    if token is not None and args.insecure_no_auth:
        log.warning("--insecure-no-auth given together with a token: the token is enforced")
    return token


def vllm_options(args: argparse.Namespace) -> dict[str, Any]:
    """LORAPLEX_VLLM_OPTIONS (a JSON object), then each --vllm-option KEY=VALUE over it."""
    options: dict[str, Any] = {}
    raw = _env("VLLM_OPTIONS")
    if raw:
        try:
            options = dict(json.loads(raw))
        except (ValueError, TypeError) as e:
            raise UsageError(f"LORAPLEX_VLLM_OPTIONS must be a JSON object: {e}") from e
    for item in args.vllm_option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--vllm-option takes KEY=VALUE, not {item!r}")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    try:
        check_vllm_option_names(options)
        device = getattr(args, "device", None)
        if device and device != "auto":  # what can be checked before the model loads
            check_placement(options, device, os.environ.get("CUDA_VISIBLE_DEVICES"))
    except ValueError as e:
        raise UsageError(str(e)) from e
    return options


def add_shard_base_argument(p: argparse.ArgumentParser, env: bool = False) -> None:
    """``--shard-base`` (`run`; `serve`, where ``LORAPLEX_SHARD_BASE`` sets it too): the
    frozen base sharded over the data-parallel ranks with FSDP2 (parallel/sharding.py)."""
    p.add_argument(
        "--shard-base",
        action="store_true",
        default=_env_flag("SHARD_BASE") if env else False,
        help="shard the frozen base model over the --world-size ranks (FSDP2; the LoRA "
        "adapters stay replicated) for a base that does not fit one device",
    )
