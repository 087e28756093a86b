"""`loraplex-engine run`'s dataset paths (docs/datasets.md, "Local paths"): a relative
dataset is taken from the manifest file's directory (no --data-root) or from the first
--data-root; one outside every root is refused, and the refusal names the roots and the
flag that adds one (the user's way out). Through the real CLI, before torch is imported
(test_cli_fast_errors.cli checks that)."""

from __future__ import annotations

from pathlib import Path

from loraplex_engine.local.checks import trust_of
from loraplex_engine.settings.commands import RunSettings

from tests.support.import_probe import cli

ROW = '{"prompt": "a", "answer": "b"}\n'


def _layout(tmp_path: Path, dataset: str) -> Path:
    for sub in ("runs", "data"):
        (tmp_path / sub).mkdir(exist_ok=True)
    (tmp_path / "data" / "x.jsonl").write_text(ROW)
    manifest = tmp_path / "runs" / "x.yaml"
    manifest.write_text(
        "apiVersion: loraplex.dev/v1alpha1\nkind: LoRAExperiment\nmetadata: {name: a}\n"
        f"spec:\n  lora: {{rank: 4}}\n  task: {{name: jsonl, dataset: {dataset}}}\n"
        "  algorithm: {maxSteps: 2}\n"
    )
    return manifest


def test_outside_the_roots_the_refusal_names_them_and_the_flag(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    outside = str((tmp_path / "data" / "x.jsonl").resolve())
    for dataset in (outside, "../data/x.jsonl"):
        manifest = _layout(tmp_path, dataset)
        code, err, heavy = cli("run", str(manifest), "--model", str(tiny_model_dir), cwd=tmp_path)
        assert code == 2 and heavy == [], err
        line = err.splitlines()[-1]
        assert "spec.task.dataset" in line and "is not allowed" in line, line
        why = line.split("is not allowed")[1]
        assert f"({(tmp_path / 'runs').resolve()}/;" in why, line  # the root it used
        assert "run --data-root DIR" in why, line


def test_a_relative_dataset_is_taken_from_the_manifests_folder_or_the_first_root(
    tmp_path: Path,
) -> None:
    manifest = _layout(tmp_path, "x.jsonl")
    runs, data = (tmp_path / "runs").resolve(), (tmp_path / "data").resolve()
    default = trust_of(RunSettings(manifests=str(manifest), model="m"))
    assert default.data.resolve("x.jsonl", "") == (runs / "x.jsonl", runs)
    flagged = RunSettings(manifests=str(manifest), model="m", data_root=(str(data), str(runs)))
    assert trust_of(flagged).data.resolve("x.jsonl", "") == (data / "x.jsonl", data)
    assert trust_of(flagged).data.resolve(str(runs / "x.yaml"), "")[1] == runs  # any root
