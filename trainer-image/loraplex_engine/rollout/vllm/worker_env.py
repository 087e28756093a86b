"""The vLLM worker's environment and platform: what vLLM reads at import, which ranks and
head sizes it takes, and the memory it reports. Imported by the worker (run as a script in
vLLM's environment, as a sibling) and by the engine's vLLM config (as a package module):
the standard library only, vLLM imported inside functions.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

BASE_ADAPTER = "__base__"

# vLLM accepts these as max_lora_rank (vllm.config.lora.MaxLoRARanks); adapters may have any
# rank up to it.
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# vLLM's CPU default would reserve gpu_memory_utilization (0.92) of host RAM for KV.
CPU_KV_CACHE_BYTES = 64 << 20


def vllm_lora_rank(max_rank: int) -> int:
    """vLLM's smallest ``max_lora_rank`` that holds adapters of rank ``max_rank``."""
    rank = next((r for r in VLLM_MAX_LORA_RANKS if r >= max_rank), None)
    if rank is None:
        raise ValueError(f"max_rank {max_rank} > vLLM's largest max_lora_rank 512")
    return rank


def setup_env(cfg: dict[str, Any]) -> None:
    """Environment vLLM reads at import: must run before ``import vllm``."""
    threads = str(cfg.get("threads", 1))
    defaults = {
        # Engine core in this process: no extra process, no ZMQ, no spawn-guard issues.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        # Don't pin OpenMP threads to cores: the box is shared (CI: 2 cores, 5 jobs).
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        "VLLM_LOGGING_LEVEL": "WARNING",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    if cfg.get("disable_torch_compile", True):
        # vLLM torch.compiles a few sampler helpers even with enforce_eager (the logprobs
        # gather): ~5 s of inductor C++ compilation on the first call with logprobs, and
        # it needs a C++ compiler. Plain eager is exact and fast enough at rollout sizes.
        defaults["TORCHDYNAMO_DISABLE"] = "1"
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    for key, value in (cfg.get("env") or {}).items():
        os.environ[key] = str(value)


# vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend.get_supported_head_sizes() in
# vLLM 0.32 (a test pins the two together).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def check_cpu_head_dim(model_dir: str) -> None:
    """vLLM only fails at the first forward pass on an unsupported head size: fail now."""
    sizes = CPU_HEAD_SIZES  # checked before importing vLLM's engine (seconds)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if head_dim not in sizes:
        raise ValueError(
            f"vLLM's CPU attention has no kernel for head_dim={head_dim} "
            f"(supported: {', '.join(map(str, sizes))}); the tiny model presets have "
            "head_dim 32"
        )


def current_platform_type() -> str:
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


def cpu_head_sizes() -> list[int] | None:
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return list(CPUAttentionBackend.get_supported_head_sizes())
    except Exception:
        return None


def maxrss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
