"""Where the numeric tests live, so that `make test-kernel-paths` collects those files only.

A numeric test compares float results across summation orders (fused vs alone, sharded
vs not, chunked vs whole, resumed vs uninterrupted); `make test-kernel-paths` reruns them
on torch's other CPU kernel paths. Collecting the whole suite to select them took about a
minute per path on 2 cores; these files collect in seconds. tests/conftest.py marks the
modules below and fails a run that finds a numeric test in a file not listed here.

    python -m tests.support.numeric      prints the files, relative to the repository
"""

from __future__ import annotations

from pathlib import Path

from tests.support.paths import REPO_ROOT

TESTS = REPO_ROOT / "tests"

# Modules whose every test is numeric; single tests elsewhere carry @pytest.mark.numeric.
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
MARK = "mark.numeric"


def numeric_files(root: Path = TESTS) -> list[Path]:
    """Every test module that is numeric or names the marker, sorted."""
    return sorted(
        p for p in root.rglob("test_*.py") if p.name in NUMERIC_MODULES or MARK in p.read_text()
    )


def main() -> None:
    print(" ".join(str(p.relative_to(REPO_ROOT)) for p in numeric_files()))


if __name__ == "__main__":
    main()
