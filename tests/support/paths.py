"""Where the checkout is, for tests that read its files or run its scripts."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
# The tiny Llama tests and benchmarks run (tests/support/tiny_models.py builds it).
TINY_MODEL_DIR = REPO_ROOT / ".cache" / "models" / "tiny-llama"
# The tiny-vllm preset's model (tests/support/tiny_models.py builds it).
TINY_VLLM_DIR = REPO_ROOT / ".cache" / "models" / "tiny-vllm"
