"""`make test-kernel-paths` collects only the files tests/support/numeric.py lists."""

from __future__ import annotations

from pathlib import Path

from tests.support.numeric import numeric_files


def test_a_numeric_module_and_a_marked_test_are_listed_and_nothing_else(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a/test_grpo.py").write_text("def test_x(): pass\n")  # numeric by its name
    marked = "import pytest\n\n@pytest.mark.numeric\ndef test_y(): pass\n"
    (tmp_path / "a/test_marked.py").write_text(marked)
    (tmp_path / "a/test_other.py").write_text("def test_z(): pass\n")
    (tmp_path / "a/helper.py").write_text(marked)  # not a test module
    assert [p.name for p in numeric_files(tmp_path)] == ["test_grpo.py", "test_marked.py"]


def test_the_listed_files_hold_every_numeric_test_of_the_suite() -> None:
    """The suite's own listing is not empty and names the modules tests/conftest.py marks
    (a numeric test outside them fails collection: tests/conftest.py)."""
    names = {p.name for p in numeric_files()}
    assert {"test_grpo.py", "test_sharding.py", "test_data_parallel.py"} <= names
