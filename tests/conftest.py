"""Shared test fixtures: the tiny model directory is built once per run."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.support.markers import mark_e2e
from tests.support.numeric import NUMERIC_MODULES, numeric_files
from tests.support.tiny_models import tiny_model, tiny_vllm_model

# Two cores in CI, two test workers, and each test may start engine processes: one torch
# thread per process, this one and every process a test starts (they inherit the
# environment). With torch's default (a thread per core) the processes oversubscribe the
# cores and OpenMP's spin-waits burn the difference: `loraplex-engine run` of the demo,
# 6 steps, took 16.4-18.8 s of CPU against 10.4-11.2 with one thread, beside the
# suite's load. A test that wants more threads passes them to its process explicitly.
TEST_THREADS = os.environ.get("LORAPLEX_TEST_THREADS", "1")
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, TEST_THREADS)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the same for its Rust threads
torch.set_num_threads(int(TEST_THREADS))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in NUMERIC_MODULES:
            item.add_marker(pytest.mark.numeric)
        mark_e2e(item)
    # `make test-kernel-paths` collects only numeric_files(): a numeric test elsewhere
    # would silently never run on the other kernel paths.
    listed = set(numeric_files())
    stray = sorted({i.nodeid for i in items if i.get_closest_marker("numeric")
                    and i.path.resolve() not in listed})  # fmt: skip
    if stray:
        raise pytest.UsageError(f"numeric tests outside tests/support/numeric.py's files: {stray}")


def pytest_report_header() -> str:
    """The kernel path torch dispatches to (ATEN_CPU_CAPABILITY picks one below native)."""
    return f"torch CPU capability: {torch.backends.cpu.get_cpu_capability()}"


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny Llama model (built by `make tiny-model`; built here if missing)."""
    return tiny_model()


@pytest.fixture(scope="session")
def tiny_vllm_dir() -> Path:
    """The tiny-vllm preset, for the tests that run real vLLM (built here if missing)."""
    return tiny_vllm_model()


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
