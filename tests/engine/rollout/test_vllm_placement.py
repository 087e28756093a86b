"""Where vLLM runs next to the trainer (rollout/vllm_placement.py): pure rules, the
keywords they give the worker, and the tick stepping vLLM aside while training."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
from loraplex_engine.rollout.vllm.config import vllm_engine_args
from loraplex_engine.rollout.vllm.placement import (
    COLOCATED_FREE_SHARE,
    SEPARATE_UTILIZATION,
    Placement,
    resolve_placement,
    worker_settings,
)

from tests.support.engine_builders import engine, run_to_end, spec

GIB = 2**30


def test_cpu_engines_place_vllm_beside_them_without_sleep_mode() -> None:
    assert resolve_placement(trainer_device="cpu") == Placement(colocated=True)
    assert resolve_placement(trainer_device="cpu", device="cpu").sleep_mode is False


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"device": "cuda:1"}, "needs an engine on CUDA"),
        ({"sleep_mode": True}, "vLLM's CPU backend has no sleep mode"),
        ({"gpu_memory_utilization": 1.5}, "must be in (0, 1]"),
    ],
)
def test_cpu_refuses_what_only_a_gpu_can_do(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("]", r"\]")):
        resolve_placement(trainer_device="cpu", **settings)


def test_colocated_takes_a_share_of_what_the_trainer_left_and_sleeps() -> None:
    p = resolve_placement(trainer_device="cuda:0", free_bytes=100 * GIB, total_bytes=140 * GIB)
    assert p.colocated and p.sleep_mode and p.visible_device == "0"
    assert p.gpu_memory_utilization == pytest.approx(COLOCATED_FREE_SHARE * 100 / 140, abs=1e-3)


def test_colocated_explicit_share_must_fit_the_free_memory() -> None:
    memory = {"free_bytes": 50 * GIB, "total_bytes": 140 * GIB}
    ok = resolve_placement(trainer_device="cuda", gpu_memory_utilization=0.3, **memory)
    assert ok.gpu_memory_utilization == 0.3
    with pytest.raises(ValueError, match=r"asks for 70.0 GiB but only 50.0 GiB is free"):
        resolve_placement(trainer_device="cuda", gpu_memory_utilization=0.5, **memory)


def test_colocated_with_almost_nothing_free_says_to_use_another_gpu() -> None:
    with pytest.raises(ValueError, match="device=cuda:N"):
        resolve_placement(trainer_device="cuda:0", free_bytes=2 * GIB, total_bytes=140 * GIB)
    unsized = resolve_placement(trainer_device="cuda:0")  # checked before loading
    assert unsized.colocated and unsized.gpu_memory_utilization is None


def test_colocated_sleep_mode_can_be_turned_off() -> None:
    p = resolve_placement(
        trainer_device="cuda:0", sleep_mode=False, free_bytes=80 * GIB, total_bytes=80 * GIB
    )
    assert p.colocated and not p.sleep_mode


def test_separate_gpu_takes_most_of_it_and_does_not_sleep() -> None:
    p = resolve_placement(trainer_device="cuda:0", device="cuda:1")
    assert p == Placement(False, "1", SEPARATE_UTILIZATION, False)


def test_visible_devices_are_renumbered_as_cuda_does() -> None:
    p = resolve_placement(trainer_device="cuda:0", device="cuda:1", parent_visible="4,6")
    assert p.visible_device == "6"
    with pytest.raises(ValueError, match="not one of this pod's GPUs"):
        resolve_placement(trainer_device="cuda:0", device="cuda:2", parent_visible="4,6")
    with pytest.raises(ValueError, match="cuda or cuda:N"):
        resolve_placement(trainer_device="cuda:0", device="gpu1")


def test_worker_settings_carry_the_placement() -> None:
    p = Placement(True, "3", 0.25, True)
    assert worker_settings(p) == {
        "env": {"CUDA_VISIBLE_DEVICES": "3"},
        "gpu_memory_utilization": 0.25,
        "sleep_mode": True,
    }
    assert worker_settings(Placement(colocated=True)) == {}


def _args(**kw):
    base = dict(
        device_type="cuda",
        dtype="bfloat16",
        max_adapters=4,
        max_rank=16,
        context_tokens=4096,
        max_prompt_tokens=256,
        max_new_tokens=512,
        max_step_tokens=16_384,
    )
    return vllm_engine_args(**{**base, **kw})


def test_engine_args_place_the_worker_and_keep_the_users_env() -> None:
    args = _args(
        trainer_device="cuda:0",
        device_memory=(60 * GIB, 80 * GIB),
        user_options={"env": {"VLLM_LOGGING_LEVEL": "INFO"}},
    )
    assert args["env"] == {"CUDA_VISIBLE_DEVICES": "0", "VLLM_LOGGING_LEVEL": "INFO"}
    assert args["sleep_mode"] is True
    assert args["gpu_memory_utilization"] == pytest.approx(0.375)
    separate = _args(trainer_device="cuda:0", user_options={"device": "cuda:1"})
    assert separate["env"] == {"CUDA_VISIBLE_DEVICES": "1"} and "sleep_mode" not in separate
    assert "device" not in separate  # a placement setting, not a VLLMRollout keyword


def test_engine_args_on_cpu_have_no_placement_keywords() -> None:
    args = _args(device_type="cpu", dtype="float32")
    assert not {"env", "sleep_mode", "gpu_memory_utilization"} & set(args)


# --- the tick steps a co-located sampler aside while it trains ---------------------------


class _Recording:
    """A real TorchRollout whose calls are recorded. A stand-in for vLLM's sleep mode,
    which needs CUDA (vLLM's CPU backend has none): the order of the calls is the point."""

    def __init__(self, inner, events: list[str]) -> None:
        self._inner, self.events, self.name = inner, events, inner.name

    def generate(self, requests):
        self.events.append("rollout")
        return self._inner.generate(requests)

    def sync_adapters(self, exp_ids):
        self.events.append("sync")
        return self._inner.sync_adapters(exp_ids)

    @contextmanager
    def training_phase(self):
        self.events.append("sleep")
        yield
        self.events.append("wake")

    def __getattr__(self, name):
        return getattr(self._inner, name)


def test_each_tick_trains_between_the_samplers_sleep_and_wake_up(tiny_model_dir, tmp_path):
    eng = engine(tiny_model_dir, tmp_path / "ckpt")
    events: list[str] = []
    eng.backend = eng._tick.backend = _Recording(eng.backend, events)
    eng.put_experiment("ns.a", spec(steps=2), "ns", "a", None)
    train = eng._tick.strategy.train

    def recorded_train(*args, **kwargs):
        events.append("train")
        return train(*args, **kwargs)

    eng._tick.strategy.train = recorded_train  # type: ignore[method-assign]
    run_to_end(eng, ["ns.a"])
    assert events == ["rollout", "sleep", "train", "wake", "sync"] * 2
