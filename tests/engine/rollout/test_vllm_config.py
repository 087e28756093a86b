"""The vLLM worker's settings derived from the engine's limits (rollout/vllm_config.py):
pure arithmetic, no vLLM process."""

from __future__ import annotations

import inspect

import pytest
from loraplex_engine.rollout.vllm.backend import VLLMRollout
from loraplex_engine.rollout.vllm.config import (
    KV_BLOCK_MARGIN_TOKENS,
    MAX_NUM_SEQS_CAP,
    VLLM_OPTION_NAMES,
    default_tensor_parallel,
    kv_bytes_per_token,
    vllm_engine_args,
)
from loraplex_engine.rollout.vllm.worker_env import CPU_KV_CACHE_BYTES
from transformers import LlamaConfig

MEMORY = (60 << 30, 80 << 30)  # (free, total) bytes of a GPU after the trainer loaded


def _args(**overrides):
    kwargs = dict(
        device_type="cpu",
        dtype="float32",
        max_adapters=4,
        max_rank=16,
        context_tokens=2048,
        max_prompt_tokens=256,
        max_new_tokens=512,
        max_step_tokens=16_384,
    )
    kwargs.update(overrides)
    return vllm_engine_args(**kwargs)


def test_cpu_defaults_are_eager_and_sized_from_the_limits() -> None:
    args = _args()
    assert args["enforce_eager"] is True and args["disable_torch_compile"] is True
    assert args["dtype"] == "float32"
    assert args["max_adapters"] == 4
    assert args["max_model_len"] == 256 + 512  # the longest admitted row, inside 2048
    # 16384 tokens per step / (256 + 1) per row = 63 rows per experiment, 4 experiments
    assert args["max_num_seqs"] == 4 * 63
    assert "kv_cache_bytes" not in args  # no KV size per token: the worker's default


def test_cuda_defaults_use_cuda_graphs() -> None:
    args = _args(
        device_type="cuda", dtype="bfloat16", kv_bytes_per_token=4096, device_memory=MEMORY
    )
    assert args["enforce_eager"] is False and args["disable_torch_compile"] is False
    assert args["dtype"] == "bfloat16"
    assert "kv_cache_bytes" not in args  # gpu_memory_utilization sizes it on CUDA


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_dtype_passes_through(dtype: str) -> None:
    assert _args(dtype=dtype)["dtype"] == dtype


@pytest.mark.parametrize(
    ("max_rank", "vllm_rank"), [(1, 1), (2, 8), (8, 8), (9, 16), (64, 64), (65, 128), (300, 320)]
)
def test_rank_rounds_up_to_a_rank_vllm_accepts(max_rank: int, vllm_rank: int) -> None:
    assert _args(max_rank=max_rank)["max_rank"] == vllm_rank


def test_rank_beyond_vllm_is_refused() -> None:
    with pytest.raises(ValueError, match="max_rank 1024"):
        _args(max_rank=1024)


def test_model_context_bounds_the_model_length() -> None:
    assert _args(context_tokens=512)["max_model_len"] == 512
    assert _args(context_tokens=None)["max_model_len"] == 256 + 512


def test_rows_are_capped_and_at_least_one() -> None:
    assert _args(max_step_tokens=1 << 30)["max_num_seqs"] == MAX_NUM_SEQS_CAP
    assert _args(max_step_tokens=100, max_adapters=1)["max_num_seqs"] == 1


def test_cpu_kv_cache_holds_one_longest_row() -> None:
    small = _args(kv_bytes_per_token=64)
    assert small["kv_cache_bytes"] == CPU_KV_CACHE_BYTES  # the default already fits
    big = _args(kv_bytes_per_token=1 << 20)
    assert big["kv_cache_bytes"] == (1 << 20) * (256 + 512 + KV_BLOCK_MARGIN_TOKENS)


def test_user_option_wins_without_a_second_keyword() -> None:
    user = {"dtype": "float32", "max_model_len": 128, "enforce_eager": True, "threads": 2}
    args = _args(device_type="cuda", dtype="bfloat16", user_options=user, device_memory=MEMORY)
    assert {k: args[k] for k in user} == user
    assert args["max_adapters"] == 4  # the rest stays derived
    keywords = set(inspect.signature(VLLMRollout).parameters)
    assert set(args) <= keywords & VLLM_OPTION_NAMES  # one dict of VLLMRollout keywords


def test_unknown_option_is_named() -> None:
    with pytest.raises(ValueError, match="unknown --vllm-option max_lora"):
        _args(user_options={"max_lora": 2})


def test_option_names_are_the_rollouts_keywords() -> None:
    assert "model_dir" not in VLLM_OPTION_NAMES
    assert {"dtype", "max_model_len", "python", "llm_kwargs"} <= VLLM_OPTION_NAMES


def test_kv_bytes_per_token_from_a_config() -> None:
    config = LlamaConfig(
        hidden_size=64, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=3
    )
    assert kv_bytes_per_token(config, 2) == 2 * 3 * 1 * 32 * 2
    assert kv_bytes_per_token(object(), 4) is None


def test_serve_refuses_an_unknown_option_before_loading(monkeypatch) -> None:
    from loraplex_engine.cli import build_parser
    from loraplex_engine.rollout.preflight import check_rollout
    from loraplex_engine.server.flags import serve_settings
    from loraplex_engine.settings.commands import ServeSettings
    from loraplex_engine.spec.errors import UsageError

    def settings(*options: str) -> ServeSettings:
        flags = [f"--vllm-option={o}" for o in options]
        return serve_settings(
            build_parser().parse_args(["serve", "--rollout-backend", "vllm", *flags])
        )

    monkeypatch.delenv("LORAPLEX_VLLM_OPTIONS", raising=False)
    monkeypatch.setenv("LORAPLEX_VLLM_PYTHON", "/opt/vllm/bin/python")
    ok = settings("dtype=bfloat16", "max_num_seqs=8")
    check_rollout(ok, ok.device)
    assert ok.vllm_options == {"dtype": "bfloat16", "max_num_seqs": 8}
    bad = settings("max_lora=2")
    with pytest.raises(UsageError, match="unknown --vllm-option max_lora"):
        check_rollout(bad, bad.device)


def test_a_vllm_rollout_needs_a_python_with_vllm(monkeypatch) -> None:
    """This environment has no vllm (it lives in .venv-vllm): without LORAPLEX_VLLM_PYTHON
    the check says where to point, before any model loads; the torch backend needs none."""
    import importlib.util

    from loraplex_engine.rollout.preflight import check_rollout
    from loraplex_engine.settings.engine import EngineSettings
    from loraplex_engine.spec.errors import UsageError

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("this python has vllm")
    monkeypatch.delenv("LORAPLEX_VLLM_PYTHON", raising=False)
    with pytest.raises(UsageError, match="this python has no vllm; set LORAPLEX_VLLM_PYTHON"):
        check_rollout(EngineSettings(rollout_backend="vllm"), "cpu")
    check_rollout(EngineSettings(rollout_backend="torch"), "cpu")


# --- tensor_parallel_size: one vLLM per pod under data parallelism (issue 17) -------------


@pytest.mark.parametrize(
    ("device_type", "sharded_over", "tp"),
    [("cuda", 4, 4), ("cuda", 1, 1), ("cpu", 4, 1), ("cpu", 1, 1)],
)
def test_tensor_parallel_spans_the_pod_only_for_a_sharded_base_on_cuda(
    device_type: str, sharded_over: int, tp: int
) -> None:
    memory = MEMORY if device_type == "cuda" else None
    args = _args(device_type=device_type, device_memory=memory, sharded_over=sharded_over)
    assert default_tensor_parallel(device_type, sharded_over) == tp
    assert args["tensor_parallel_size"] == tp


def test_a_users_tensor_parallel_wins_and_spans_the_pods_first_gpus() -> None:
    args = _args(
        device_type="cuda",
        trainer_device="cuda:0",
        device_memory=MEMORY,
        sharded_over=4,
        user_options={"tensor_parallel_size": 2},
        parent_visible="4,5,6,7",
    )
    assert args["tensor_parallel_size"] == 2
    assert args["env"] == {"CUDA_VISIBLE_DEVICES": "4,5"}  # rank 0's GPU and rank 1's
    sharded = _args(
        device_type="cuda", trainer_device="cuda:0", device_memory=MEMORY, sharded_over=4
    )
    assert sharded["env"] == {"CUDA_VISIBLE_DEVICES": "0,1,2,3"} and sharded["sleep_mode"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(user_options={"tensor_parallel_size": 2}), "needs CUDA"),
        (dict(sharded_over=0), "sharded_over must be at least 1"),
        (
            dict(
                device_type="cuda",
                trainer_device="cuda:0",
                user_options={"tensor_parallel_size": 2, "device": "cuda:1"},
            ),
            "takes no device",
        ),
        (
            dict(device_type="cuda", trainer_device="cuda:0", sharded_over=4, parent_visible="0,1"),
            "cuda:2 is not one of this pod's GPUs",
        ),
    ],
)
def test_tensor_parallel_it_cannot_place_is_refused(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _args(**overrides)
