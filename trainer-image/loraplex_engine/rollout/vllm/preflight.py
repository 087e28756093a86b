"""The vLLM rollout's checks before the model loads: its ``--vllm-option`` names, what of
their placement the flags decide, and a python that has vLLM."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from typing import Any

from loraplex_engine.spec.errors import UsageError


def check(options: Mapping[str, Any], device: str) -> None:
    # Imported here: the config module pulls in torch.
    from loraplex_engine.rollout.vllm.config import check_placement, check_vllm_option_names

    try:
        check_vllm_option_names(options)
        if device != "auto":
            check_placement(dict(options), device, os.environ.get("CUDA_VISIBLE_DEVICES"))
    except ValueError as e:
        raise UsageError(str(e)) from e
    _check_python()


def _check_python() -> None:
    """The vLLM worker runs with ``$LORAPLEX_VLLM_PYTHON``, else this python: say so
    before the model loads rather than fail in the worker's import."""
    if os.environ.get("LORAPLEX_VLLM_PYTHON") or importlib.util.find_spec("vllm"):
        return
    raise UsageError(
        "--rollout-backend vllm: this python has no vllm; set LORAPLEX_VLLM_PYTHON to the "
        "python of an environment that has it (make vllm-venv: .venv-vllm/bin/python)"
    )
