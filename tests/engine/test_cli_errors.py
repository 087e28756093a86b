"""A user's mistake at `loraplex-engine` is one line on stderr naming it, exit status 2.

Each case checks: status 2, exactly one line on stderr, no traceback, the field or path
at fault named in it, and nothing trained (no output directory, nothing on stdout: the
model's weights were never loaded). Most call the CLI's ``main`` in this process, its
output captured: what they check is the line and the status ``main`` returns. The cases
marked ``entry`` run the installed console command in a subprocess, as a user would:
they prove what only a process shows (the exit status and stderr of the real entry
point, serve failing to listen, the installed package's version).
"""

from __future__ import annotations

import importlib.metadata
import logging
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from loraplex_engine.cli import main

from tests.support.engine_cli import Outcome, assert_usage_error, engine_cli

Cli = Callable[..., Outcome]


def manifest(lora: str = "{rank: 4, targetModules: [q_proj, v_proj]}", name: str = "a") -> str:
    return (
        "apiVersion: loraplex.dev/v1alpha1\nkind: LoRAExperiment\n"
        f"metadata: {{name: {name}}}\nspec:\n  lora: {lora}\n  task: {{name: copy}}\n"
        "  algorithm: {maxSteps: 2}\n"
    )


@pytest.fixture
def cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> Iterator[Cli]:
    """``main(args)`` in this process, in ``tmp_path``, with ``env`` set, its output
    captured; the root logger as it was after (`run` sets it up before its model loads)."""
    monkeypatch.chdir(tmp_path)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level

    def call(*args: str, env: dict[str, str] | None = None) -> Outcome:
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        capsys.readouterr()
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's own usage errors
            code = e.code if isinstance(e.code, int) else 1
        out = capsys.readouterr()
        return Outcome(code, out.out, out.err)

    yield call
    root.handlers[:], root.level = handlers, level
    logging.captureWarnings(False)


def run_manifests(
    tmp_path: Path, text: str | None, model: Path, *flags: str, cli: Cli | None = None
) -> Outcome:
    """`loraplex-engine run` on ``text`` (None: no manifest file), checking nothing ran;
    through ``cli`` (main in this process), else the console command."""
    path = tmp_path / "experiments.yaml"
    if text is not None:
        path.write_text(text)
    out = tmp_path / "out"
    args = ("run", str(path), "--model", str(model), "--out", str(out), *flags)
    r = cli(*args) if cli is not None else engine_cli(*args, cwd=tmp_path)
    assert r.stdout == ""  # "engine ready ..." would mean the weights were loaded
    assert not out.exists(), "an output directory was written"
    return r


def test_an_unknown_target_module_is_refused_before_the_model_loads(
    tiny_model_dir: Path, tmp_path: Path, cli: Cli
) -> None:
    text = manifest("{rank: 4, targetModules: [q_proj, qkv_proj]}")
    line = assert_usage_error(
        run_manifests(tmp_path, text, tiny_model_dir, cli=cli),
        "experiments.yaml",
        "document 0 ('a')",
        "spec.lora.targetModules",
        "qkv_proj",
    )
    assert "v_proj" in line  # the modules this model does have, to pick from


def test_a_missing_manifest_file_is_named(tiny_model_dir: Path, tmp_path: Path, cli: Cli) -> None:
    r = run_manifests(tmp_path, None, tiny_model_dir, cli=cli)
    assert_usage_error(r, f"manifest file {tmp_path / 'experiments.yaml'}", "No such file")


@pytest.mark.parametrize("kind", ["missing", "empty", "a file"])
def test_a_model_directory_that_is_not_one_is_named(tmp_path: Path, kind: str, cli: Cli) -> None:
    model = tmp_path / "model"
    if kind == "empty":
        model.mkdir()
    elif kind == "a file":
        model.write_text("not a model")
    r = run_manifests(tmp_path, manifest(), model, cli=cli)
    why = {"missing": "does not exist", "empty": "has no config.json", "a file": "not a directory"}
    assert_usage_error(r, f"model directory {model}", why[kind])


def test_a_model_directory_with_a_broken_config_is_named(tmp_path: Path, cli: Cli) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "no-such-architecture"}')
    r = run_manifests(tmp_path, manifest(), model, cli=cli)
    assert_usage_error(r, f"model directory {model}: config.json:")


def test_yaml_that_does_not_parse_names_file_and_line(tiny_model_dir: Path, tmp_path: Path) -> None:
    """entry: the console command's one line and exit status."""
    r = run_manifests(tmp_path, manifest() + "  rollout: [1,\n", tiny_model_dir)
    assert_usage_error(r, "experiments.yaml", "invalid YAML: line 9")


def test_specs_that_fail_validation_name_each_document_and_field(
    tiny_model_dir: Path, tmp_path: Path, cli: Cli
) -> None:
    bad = {
        "b": ("{rank: 0}", "spec.lora.rank"),
        "c": ("{rnak: 4}", "spec.lora.rnak: unknown field"),
        "d": ("{rank: 128}", "spec.lora.rank: rank 128 exceeds the engine's max rank 64"),
    }
    text = "---\n".join([manifest(), *(manifest(lora, name) for name, (lora, _) in bad.items())])
    r = run_manifests(tmp_path, text, tiny_model_dir, cli=cli)
    line = assert_usage_error(r, "3 problem(s)")
    for index, (name, (_, field)) in enumerate(bad.items(), start=1):
        assert f"document {index} ('{name}'): {field}" in line, line


def test_more_experiments_than_slots_names_the_flag(
    tiny_model_dir: Path, tmp_path: Path, cli: Cli
) -> None:
    text = manifest() + "---\n" + manifest(name="b")
    r = run_manifests(tmp_path, text, tiny_model_dir, "--max-adapters", "1", cli=cli)
    assert_usage_error(r, "2 experiments", "--max-adapters")


def test_a_device_that_is_not_one_is_named(tiny_model_dir: Path, tmp_path: Path, cli: Cli) -> None:
    """A value --device does not take: argparse's usage error (its usage, then one line
    naming the flag, the value and the choices), nothing loaded."""
    r = run_manifests(tmp_path, manifest(), tiny_model_dir, "--device", "gpu", cli=cli)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    line = r.stderr.splitlines()[-1]
    assert "argument --device: invalid device: 'gpu'; choose auto, cpu, cuda or cuda:N" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has the GPU asked for")
@pytest.mark.parametrize(
    "flags", [["--device", "cuda"], ["--device", "cuda:1", "--world-size", "2"]]
)
def test_a_cuda_device_this_machine_lacks_is_named(
    tiny_model_dir: Path, tmp_path: Path, flags: list[str], cli: Cli
) -> None:
    r = run_manifests(tmp_path, manifest(), tiny_model_dir, *flags, cli=cli)
    assert_usage_error(r, f"--device {flags[1]}", "torch sees no CUDA device")


def test_a_vllm_rollout_without_a_vllm_python_is_named(
    tiny_model_dir: Path, tmp_path: Path, cli: Cli
) -> None:
    path = tmp_path / "experiments.yaml"
    path.write_text(manifest())
    out = tmp_path / "out"
    r = cli(
        "run", str(path), "--model", str(tiny_model_dir), "--out", str(out),
        "--rollout-backend", "vllm", env={"LORAPLEX_VLLM_PYTHON": ""},
    )  # fmt: skip
    assert_usage_error(r, "--rollout-backend vllm", "LORAPLEX_VLLM_PYTHON")
    assert r.stdout == "" and not out.exists()


def test_an_output_path_that_is_a_file_is_named(
    tiny_model_dir: Path, tmp_path: Path, cli: Cli
) -> None:
    (tmp_path / "experiments.yaml").write_text(manifest())
    taken = tmp_path / "taken"
    taken.write_text("")
    r = cli("run", "experiments.yaml", "--model", str(tiny_model_dir), "--out", str(taken / "out"))
    assert_usage_error(r, f"output directory {taken / 'out'}")
    assert r.stdout == ""


def test_serve_refuses_a_missing_model_before_listening(tmp_path: Path) -> None:
    """entry: serve's console command, its one line and exit status."""
    r = engine_cli(
        "serve", "--model", str(tmp_path / "nowhere"), "--insecure-no-auth", cwd=tmp_path
    )
    assert_usage_error(r, f"model directory {tmp_path / 'nowhere'} does not exist")


@pytest.mark.parametrize(
    ("option", "named"), [("sleep_mode=true", "sleep_mode"), ("device=cuda:1", "'cuda:1'")]
)
def test_serve_refuses_a_gpu_only_vllm_placement_on_the_cpu(
    tiny_model_dir: Path, option: str, named: str, cli: Cli
) -> None:
    r = cli(
        "serve", "--model", str(tiny_model_dir), "--insecure-no-auth", "--device", "cpu",
        "--rollout-backend", "vllm", "--vllm-option", option,
    )  # fmt: skip
    assert_usage_error(r, named)


def test_serve_names_a_port_it_cannot_listen_on(tiny_model_dir: Path, tmp_path: Path) -> None:
    """entry: a process that loaded its model and cannot listen exits with one line."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        r = engine_cli(
            "serve", "--model", str(tiny_model_dir), "--insecure-no-auth",
            "--host", "127.0.0.1", "--port", port,
            cwd=tmp_path, env={"LORAPLEX_LOG_LEVEL": "error"},
        )  # fmt: skip
    assert_usage_error(r, f"cannot listen on 127.0.0.1:{port}")


def test_tiny_model_and_import_gguf_name_their_bad_flags(tmp_path: Path, cli: Cli) -> None:
    r = cli("tiny-model", "--out", "m", "--preset", "huge")
    assert_usage_error(r, "--preset 'huge'", "tiny")
    r = cli("import-gguf", "--gguf", "nowhere.gguf", "--out", "m")
    assert_usage_error(r, "--gguf nowhere.gguf")
    assert not (tmp_path / "m").exists()


def test_version_prints_the_package_version(tmp_path: Path) -> None:
    """entry: the installed package's console command and its metadata."""
    r = engine_cli("--version", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"loraplex-engine {importlib.metadata.version('loraplex-engine')}"
