"""The tiny random-weight models tests and benchmarks run, built where they are missing
(`make tiny-model` builds the tiny Llama ahead; the build takes seconds)."""

from __future__ import annotations

from pathlib import Path

from tests.support.paths import TINY_MODEL_DIR, TINY_VLLM_DIR


def built(path: Path, preset: str = "tiny") -> Path:
    """``path``, holding the ``preset`` model (written there first if it is not)."""
    if not (path / "config.json").exists():
        from loraplex_engine.dev.tiny_model import build_model  # torch: only when building

        build_model(path, preset=preset)
    return path


def tiny_model() -> Path:
    """The tiny Llama (2 layers, hidden 64): conftest's `tiny_model_dir`."""
    return built(TINY_MODEL_DIR)


def tiny_vllm_model() -> Path:
    """The tiny-vllm preset (head_dim 32 for vLLM's CPU kernels)."""
    return built(TINY_VLLM_DIR, "tiny-vllm")
