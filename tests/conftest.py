"""Shared test fixtures: the tiny model directory is built once per run."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.support.markers import mark_e2e

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY_MODEL_DIR = REPO_ROOT / ".cache" / "models" / "tiny-llama"

# Two cores in CI: keep torch from oversubscribing when pytest runs engine processes too.
torch.set_num_threads(int(os.environ.get("LORAPLEX_TEST_THREADS", "1")))


# Modules whose every test compares float results across summation orders (fused vs alone,
# sharded vs not, chunked vs whole, resumed vs uninterrupted); single tests elsewhere carry
# @pytest.mark.numeric. `make test-kernel-paths` reruns them on every CPU kernel path.
NUMERIC_MODULES = frozenset(
    {
        "test_checkpoint_resume.py",
        "test_grpo.py",
        "test_grpo_reference.py",
        "test_grpo_tis.py",
        "test_lora_grad.py",
        "test_lora_layers.py",
        "test_memory_bounds.py",
        "test_off_policy.py",
        "test_optim.py",
        "test_precision.py",
        "test_prefix_share.py",
        "test_sharding.py",
    }
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in NUMERIC_MODULES:
            item.add_marker(pytest.mark.numeric)
        mark_e2e(item)


def pytest_report_header() -> str:
    """The kernel path torch dispatches to (ATEN_CPU_CAPABILITY picks one below native)."""
    return f"torch CPU capability: {torch.backends.cpu.get_cpu_capability()}"


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny Llama model (built by `make tiny-model`; built here if missing)."""
    if not (TINY_MODEL_DIR / "config.json").exists():
        from loraplex_engine.dev.tiny_model import build_model

        build_model(TINY_MODEL_DIR)
    return TINY_MODEL_DIR


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2-family model, to prove the layers are not Llama-only."""
    from loraplex_engine.dev.tiny_model import build_model

    return build_model(tmp_path_factory.mktemp("tiny-qwen2"), arch="qwen2")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run when a test left an engine or operator process running (then kill it)."""
    children = sys.modules.get("tests.support.child_processes")
    if children is None:  # no test started one
        return
    left = children.survivors()
    children.kill_all()
    if left:
        print(f"\nprocesses the test helpers started are still running: {left}", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True)
def _close_tinker_clients() -> Iterator[None]:
    """SDK clients a test opened (tests/support/tinker_clients.py) end with the test."""
    yield
    clients = sys.modules.get("tests.support.tinker_clients")
    if clients is not None:
        clients.close_all()


@pytest.fixture(scope="session")
def plugins_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test plug-in package installed in a directory of its own (for PYTHONPATH)."""
    from tests.support.plugin_install import install

    return install(tmp_path_factory.mktemp("plugins"))


@pytest.fixture(scope="session")
def engine_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The engine's own metadata (its first-party plug-ins' entry points) as this tree
    declares them, for PYTHONPATH (plugin_install.install_engine_metadata)."""
    from tests.support.plugin_install import install_engine_metadata

    return install_engine_metadata(tmp_path_factory.mktemp("engine-site"))
