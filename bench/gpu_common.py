"""What the GPU check's arms share (bench/gpu_check.py runs them; bench/gpu.sh wraps it).

- the time budget every arm keeps to (:class:`Budget`), and the result JSON written after
  every cell (:func:`write_json`), so a run cut short still leaves what it measured;
- the random-weight model of a real family's shape the vLLM and data-parallel arms train
  (:func:`build_family_model`: Qwen3-0.6B's config, a small trained tokenizer, bf16);
- the demo-like workload they train (:func:`demo_specs`: bench/throughput.py's
  target-token experiments);
- whole-device memory peaks of every process (:class:`DeviceMemoryPoller`, nvidia-smi),
  since vLLM's worker and the data-parallel ranks are processes of their own.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[1]
QWEN3_06B = REPO / "bench/configs/qwen3-0.6b.json"
# Where the vLLM and data-parallel arms keep the model they share (by dry run or not).
FAMILY_MODEL_DIRS = {
    False: REPO / ".cache/models/gpu-qwen3-0.6b",
    True: REPO / ".cache/models/gpu-qwen3-dry-run",
}
# Qwen3's layout (GQA 2:1, head_dim set, tied head) at a CPU's size; head_dim 32 is the
# smallest vLLM's CPU attention kernels take (docs/architecture.md, vLLM findings).
DRY_RUN_FAMILY_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "max_window_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "max_position_embeddings": 512,
}
TOKENIZER_VOCAB = 2048  # a trained byte-level BPE: no download (the real one is 151,936)
ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ---- time ------------------------------------------------------------------------------


@dataclass
class Budget:
    """Seconds left before ``deadline`` (time.monotonic)."""

    deadline: float

    @classmethod
    def of(cls, seconds: float) -> Budget:
        return cls(time.monotonic() + seconds)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def allows(self, seconds: float) -> bool:
        """Whether ``seconds`` more of work would end before the deadline."""
        return self.left() > seconds


def write_json(out: Path, result: dict[str, Any]) -> None:
    """The result, replaced whole (a reader never sees half a file)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str) + "\n")
    tmp.replace(out)


def arm_skipped(result: dict[str, Any], out: Path, label: str, why: str | None) -> bool:
    """Record, write and print that the whole arm cannot run here (``why``: None, it can)."""
    if why is None:
        return False
    result["skipped_arm"] = why
    write_json(out, result)
    print(f"{label} arm skipped: {why}", flush=True)
    return True


def cell_skipped(
    result: dict[str, Any], out: Path, label: str, cell: str, why: str | None,
    budget: Budget, need_s: float,
) -> bool:  # fmt: skip
    """Record, write and print a cell that will not run: for ``why``, else (None) when
    fewer than ``need_s`` seconds of the budget are left."""
    if why is None and not budget.allows(need_s):
        why = f"time budget: {max(0.0, budget.left()):.0f}s left, a cell needs ~{need_s:.0f}s"
    if why is None:
        return False
    result["skipped"].append({"cell": cell, "why": why})
    write_json(out, result)
    print(f"{label} {cell}: skipped ({why})", flush=True)
    return True


def error_text(e: BaseException, limit: int = 2000) -> str:
    """An exception as one recordable string (its class, message, bounded)."""
    return f"{type(e).__name__}: {e}"[:limit]


def run_in_group(
    cmd: list[str],
    timeout_s: float,
    *,
    env: dict[str, str] | None = None,
    every_s: float = 5.0,
    on_wait: Callable[[], None] | None = None,
) -> int | None:
    """Run ``cmd`` in a process group of its own; its exit code, or None if it ran past
    ``timeout_s``. Everything it started is SIGKILLed at the end either way (its group,
    and the groups of its descendants: a data-parallel run it started in a session of
    its own), so nothing (vLLM's worker, ranks) outlives it holding a GPU. ``on_wait``
    runs every ``every_s`` while it runs (the orchestrator merges partial results)."""
    proc = subprocess.Popen(cmd, start_new_session=True, env=env)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                return proc.wait(timeout=max(0.1, min(every_s, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                if time.monotonic() >= deadline:
                    return None
                if on_wait is not None:
                    on_wait()
    finally:
        kill_tree(proc)


def kill_tree(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL ``proc``'s group and, while it still runs, every descendant and its group
    (found before the kill: once ``proc`` dies, its children are re-parented away)."""
    tree = descendants(proc.pid) if proc.poll() is None else set()
    groups = {proc.pid}
    for pid in tree:
        with contextlib.suppress(OSError):
            groups.add(os.getpgid(pid))
    groups.discard(os.getpgrp())  # never this process's own
    for group in groups:
        with contextlib.suppress(OSError):
            os.killpg(group, signal.SIGKILL)
    for pid in tree:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(30)


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (Linux /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            # pid (comm) state ppid ...; comm may hold spaces: split after the ")"
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(stat.parent.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


# ---- the model and the workload -------------------------------------------------------


def family_config_values(dry_run: bool, config: Path = QWEN3_06B) -> dict[str, Any]:
    values = json.loads(config.read_text())
    return values | DRY_RUN_FAMILY_SHAPE if dry_run else values


def build_family_model(out: Path, dry_run: bool, device: str, config: Path = QWEN3_06B) -> Path:
    """A random-weight model with ``config``'s shapes (shrunk for a dry run) and a small
    trained tokenizer, saved in bf16 to ``out`` (reused when already there).

    Built on ``device`` (seconds on a GPU, not minutes on a CPU). The vocabulary is the
    tokenizer's (2,048), not the family's 151,936: the head shrinks, the decoder layers,
    which hold almost all the FLOPs, keep their real shapes."""
    if (out / "config.json").exists():
        return out
    import torch
    from loraplex_engine.dev.tiny_model import train_tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = train_tokenizer(TOKENIZER_VOCAB)
    values = family_config_values(dry_run, config)
    values |= {
        "vocab_size": len(tok),
        "pad_token_id": tok.pad_token_id,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
    }
    model_type = values.pop("model_type")
    values.pop("architectures", None)
    cfg = AutoConfig.for_model(model_type, **values)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    tmp = out.with_name(f"{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    del model
    if torch.cuda.is_available():  # the engine that loads it next counts free memory
        torch.cuda.empty_cache()
    try:
        tmp.replace(out)
    except OSError:  # another process built it meanwhile: use theirs
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "config.json").exists():
            raise
    return out


@dataclass(frozen=True)
class Workload:
    """The demo-like workload: ``experiments`` target-token experiments of ``steps`` steps,
    ``prompts`` prompts x ``group`` completions of ``max_new_tokens`` each per step."""

    experiments: int
    steps: int
    group: int
    prompts: int
    max_new_tokens: int
    rank: int
    lr: float = 1e-3
    targets: tuple[str, ...] = ALL_PROJECTIONS


GPU_WORKLOAD = Workload(experiments=4, steps=4, group=8, prompts=4, max_new_tokens=128, rank=32)
DRY_RUN_WORKLOAD = Workload(experiments=2, steps=2, group=2, prompts=2, max_new_tokens=4, rank=4)


def demo_specs(w: Workload) -> list[dict[str, Any]]:
    """``[{"id", "spec"}]``: bench/throughput.py's experiments (seed i, target letter i,
    lr spread ±20 %), the same in every arm."""
    import throughput

    args = SimpleNamespace(
        rank=w.rank, targets=list(w.targets), group=w.group, prompts=w.prompts,
        lr=w.lr, max_new_tokens=w.max_new_tokens, seed_per_repeat=False,
        workload="target-token",
    )  # fmt: skip
    return throughput.experiment_specs(w.experiments, w.steps, args)


# ---- memory of the whole device -------------------------------------------------------


class DeviceMemoryPoller:
    """Peak used memory of every GPU, all processes together (nvidia-smi every
    ``interval_s``): what the trainer, vLLM's worker and other ranks hold between them.

    ``peaks()`` is None where there is no nvidia-smi (the CPU dry run); a sampled peak
    can miss a spike shorter than the interval."""

    QUERY = ("nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits")

    def __init__(self, interval_s: float = 0.25) -> None:
        self.interval_s = interval_s
        self.available = shutil.which("nvidia-smi") is not None
        self._peaks: dict[int, int] = {}
        self._lock = threading.Lock()  # peaks() reads while the thread adds GPUs
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> dict[int, int]:
        """GPU index -> bytes used now ({} if nvidia-smi fails)."""
        try:
            text = subprocess.run(self.QUERY, capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            return {}
        return parse_memory_used(text)

    def _run(self) -> None:
        while not self._stop.is_set():
            sample = self.sample()
            with self._lock:
                for gpu, used in sample.items():
                    self._peaks[gpu] = max(self._peaks.get(gpu, 0), used)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> DeviceMemoryPoller:
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=15)

    def peaks(self) -> dict[str, int] | None:
        """``{"cuda:<index>": peak bytes}`` so far (None without nvidia-smi)."""
        if not self.available:
            return None
        with self._lock:
            return {f"cuda:{gpu}": used for gpu, used in sorted(self._peaks.items())}


def parse_memory_used(text: str) -> dict[int, int]:
    """nvidia-smi's ``index, memory.used`` CSV (MiB, no units) -> index -> bytes."""
    out = {}
    for line in text.splitlines():
        index, _, used = line.partition(",")
        if index.strip().isdigit() and used.strip().isdigit():
            out[int(index)] = int(used) << 20
    return out


def has_flag(help_text: str, flag: str) -> bool:
    """Whether argparse's ``--help`` output lists ``flag`` as an option of its own (not
    a longer flag it begins, nor a mention in another flag's help)."""
    return re.search(rf"^\s+{re.escape(flag)}(?![-\w])", help_text, re.MULTILINE) is not None


def gpu_count() -> int:
    """CUDA devices torch sees (0 without CUDA); does not create a CUDA context."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
