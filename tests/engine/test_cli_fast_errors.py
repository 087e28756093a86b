"""A user's mistake is reported before the heavy imports, and all of a manifest's at once.

Each case runs the CLI in a fresh interpreter and asks it, after the error, whether
torch or transformers was ever imported (``sys.modules``): a one-line error must not
cost the seconds those imports take. Not a timing assertion, so it holds on a loaded
machine too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.import_probe import cli


def manifest(lora: str = "{rank: 4}", name: str = "a", extra: str = "") -> str:
    return (
        "apiVersion: loraplex.dev/v1alpha1\nkind: LoRAExperiment\n"
        f"metadata: {{name: {name}}}\nspec:\n  lora: {lora}\n  task: {{name: copy}}\n"
        f"  algorithm: {{maxSteps: 2}}\n{extra}"
    )


@pytest.mark.parametrize(
    ("case", "args", "named"),
    [
        ("missing manifest", ["run", "missing.yaml", "--model", "{model}"], "missing.yaml"),
        ("bad flag", ["run", "x.yaml", "--model", "m", "--bogus"], "--bogus"),
        ("bad value", ["run", "x.yaml", "--model", "m", "--max-rank", "abc"], "--max-rank"),
        ("bad device", ["serve", "--device", "tpu"], "--device"),
        ("no model dir", ["run", "x.yaml", "--model", "nowhere"], "model directory nowhere"),
        ("bad manifest", ["run", "bad.yaml", "--model", "{model}"], "bad.yaml"),
        ("serve no model", ["serve", "--model", "nowhere", "--insecure-no-auth"], "nowhere"),
        ("serve no --model", ["serve", "--insecure-no-auth"], "--model"),
        ("shard one rank", ["serve", "--model", "{model}", "--shard-base"], "--shard-base"),
    ],
)
def test_an_error_comes_before_torch_is_imported(
    case: str, args: list[str], named: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    (tmp_path / "x.yaml").write_text(manifest())
    (tmp_path / "bad.yaml").write_text(manifest("{rank: 0}"))
    argv = [a.format(model=tiny_model_dir) for a in args]
    code, err, heavy = cli(*argv, cwd=tmp_path, env={"LORAPLEX_MODEL": ""})
    assert code == 2, err
    assert named in err.splitlines()[-1], err
    assert "Traceback" not in err
    assert heavy == [], f"{case}: {heavy} imported before the error"


def test_a_bad_variable_comes_before_torch_is_imported(tmp_path: Path) -> None:
    code, err, heavy = cli("serve", cwd=tmp_path, env={"LORAPLEX_PORT": "eighty"})
    assert code == 2 and "(from LORAPLEX_PORT)" in err and heavy == []


def test_every_error_of_every_document_is_reported_at_once(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Not the first error of each document and "(and N more errors)": all of them, each
    naming its document and field, in one line."""
    bad_doc = manifest("{rank: 0, rnak: 4}", "b", "  rollout: {temperature: -1}\n")
    bad_doc = bad_doc.replace("kind: LoRAExperiment", "kind: Experiment")
    text = "---\n".join([manifest(), bad_doc, manifest("{rank: 128}", "c")])
    (tmp_path / "many.yaml").write_text(text)
    code, err, heavy = cli("run", "many.yaml", "--model", str(tiny_model_dir), cwd=tmp_path)
    assert code == 2 and heavy == []
    (line,) = err.splitlines()
    assert "more error" not in line
    for problem in (
        "document 1 ('b'): kind: must be LoRAExperiment",
        "document 1 ('b'): spec.lora.rank:",
        "document 1 ('b'): spec.lora.rnak: unknown field",
        "document 1 ('b'): spec.rollout.temperature:",
        "document 2 ('c'): spec.lora.rank: rank 128 exceeds the engine's max rank 64",
    ):
        assert problem in line, (problem, line)
    assert "5 problem(s)" in line


def test_only_the_target_modules_need_the_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The one manifest check that needs the model's module tree (torch) still reports
    each bad document."""
    text = manifest("{rank: 4, targetModules: [qkv_proj]}") + "---\n"
    text += manifest("{rank: 4, targetModules: [nope]}", "b")
    (tmp_path / "t.yaml").write_text(text)
    code, err, _ = cli("run", "t.yaml", "--model", str(tiny_model_dir), cwd=tmp_path)
    assert code == 2 and "2 problem(s)" in err
    assert "document 0 ('a'): spec.lora.targetModules" in err
    assert "document 1 ('b'): spec.lora.targetModules" in err
