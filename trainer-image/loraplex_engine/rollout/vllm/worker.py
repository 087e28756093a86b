"""vLLM worker process for the ``vllm`` rollout backend.

Run as a script by :class:`loraplex_engine.rollout.vllm.backend.VLLMRollout`, with the
python of the environment that holds vLLM (``.venv-vllm`` on CPU). It imports only the
standard library and vLLM (never ``loraplex_engine``), so it runs in an environment where
the engine package is not installed.

Protocol: one JSON object per line. Requests come on stdin; replies go to the process's
original stdout, which is moved to a private file descriptor at start-up, and fd 1 is
pointed at stderr so that anything vLLM or a C library prints cannot corrupt the protocol.
Every request gets exactly one reply: ``{"ok": true, "result": ...}`` or
``{"ok": false, "error": "...", "type": "ExceptionName"}``. A request whose header has
``"frame": n`` is followed by ``n`` raw bytes (an adapter's tensors as safetensors: stdin
is read as bytes), which the op receives as ``payload``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

# Run as a script, this file's folder is sys.path[0], where its siblings (requests.py,
# config.py) would shadow the libraries vLLM imports by those names: it goes last, so
# only the worker's own siblings (worker_env, tensor_sync) are found there.
HERE = Path(__file__).resolve().parent
if sys.path and Path(sys.path[0] or ".").resolve() == HERE:
    sys.path.append(str(sys.path.pop(0)))

import worker_env  # noqa: E402  (after the path fix above)
from worker_env import BASE_ADAPTER, setup_env  # noqa: E402


def _completion(c: Any, logprobs: bool, top_logprobs: int) -> dict[str, Any]:
    """One vLLM ``CompletionOutput`` as JSON: its tokens and, per token, its log-prob."""
    lps, tops = None, None
    if logprobs and c.logprobs is not None:
        lps = [step[tok].logprob for tok, step in zip(c.token_ids, c.logprobs, strict=True)]
        if top_logprobs:
            tops = [_alternatives(step, top_logprobs) for step in c.logprobs]
    return {
        "token_ids": list(c.token_ids),
        "logprobs": lps,
        "finish_reason": c.finish_reason,
        "top_logprobs": tops,
    }


def _alternatives(step: dict[int, Any], k: int) -> list[list[float]]:
    """A step's ``k`` most likely tokens as ``[token, log-prob]`` pairs (JSON has no int
    keys); vLLM adds the sampled token beyond them, and tokens outside ``top_p`` are
    -inf: both left out."""
    best = sorted((lp.rank, tok, lp.logprob) for tok, lp in step.items() if lp.rank <= k)
    return [[tok, logprob] for _, tok, logprob in best if logprob > float("-inf")]


class Worker:
    def __init__(self, cfg: dict[str, Any]) -> None:
        from vllm.platforms import current_platform

        self.cfg = cfg
        self.max_adapters = int(cfg.get("max_adapters", 4))
        self.is_cpu = current_platform.is_cpu()
        # vLLM 0.32's CPU LoRA ops (vllm/lora/ops/torch_ops/lora_ops.py) index the stacked
        # adapter weights with the "no LoRA" sentinel -1, so a base-model request batched
        # with LoRA requests gets the LAST slot's adapter applied (vllm-project/vllm#48421,
        # open). Workaround: base requests go through an all-zero adapter ("__base__"),
        # which costs one slot. The Triton kernels on GPU honour -1, so only on CPU.
        self.zero_base = bool(cfg.get("zero_base_adapter", self.is_cpu))
        vllm_rank = worker_env.vllm_lora_rank(int(cfg.get("max_rank", 16)))
        slots = self.max_adapters + (1 if self.zero_base else 0)
        kwargs: dict[str, Any] = dict(
            model=cfg["model"],
            dtype=cfg.get("dtype", "auto"),
            seed=int(cfg.get("seed", 0)),
            max_model_len=int(cfg.get("max_model_len", 512)),
            max_num_seqs=int(cfg.get("max_num_seqs", 64)),
            enforce_eager=bool(cfg.get("enforce_eager", True)),
            enable_lora=True,
            max_loras=slots,
            max_cpu_loras=slots,
            max_lora_rank=vllm_rank,
            # The tokenizer is loaded (it gives vLLM the EOS id to stop at), but prompts
            # and completions stay token ids (detokenize=False).
        )
        kv_bytes = cfg.get("kv_cache_bytes")
        if kv_bytes is None and self.is_cpu:
            kv_bytes = worker_env.CPU_KV_CACHE_BYTES
        if kv_bytes:
            kwargs["kv_cache_memory_bytes"] = int(kv_bytes)
        kwargs["logprobs_mode"] = cfg.get("logprobs_mode", "raw_logprobs")
        if cfg.get("gpu_memory_utilization"):
            kwargs["gpu_memory_utilization"] = float(cfg["gpu_memory_utilization"])
        if int(cfg.get("tensor_parallel_size", 1)) > 1:  # its own workers, on the pod's GPUs
            kwargs["tensor_parallel_size"] = int(cfg["tensor_parallel_size"])
        self.sleep_mode = bool(cfg.get("sleep_mode", False))
        if self.sleep_mode:
            kwargs["enable_sleep_mode"] = True
        kwargs.update(cfg.get("llm_kwargs") or {})
        if self.is_cpu:
            worker_env.check_cpu_head_dim(cfg["model"])
        from vllm import LLM

        t0 = time.perf_counter()
        self.llm = LLM(**kwargs)
        self.startup_s = time.perf_counter() - t0
        self.vllm_rank = vllm_rank
        # name -> [int id, version, path]; ids are stable per name, versions bump per update.
        self.adapters: dict[str, list[Any]] = {}
        self._next_id = 1
        self._tmp = tempfile.TemporaryDirectory(prefix="loraplex-vllm-")
        self.requests_total = 0  # vLLM requests added (one per prompt, n samples each)
        self.sequences_total = 0  # samples they asked for
        self.tensor_sync, self.tensor_sync_why = self._install_tensor_sync(cfg)

    @staticmethod
    def _install_tensor_sync(cfg: dict[str, Any]) -> tuple[bool, str | None]:
        """Whether adapters may be updated from tensors (rollout/vllm/tensor_sync.py), and if
        not, why."""
        if not cfg.get("tensor_sync", True):
            return False, "weight_sync is 'files'"
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
            return False, "vLLM's engine core runs in another process"
        if int(cfg.get("tensor_parallel_size", 1)) > 1:
            return False, "tensor_parallel_size above 1: the LoRA weights live in vLLM's workers"
        import tensor_sync  # beside this script; it patches vLLM's LoRA loader

        why = tensor_sync.install()
        return why is None, why

    # -- adapters --------------------------------------------------------------------

    def _request(self, name: str, *, load_inplace: bool = False):
        from vllm.lora.request import LoRARequest

        lora_id, version, path = self.adapters[name]
        # The name carries the version: vLLM's prefix cache keys blocks by (lora_name,
        # lora_path), so KV computed with old weights is never reused after an update.
        return LoRARequest(f"{name}@v{version}", lora_id, path, load_inplace=load_inplace)

    def _add(self, name: str, path: str) -> None:
        engine = self.llm.llm_engine
        self.adapters[name] = [self._next_id, 0, path]
        self._next_id += 1
        try:
            if not engine.add_lora(self._request(name)):
                raise RuntimeError(f"vLLM refused adapter {name!r} from {path}")
        except BaseException:
            del self.adapters[name]
            raise

    def _make_zero_adapter(self, template_dir: str) -> str:
        """A copy of a user adapter with every B matrix zero: its delta is exactly 0."""
        from safetensors.torch import load_file, save_file

        out = Path(self._tmp.name) / BASE_ADAPTER
        out.mkdir(exist_ok=True)
        src = Path(template_dir)
        (out / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
        tensors = load_file(str(src / "adapter_model.safetensors"))
        for key, tensor in tensors.items():
            if "lora_B" in key or "lora_embedding_B" in key:
                tensor.zero_()
        save_file(tensors, str(out / "adapter_model.safetensors"))
        return str(out)

    def load_adapter(self, name: str, path: str) -> dict[str, Any]:
        if name == BASE_ADAPTER:
            raise ValueError(f"adapter name {BASE_ADAPTER!r} is reserved")
        if name in self.adapters:
            raise ValueError(f"adapter {name!r} is already loaded; use update_adapter")
        n_user = len(self.adapters) - (1 if BASE_ADAPTER in self.adapters else 0)
        if n_user >= self.max_adapters:
            raise ValueError(f"all {self.max_adapters} adapter slots are in use")
        t0 = time.perf_counter()
        self._add(name, path)  # first, so that a bad adapter fails under its own name
        if self.zero_base and BASE_ADAPTER not in self.adapters:
            try:
                self._add(BASE_ADAPTER, self._make_zero_adapter(path))
            except BaseException:
                self.remove_adapter(name)
                raise
        return {"seconds": time.perf_counter() - t0}

    def update_adapter(self, name: str, path: str) -> dict[str, Any]:
        """Adapter-only weight sync: reload this adapter's tensors into its slot."""
        if name not in self.adapters or name == BASE_ADAPTER:
            raise KeyError(f"adapter {name!r} is not loaded")
        t0 = time.perf_counter()
        entry = self.adapters[name]
        old = list(entry)
        entry[1] += 1
        entry[2] = path
        try:
            ok = self.llm.llm_engine.add_lora(self._request(name, load_inplace=True))
            if not ok:
                raise RuntimeError(f"vLLM refused the update of adapter {name!r}")
        except BaseException:
            entry[:] = old
            raise
        self._forget_tensors(old[2])
        return {"seconds": time.perf_counter() - t0, "version": entry[1]}

    def update_adapter_tensors(
        self,
        name: str,
        config: dict[str, Any],
        payload: bytes | None = None,
        shm: str | None = None,
    ) -> dict[str, Any]:
        """Adapter-only weight sync from memory: the adapter's tensors as safetensors, in
        the shared-memory file ``shm`` (unlinked here as soon as it is read) or as the
        frame ``payload``; ``config`` is its ``adapter_config.json``; nothing is written.
        The new version replaces the old in its slot exactly as a directory update does
        (``load_inplace``); only the loader differs (rollout/vllm/tensor_sync.py). Raises
        ``TensorSyncUnavailable`` where the tensors cannot reach vLLM's loader: the
        caller then sends a directory."""
        t0 = time.perf_counter()
        tensors = _read_tensors(payload, shm)  # first: the segment goes whatever happens
        if not self.tensor_sync:
            raise TensorSyncUnavailable(f"tensor sync is off: {self.tensor_sync_why}")
        if name not in self.adapters or name == BASE_ADAPTER:
            raise KeyError(f"adapter {name!r} is not loaded")
        import tensor_sync as sync

        entry = self.adapters[name]
        old = list(entry)
        entry[1] += 1
        entry[2] = sync.tensor_path(name, entry[1])
        sync.STORE.put(entry[2], config, tensors)
        calls = sync.STORE.calls
        try:
            try:
                ok = self.llm.llm_engine.add_lora(self._request(name, load_inplace=True))
            finally:
                reached = sync.STORE.calls != calls
            if not reached:  # vLLM's loader runs in another process: it never saw them
                self.tensor_sync = False
                self.tensor_sync_why = "vLLM's LoRA loader runs outside the worker process"
                raise TensorSyncUnavailable(self.tensor_sync_why)
            if not ok:
                raise RuntimeError(f"vLLM refused the update of adapter {name!r}")
        except BaseException as exc:
            sync.STORE.drop(entry[2])
            entry[:] = old
            if not reached and not isinstance(exc, TensorSyncUnavailable):
                self.tensor_sync = False
                self.tensor_sync_why = f"vLLM's LoRA loader never saw the tensors ({exc})"
                raise TensorSyncUnavailable(self.tensor_sync_why) from exc
            raise
        self._forget_tensors(old[2])
        return {"seconds": time.perf_counter() - t0, "version": entry[1]}

    @staticmethod
    def _forget_tensors(path: str) -> None:
        """Drop a superseded version's tensors (a no-op for a directory path)."""
        if path.startswith("loraplex-tensors://"):
            import tensor_sync

            tensor_sync.STORE.drop(path)

    def remove_adapter(self, name: str) -> dict[str, Any]:
        if name not in self.adapters or name == BASE_ADAPTER:
            raise KeyError(f"adapter {name!r} is not loaded")
        lora_id, _, path = self.adapters.pop(name)
        self.llm.llm_engine.remove_lora(lora_id)
        self._forget_tensors(path)
        return {}

    # -- generation ------------------------------------------------------------------

    def generate(
        self,
        requests: list[dict[str, Any]],
        logprobs: bool = True,
        stop_token_ids: list[int] | None = None,
        ignore_eos: bool = False,
    ) -> dict[str, Any]:
        """Each request: ``adapter`` (None: the base model), ``prompt`` (token ids),
        ``n``, ``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``,
        ``top_logprobs``. One batch for all of them; a request vLLM refuses (an unknown
        adapter, bad sampling values, a prompt over ``max_model_len``) is answered with
        its error and the others still run. Reply: per request ``{"ok": true,
        "completions": [...]}`` or ``{"ok": false, "type", "error"}``."""
        results: list[dict[str, Any] | None] = [None] * len(requests)
        added: list[int] = []
        for i, req in enumerate(requests):
            try:
                self._enqueue(req, logprobs, stop_token_ids, ignore_eos)
            except Exception as exc:  # this request alone; the engine holds nothing of it
                results[i] = {"ok": False, "type": type(exc).__name__, "error": str(exc)}
                continue
            added.append(i)
        # LLM.enqueue numbers requests in order and wait_for_completion returns them
        # sorted by that number: the k-th output answers the k-th request added.
        outputs = self.llm.wait_for_completion(use_tqdm=False) if added else []
        if len(outputs) != len(added):
            raise RuntimeError(f"vLLM answered {len(outputs)} of {len(added)} requests")
        for i, out in zip(added, outputs, strict=True):
            if list(out.prompt_token_ids or []) != [int(t) for t in requests[i]["prompt"]]:
                raise RuntimeError(f"vLLM's output {out.request_id} is not request {i}'s")
            comps = [
                _completion(c, logprobs, int(requests[i].get("top_logprobs") or 0))
                for c in sorted(out.outputs, key=lambda c: c.index)
            ]
            results[i] = {"ok": True, "completions": comps}
        self.requests_total += len(added)
        self.sequences_total += sum(int(requests[i].get("n", 1)) for i in added)
        return {"results": results, "vllm_requests": len(added)}

    def _enqueue(
        self,
        req: dict[str, Any],
        logprobs: bool,
        stop_token_ids: list[int] | None,
        ignore_eos: bool,
    ) -> None:
        """Add one request to vLLM's queue (one ``enqueue`` each: a refusal aborts only
        what that call added)."""
        from vllm import SamplingParams

        name = req.get("adapter")
        if name is None:
            lora = self._request(BASE_ADAPTER) if BASE_ADAPTER in self.adapters else None
        elif name in self.adapters and name != BASE_ADAPTER:
            lora = self._request(name)
        else:
            raise KeyError(f"adapter {name!r} is not loaded")
        top_logprobs = int(req.get("top_logprobs") or 0)
        params = SamplingParams(
            n=int(req.get("n", 1)),
            max_tokens=int(req.get("max_new_tokens", 16)),
            temperature=float(req.get("temperature", 1.0)),
            top_p=float(req.get("top_p", 1.0)),
            top_k=int(req.get("top_k") or 0),
            # vLLM gives the n children of a seeded request seeds seed+0..n-1.
            seed=req.get("seed"),
            logprobs=top_logprobs if logprobs else None,
            stop_token_ids=stop_token_ids,
            ignore_eos=ignore_eos,
            detokenize=False,
        )
        prompt = {"prompt_token_ids": [int(t) for t in req["prompt"]]}
        self.llm.enqueue(prompt, params, lora_request=lora, use_tqdm=False)

    def sleep(self) -> dict[str, Any]:
        """Level 1: weights to host memory, KV cache dropped (the next rollout recomputes
        its prefixes anyway: every adapter changed in the training phase)."""
        if not self.sleep_mode:
            raise RuntimeError("the worker was started without sleep_mode")
        t0 = time.perf_counter()
        self.llm.sleep(level=1)
        return {"seconds": time.perf_counter() - t0}

    def wake_up(self) -> dict[str, Any]:
        if not self.sleep_mode:
            raise RuntimeError("the worker was started without sleep_mode")
        t0 = time.perf_counter()
        self.llm.wake_up()
        return {"seconds": time.perf_counter() - t0}

    def info(self) -> dict[str, Any]:
        import vllm

        return {
            "vllm_version": vllm.__version__,
            "startup_s": self.startup_s,
            "max_lora_rank": self.vllm_rank,
            "dtype": str(self.llm.llm_engine.model_config.dtype).removeprefix("torch."),
            "max_model_len": self.llm.llm_engine.model_config.max_model_len,
            "zero_base_adapter": self.zero_base,
            "device": worker_env.current_platform_type(),
            "requests_total": self.requests_total,
            "sequences_total": self.sequences_total,
            "sleep_mode": self.sleep_mode,
            "lora_dtype": str(self.llm.llm_engine.vllm_config.lora_config.lora_dtype).removeprefix(
                "torch."
            ),
            "tensor_sync": self.tensor_sync,
            "tensor_sync_why": self.tensor_sync_why,
            "tensor_updates": _tensor_loads(),
            "adapters": {k: v[1] for k, v in self.adapters.items() if k != BASE_ADAPTER},
            "loaded_lora_ids": sorted(self.llm.llm_engine.list_loras()),
            "maxrss_mb": worker_env.maxrss_mb(),
            "cpu_head_sizes": worker_env.cpu_head_sizes(),
        }


def _read_tensors(payload: bytes | None, shm: str | None) -> dict[str, Any]:
    """Tensors sent as safetensors: a shared-memory file (unlinked once read) or bytes."""
    from safetensors.torch import load, load_file

    if shm is None:
        if payload is None:
            raise ValueError("update_adapter_tensors needs a frame or a shm segment")
        return load(payload)
    try:
        return load_file(shm)
    finally:
        Path(shm).unlink(missing_ok=True)


class TensorSyncUnavailable(RuntimeError):
    """The tensor path cannot reach vLLM's loader here; send a directory instead."""


def _tensor_loads() -> int:
    """Adapters built from tensors so far (tensor_sync.STORE.loads)."""
    mod = sys.modules.get("tensor_sync")
    return int(mod.STORE.loads) if mod is not None else 0


WORKER_OPS = (
    "load_adapter",
    "update_adapter",
    "update_adapter_tensors",
    "remove_adapter",
    "generate",
    "info",
    "sleep",
    "wake_up",
)


def _read_frame(stream: Any, size: int) -> bytes:
    data = stream.read(size)
    if len(data) != size:
        raise EOFError(f"stdin closed inside a {size}-byte frame (got {len(data)})")
    return data


def main() -> int:
    # Keep the real stdout for replies; send everything else that writes to fd 1 to stderr.
    reply_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    replies = os.fdopen(reply_fd, "w", buffering=1)

    def reply(obj: dict[str, Any]) -> None:
        replies.write(json.dumps(obj) + "\n")
        replies.flush()

    worker: Worker | None = None
    stdin = sys.stdin.buffer  # bytes: a header line may be followed by a binary frame
    for line in stdin:
        if not line.strip():
            continue
        try:
            msg = json.loads(line)
            frame = msg.pop("frame", None)
            if frame is not None:  # read it whatever happens next: the stream stays in step
                msg["payload"] = _read_frame(stdin, int(frame))
            op = msg.pop("op")
            if op == "init":
                setup_env(msg)
                worker = Worker(msg)
                result: Any = worker.info()
            elif op == "close":
                if worker is not None:
                    worker._tmp.cleanup()
                reply({"ok": True, "result": None})
                replies.close()
                # vLLM's own shutdown (atexit hooks, thread joins) takes seconds and can
                # hang; the process holds nothing else worth a graceful exit.
                os._exit(0)
            elif worker is None:
                raise RuntimeError("worker not initialised: send 'init' first")
            elif op in WORKER_OPS:
                result = getattr(worker, op)(**msg)
            else:
                raise ValueError(f"unknown op {op!r}")
            reply({"ok": True, "result": result})
        except Exception as exc:
            reply(
                {
                    "ok": False,
                    "type": type(exc).__name__,
                    "error": str(exc),
                    "traceback": traceback.format_exc(),
                }
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
