"""Adapter weights from tensors in memory, inside the vLLM worker process.

Imported by ``rollout/vllm/worker.py`` only (it imports vLLM; the engine never imports this).

vLLM 0.32 registers a LoRA only from a directory: ``WorkerLoRAManager._load_adapter``
reads ``adapter_config.json`` and ``adapter_model.safetensors`` under
``LoRARequest.lora_path``, then builds the adapter with ``LoRAModel.from_lora_tensors``.
As verl does (its ``TensorLoRARequest`` and patched ``_load_adapter``), this module
patches ``_load_adapter`` so that a request whose ``lora_path`` names tensors held here
(``loraplex-tensors://<name>@v<version>``) is built from them with that same
``from_lora_tensors`` and the same checks; any other path goes to vLLM's own loader.
Unlike verl the tensors are not carried on the request: the request stays a plain
``LoRARequest`` (what the scheduler and the prefix cache key on), and the tensors of each
adapter's latest version stay in :data:`STORE` until it is replaced or removed, so a
reload vLLM decides on its own (a cache eviction) still finds them.

This works only where vLLM's LoRA manager lives in this process (the worker runs the
engine core in-process with the uni-process executor): ``TensorStore.calls`` counts the
requests the patched loader received, so the worker can tell that an update really went
through it, and otherwise falls back to directories.
"""

from __future__ import annotations

import inspect
from typing import Any

SCHEME = "loraplex-tensors://"
# from_lora_tensors' keywords the patched loader passes (vLLM 0.32).
_FROM_TENSORS_ARGS = (
    "lora_model_id",
    "tensors",
    "peft_helper",
    "device",
    "dtype",
    "model_vocab_size",
    "weights_mapper",
    "skip_prefixes",
)


class TensorStore:
    """lora_path -> (PEFT config dict, tensors), one entry per adapter: its latest."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
        self.calls = 0  # requests for tensors held here that vLLM's loader received
        self.loads = 0  # adapters built from them

    def put(self, path: str, config: dict[str, Any], tensors: dict[str, Any]) -> None:
        self._entries[path] = (config, tensors)

    def get(self, path: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
        return self._entries.get(path)

    def drop(self, path: str) -> None:
        self._entries.pop(path, None)

    def __len__(self) -> int:
        return len(self._entries)


STORE = TensorStore()


def tensor_path(name: str, version: int) -> str:
    return f"{SCHEME}{name}@v{version}"


def install() -> str | None:
    """Patch vLLM's LoRA loader; returns why it cannot (then adapters go as files)."""
    try:
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.worker_manager import WorkerLoRAManager
    except ImportError as e:
        return f"this vLLM has no LoRA worker manager to patch ({e})"
    original = getattr(WorkerLoRAManager, "_load_adapter", None)
    if original is None:
        return "this vLLM's WorkerLoRAManager has no _load_adapter"
    if getattr(original, "loraplex_tensors", False):
        return None  # already installed
    params = inspect.signature(LoRAModel.from_lora_tensors).parameters
    missing = [a for a in _FROM_TENSORS_ARGS if a not in params]
    if missing:
        return f"this vLLM's LoRAModel.from_lora_tensors lacks {', '.join(missing)}"

    def _load_adapter(self: Any, lora_request: Any) -> Any:
        entry = STORE.get(lora_request.lora_path)
        if entry is None:
            return original(self, lora_request)
        STORE.calls += 1
        lora = _from_tensors(self, lora_request, *entry)
        STORE.loads += 1
        return lora

    _load_adapter.loraplex_tensors = True  # type: ignore[attr-defined]
    WorkerLoRAManager._load_adapter = _load_adapter  # type: ignore[method-assign]
    return None


def _expected_modules(manager: Any) -> set[str]:
    """The module names an adapter may target (as vLLM 0.32's ``_load_adapter``)."""
    packed = manager._adapter_manager.packed_modules_mapping
    expected: set[str] = set()
    for module in manager._adapter_manager.supported_lora_modules:
        expected.update(packed.get(module, [module]))
        if module == "experts":
            expected.add(module)
    return expected


def _from_tensors(
    manager: Any, lora_request: Any, config: dict[str, Any], tensors: dict[str, Any]
) -> Any:
    """vLLM 0.32's ``WorkerLoRAManager._load_adapter`` with the directory read replaced by
    ``config`` and ``tensors``: the same validation, the same ``from_lora_tensors``."""
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import parse_fine_tuned_lora_name

    peft_helper = PEFTHelper.from_dict(
        {**config, "vllm_max_position_embeddings": manager.max_position_embeddings}
    )
    peft_helper.validate_legal(manager.lora_config)
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None:
        mapper = mapper.get_rename_mapper()
    # The directory loader refuses tensors of modules the model cannot adapt; so do we.
    expected = _expected_modules(manager)
    unexpected = sorted(
        module
        for key in tensors
        for module, _ in [parse_fine_tuned_lora_name(key, mapper)]
        if module.rsplit(".", 1)[-1] not in expected
    )
    if unexpected:
        raise ValueError(
            f"adapter {lora_request.lora_name}: expected target modules in "
            f"{sorted(expected)} but received {unexpected}"
        )
    lora = manager._lora_model_cls.from_lora_tensors(
        lora_model_id=lora_request.lora_int_id,
        tensors=tensors,
        peft_helper=peft_helper,
        device="cpu",
        dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
        weights_mapper=mapper,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )
    lora.is_3d_lora_weight = lora_request.is_3d_lora_weight
    adapters = manager._adapter_manager
    adapters._validate_moe_lora_format(lora)
    adapters._validate_modules_to_save(lora)
    adapters._validate_token_classification_lora(lora)
    return lora
