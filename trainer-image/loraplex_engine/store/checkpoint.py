"""Checkpoints: PEFT adapter directories, per-adapter trainer state, atomic directories.

A checkpoint directory holds ``adapter_config.json`` + ``adapter_model.safetensors`` (what
``peft.PeftModel.from_pretrained`` and vLLM read) and ``trainer_state.json`` +
``optimizer.safetensors`` (what exact resumption needs). Every reader validates everything
before it changes the model or optimiser, and names the file or key at fault.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from loraplex_engine.lora.layers import LoRAConfig
from loraplex_engine.lora.model import PEFT_PREFIX, MultiLoRAModel, check_state_dict
from loraplex_engine.spec.errors import AdapterError, CheckpointError
from loraplex_engine.train.optim import PerAdapterAdamW

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
TRAINER_STATE = "trainer_state.json"
OPTIMIZER_STATE = "optimizer.safetensors"
TRAINER_STATE_FORMAT = 1

# PEFT options we do not implement: loading an adapter that sets them would be silently wrong.
_UNSUPPORTED = {
    "use_dora": False,
    "use_rslora": False,
    "fan_in_fan_out": False,
    "bias": "none",
    "modules_to_save": None,
    "layers_to_transform": None,
    "rank_pattern": {},
    "alpha_pattern": {},
}
# Newer PEFT options: checked on load, not written (older PEFT/vLLM readers do not know them).
_UNSUPPORTED_NEW = {
    "lora_bias": False,
    "exclude_modules": None,
    "layer_replication": None,
    "trainable_token_indices": None,
    "target_parameters": None,
    "alora_invocation_tokens": None,
}


# ---- atomic directories ------------------------------------------------------------------


@contextmanager
def atomic_dir(path: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temp dir next to ``path``; on success fsync it and rename it to ``path``.

    On any error the temp dir is removed, so ``path`` is either absent, the old one, or
    complete. Temp names start with "." so directory scans skip them.
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists() and not overwrite:
        raise CheckpointError(f"{final} already exists")
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        _fsync_tree(tmp)
        if final.exists():  # overwrite: move the old one aside, then swap in the new one
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
            os.rename(final, old / "d")
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for f in files:
            _fsync(Path(dirpath) / f)
        _fsync(Path(dirpath))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- adapters (PEFT format) --------------------------------------------------------------


def save_adapter(
    model: MultiLoRAModel,
    name: str,
    out_dir: str | Path,
    base_model_name_or_path: str | None = None,
) -> Path:
    """Write adapter ``name`` as a standard PEFT LoRA directory."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = peft_config(model, name, base_model_name_or_path)
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tensors = {k: v.contiguous().cpu() for k, v in model.adapter_state_dict(name).items()}
    save_file(tensors, out / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    return out


def peft_config(
    model: MultiLoRAModel, name: str, base_model_name_or_path: str | None = None
) -> dict[str, Any]:
    """Adapter ``name``'s ``adapter_config.json``, as a dict."""
    cfg = model.config_of(name)
    if base_model_name_or_path is None:
        base_model_name_or_path = getattr(model.base_model.config, "_name_or_path", None)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": sorted(cfg.target_modules),
        "init_lora_weights": True,
        "inference_mode": True,
        **_UNSUPPORTED,
    }


def peft_export(
    model: MultiLoRAModel, base_model_name_or_path: str
) -> Callable[[str, torch.dtype], tuple[dict[str, Any], dict[str, torch.Tensor]]]:
    """An adapter as a sampler of its own takes it (rollout/backends.py ``PeftWeights``):
    its PEFT config and tensors, by name and dtype."""

    def export(name: str, dtype: torch.dtype) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        return peft_config(model, name, base_model_name_or_path), peft_tensors(model, name, dtype)

    return export


def peft_tensors(
    model: MultiLoRAModel, name: str, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Adapter ``name``'s weights under PEFT's key names, on the CPU, in ``dtype``
    (default: as trained). Cast on the device first, so a GPU copies out only the bytes
    of ``dtype``. Where no copy is needed (CPU, same dtype) these are views of the live
    weights: serialise them before the next optimiser step."""
    with torch.no_grad():
        return {
            k: v.to(dtype or v.dtype).contiguous().cpu()
            for k, v in model.adapter_views(name).items()
        }


def read_adapter_config(path: str | Path) -> LoRAConfig:
    """Parse a PEFT ``adapter_config.json`` into a LoRAConfig; unsupported options are errors."""
    file = Path(path) / ADAPTER_CONFIG
    raw = _read_json(file)
    if raw.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{file}: peft_type {raw['peft_type']!r} is not LORA")
    for key, default in {**_UNSUPPORTED, **_UNSUPPORTED_NEW}.items():
        value = raw.get(key, default)
        if value and value != default:  # empty / null / false / "none" all mean "not used"
            raise CheckpointError(f"{file}: {key}={value!r} is not supported")
    targets = raw.get("target_modules")
    if not isinstance(targets, list):
        raise CheckpointError(f"{file}: target_modules must be a list of names, got {targets!r}")
    try:
        return LoRAConfig(
            rank=int(raw["r"]),
            alpha=float(raw["lora_alpha"]),
            dropout=float(raw.get("lora_dropout", 0.0)),
            target_modules=tuple(sorted(targets)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{file}: bad LoRA settings: {e}") from e


def load_adapter(
    model: MultiLoRAModel, name: str, path: str | Path, seed: int | None = None
) -> int:
    """Load a PEFT directory into adapter ``name`` (added if new); returns its slot.

    If ``name`` is loaded already its config must match the directory's. Nothing changes
    unless the config, every key and every shape fit the model.
    """
    cfg = read_adapter_config(path)
    weights = _read_safetensors(Path(path) / ADAPTER_WEIGHTS)
    try:
        model.check_config(cfg)
        expected = _expected_shapes(model, cfg)
    except AdapterError as e:
        raise CheckpointError(f"{Path(path) / ADAPTER_CONFIG}: {e}") from e
    try:
        check_state_dict(expected, weights, what=str(Path(path) / ADAPTER_WEIGHTS))
    except AdapterError as e:
        raise CheckpointError(str(e)) from e
    if name in model.adapters() and model.config_of(name) != cfg:
        raise CheckpointError(
            f"{path}: adapter {name!r} is loaded with {model.config_of(name)}, checkpoint has {cfg}"
        )
    if name not in model.adapters():
        # The init is overwritten below; a seeded one leaves torch's global RNG (every
        # tenant's dropout masks) untouched.
        model.add_adapter(name, cfg, 0 if seed is None else seed)
    model.load_adapter_state_dict(name, weights)
    return model.slot_of(name)


def _expected_shapes(model: MultiLoRAModel, cfg: LoRAConfig) -> dict[str, torch.Tensor]:
    """PEFT key -> empty tensor of the shape an adapter with ``cfg`` has on this model."""
    shapes: dict[str, torch.Tensor] = {}
    for path, layer in model.lora_layers.items():
        if path.rsplit(".", 1)[-1] in cfg.target_modules:
            prefix = f"{PEFT_PREFIX}{path}"
            shapes[f"{prefix}.lora_A.weight"] = torch.empty(cfg.rank, layer.in_features)
            shapes[f"{prefix}.lora_B.weight"] = torch.empty(layer.out_features, cfg.rank)
    return shapes


# ---- trainer state -----------------------------------------------------------------------


def save_trainer_state(
    out_dir: str | Path,
    optimizer: PerAdapterAdamW,
    name: str,
    generator: torch.Generator | None = None,
    metadata: dict[str, Any] | None = None,
) -> None:
    """Write adapter ``name``'s optimiser state, RNG state and JSON ``metadata``.

    ``generator`` is the experiment's own RNG (default: torch's global CPU generator).
    torch's global RNG (CPU, and CUDA's when CUDA is in use) is saved too: LoRA dropout
    draws from it, so without it a run with dropout > 0 does not resume exactly.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = optimizer.state_dict(name)
    tensors = {f"exp_avg.{k}": v for k, v in sd["exp_avg"].items()}
    tensors |= {f"exp_avg_sq.{k}": v for k, v in sd["exp_avg_sq"].items()}
    save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, out / OPTIMIZER_STATE)
    rng = (generator or torch.default_generator).get_state()
    state = {
        "format": TRAINER_STATE_FORMAT,
        "optimizer": {"settings": sd["settings"], "step": sd["step"]},
        "rng": _b64(rng),
        "globalRng": _global_rng_state(),
        "metadata": metadata or {},
    }
    (out / TRAINER_STATE).write_text(json.dumps(state, indent=2) + "\n")


def read_metadata(in_dir: str | Path) -> dict[str, Any]:
    """The JSON metadata of a trainer state, without touching any optimiser or RNG."""
    file = Path(in_dir) / TRAINER_STATE
    state = _read_json(file)
    if state.get("format") != TRAINER_STATE_FORMAT or not isinstance(state.get("metadata"), dict):
        raise CheckpointError(f"{file}: unknown format or no metadata")
    return dict(state["metadata"])


def load_trainer_state(
    in_dir: str | Path,
    optimizer: PerAdapterAdamW,
    name: str,
    generator: torch.Generator | None = None,
    global_rng: bool = True,
) -> dict[str, Any]:
    """Restore what save_trainer_state wrote; returns the metadata. Validates first.

    ``global_rng=False`` leaves torch's global RNG alone (its saved state is still
    checked)."""
    file = Path(in_dir) / TRAINER_STATE
    state = _read_json(file)
    tensors = _read_safetensors(Path(in_dir) / OPTIMIZER_STATE)
    try:
        if state["format"] != TRAINER_STATE_FORMAT:
            raise CheckpointError(f"{file}: unknown format {state['format']!r}")
        opt_state = {
            **state["optimizer"],
            "exp_avg": _strip(tensors, "exp_avg."),
            "exp_avg_sq": _strip(tensors, "exp_avg_sq."),
        }
        rng = _unb64(state["rng"])
        torch.Generator().set_state(rng)  # trial run: a bad state raises here, changing nothing
        global_states = _check_global_rng_state(state["globalRng"])
        metadata = dict(state["metadata"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{file}: bad trainer state: {e!r}") from e
    try:
        optimizer.load_state_dict(name, opt_state)
    except (AdapterError, TypeError) as e:
        raise CheckpointError(f"{Path(in_dir) / OPTIMIZER_STATE}: {e}") from e
    if global_rng:
        _set_global_rng_state(*global_states)
    (generator or torch.default_generator).set_state(rng)
    return metadata


# torch's global generators only: the engine draws prompts and tokens from per-experiment
# generators (saved above and in the engine's metadata) and uses neither Python's global
# `random` nor numpy's.


def _global_rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": _b64(torch.get_rng_state())}
    # Only if CUDA is already in use: asking for its state would initialise it.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def _check_global_rng_state(saved: Any) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """Decode and trial-set the saved states; raises (changing nothing) if they are bad."""
    cpu = _unb64(saved["cpu"])
    torch.Generator().set_state(cpu)
    cuda = [_unb64(s) for s in saved["cuda"]] if "cuda" in saved else None
    # A different GPU count (or none) cannot take the saved CUDA states: CPU only then.
    if cuda is not None and len(cuda) != (
        torch.cuda.device_count() if torch.cuda.is_available() else 0
    ):
        cuda = None
    return cpu, cuda


def _set_global_rng_state(cpu: torch.Tensor, cuda: list[torch.Tensor] | None) -> None:
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def _b64(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def _strip(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}


def _read_json(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"{file} is missing") from e
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{file} must hold a JSON object")
    return data


def _read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    if not file.exists():
        raise CheckpointError(f"{file} is missing")
    try:
        return load_file(file)
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{file} is corrupt: {e}") from e
