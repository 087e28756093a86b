"""`loraplex-engine run` makes every spec check of the engine's admission before it loads
the model: a rank over --max-rank, an unknown reward or environment plug-in, a reward
beside an environment, an eval beside an environment, an eval dataset that is missing or
has no rows, a task dataset row that is not one, an environment's params its plug-in
refuses, a chat template the model's tokenizer lacks (for the prompts or an environment's
observations; told from the model's files, transformers not imported). Each is one line
naming its field, exit status 2, from a real `loraplex-engine run` process.

"Before the model loads" is asserted three ways, none a fixed wall-clock bound: the
process never imported torch (no model can load without it), it never printed the line
that follows the model load (``engine ready in ...``), and, measured in the same test on
the same machine, it exited sooner than a good manifest takes to reach that line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import loraplex_engine
import pytest

from tests.support.model_dirs import without_chat_template
from tests.support.server_process import engine_command

# The package under test first on the child's path (the venv's editable install may
# point at another checkout).
SOURCE = str(Path(loraplex_engine.__file__).resolve().parents[1])
LOADED = "engine ready in"  # runner.py's first line, printed once the model is loaded
# Runs the CLI, then prints, as its last stdout line, whether torch and transformers were
# ever imported.
PROBE = """
import sys
from loraplex_engine.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print(__import__("json").dumps({m: m in sys.modules for m in ("torch", "transformers")}))
sys.exit(code)
"""
START_S = 300.0  # a bound on a loaded 2-core machine, not a speed expectation


@dataclass(frozen=True)
class Outcome:
    code: int
    stdout: str
    stderr: str
    seconds: float
    torch_imported: bool
    transformers_imported: bool


def manifest(spec_extra: str = "", lora: str = "{rank: 4}", task: str = "{name: copy}") -> str:
    return (
        "apiVersion: loraplex.dev/v1alpha1\nkind: LoRAExperiment\nmetadata: {name: a}\n"
        f"spec:\n  lora: {lora}\n  task: {task}\n  algorithm: {{maxSteps: 2}}\n{spec_extra}"
    )


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": SOURCE, "LORAPLEX_MODEL": ""}


ROW = {"prompt": "2+2", "answer": "4"}
BAD_ROWS = "".join(json.dumps(r) + "\n" for r in (ROW, ROW, {"prompt": "3+3", "answer": 6}))


def run_cli(text: str, model: Path, cwd: Path) -> Outcome:
    (cwd / "m.yaml").write_text(text)
    (cwd / "empty.jsonl").write_text("")  # an eval dataset that is there, with no rows
    (cwd / "bad.jsonl").write_text(BAD_ROWS)  # a task dataset whose line 3 is no row
    argv = ["run", "m.yaml", "--model", str(model), "--out", str(cwd / "out")]
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-c", PROBE, *argv],
        capture_output=True,
        text=True,
        timeout=START_S,
        cwd=cwd,
        env=env(),
    )
    seconds = time.monotonic() - t0
    imported = json.loads(r.stdout.splitlines()[-1])
    return Outcome(
        r.returncode, r.stdout, r.stderr, seconds, imported["torch"], imported["transformers"]
    )


def run_entry(text: str, model: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The console command the README teaches (``.venv/bin/loraplex-engine run``)."""
    (cwd / "m.yaml").write_text(text)
    (cwd / "bad.jsonl").write_text(BAD_ROWS)
    argv = ["run", "m.yaml", "--model", str(model), "--out", str(cwd / "out")]
    return subprocess.run(
        [*engine_command(), *argv],
        capture_output=True,
        text=True,
        timeout=START_S,
        cwd=cwd,
        env=env(),
    )


def seconds_to_model_loaded(text: str, model: Path, cwd: Path) -> float:
    """How long a good manifest's `run` takes to print LOADED; stopped there."""
    (cwd / "good.yaml").write_text(text)
    argv = ["run", "good.yaml", "--model", str(model), "--out", str(cwd / "good-out")]
    cmd = [sys.executable, "-m", "loraplex_engine.cli", *argv]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=cwd, env=env())
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if LOADED in line:
                return time.monotonic() - t0
        raise AssertionError(f"no {LOADED!r} line; exit status {proc.wait()}")
    finally:
        proc.kill()
        proc.wait()


ENV = "{name: gsm8k, environment: {name: gsm8k-calculator}}"
CASES = [
    ("rank over --max-rank", manifest(lora="{rank: 65}"), "spec.lora.rank"),
    ("unknown reward", manifest(task="{name: copy, reward: no-such-reward}"), "spec.task.reward"),
    (
        "unknown environment",
        manifest(task="{name: gsm8k, environment: {name: no-such-env}}"),
        "spec.task.environment.name",
    ),
    (
        "reward beside an environment",
        manifest(task=ENV.replace("}}", "}, reward: exact-match}")),
        "spec.task.reward",
    ),
    ("eval beside an environment", manifest("  eval: {everySteps: 1}\n", task=ENV), "spec.eval"),
    (
        "missing eval dataset",
        manifest("  eval: {everySteps: 1, dataset: missing.jsonl}\n"),
        "spec.eval.dataset",
    ),
    (
        "eval dataset with no rows",
        manifest("  eval: {everySteps: 1, dataset: empty.jsonl}\n"),
        "spec.eval.dataset",
    ),
    (
        "environment params",
        manifest(task="{name: gsm8k, environment: {name: gsm8k-calculator, params: {x: y}}}"),
        "spec.task.environment.params.x",
    ),
    (
        "environment param value",
        manifest(task=ENV.replace("}}", ", params: {instructions: maybe}}}")),
        "spec.task.environment.params.instructions",
    ),
    ("task dataset row", manifest(task="{name: dataset, dataset: bad.jsonl}"), "spec.task.dataset"),
]
CHAT = "{name: copy, chatTemplate: true}"
CHAT_ENV = "{name: gsm8k, environment: {name: gsm8k-calculator, observationFormat: chat}}"
# A model without a chat template: (case, manifest, the field named).
CHAT_CASES = [
    ("chat prompts", manifest(task=CHAT), "spec.task.chatTemplate"),
    ("chat observations", manifest(task=CHAT_ENV), "spec.task.environment.observationFormat"),
]


@pytest.mark.parametrize(("case", "text", "field"), CASES, ids=[c[0] for c in CASES])
def test_a_spec_the_engine_refuses_fails_before_the_model_loads(
    case: str, text: str, field: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = run_cli(text, tiny_model_dir, tmp_path)
    assert out.code == 2, out.stderr
    (line,) = out.stderr.splitlines()
    assert f"document 0 ('a'): {field}:" in line, line
    assert LOADED not in out.stdout
    assert not out.torch_imported, f"{case}: torch imported before the error"


@pytest.mark.parametrize(("case", "text", "field"), CHAT_CASES, ids=[c[0] for c in CHAT_CASES])
def test_a_chat_template_the_model_lacks_fails_before_the_model_loads(
    case: str, text: str, field: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The tokenizer is read alone (no weights, no torch), as serve's PUT checks it."""
    plain = without_chat_template(tiny_model_dir, tmp_path / "plain")
    out = run_cli(text, plain, tmp_path)
    assert out.code == 2, out.stderr
    (line,) = out.stderr.splitlines()
    assert f"document 0 ('a'): {field}: the tokenizer of plain has no chat template" in line
    assert LOADED not in out.stdout
    assert not out.torch_imported, f"{case}: torch imported before the error"
    # Its files say it has none: transformers (a second or more to import) is not needed.
    assert not out.transformers_imported, f"{case}: transformers imported before the error"


def test_a_bad_task_dataset_row_is_named_by_line_and_field(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The rows the task reads, checked whole as the engine's PUT checks them; through
    the console command the README teaches."""
    text = manifest(task="{name: dataset, dataset: bad.jsonl}")
    out = run_entry(text, tiny_model_dir, tmp_path)
    assert out.returncode == 2, out.stderr
    (line,) = out.stderr.splitlines()
    assert "document 0 ('a'): spec.task.dataset: " in line, line
    assert 'bad.jsonl:3: row must be {"prompt": str, "answer": str}' in line, line
    assert "its 'answer' is a number" in line, line
    assert LOADED not in out.stdout and not (tmp_path / "out").exists()


def test_an_environment_param_is_refused_by_the_plugin_itself(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The environment's own check_params (in its plug-in worker) says why."""
    text = manifest(task=ENV.replace("}}", ", params: {instructions: maybe}}}"))
    out = run_cli(text, tiny_model_dir, tmp_path)
    assert out.code == 2, out.stderr
    assert "environment gsm8k-calculator refused its params" in out.stderr
    assert "must be true or false, not 'maybe'" in out.stderr
    assert LOADED not in out.stdout


def test_run_checks_the_manifests_once(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CLI checks the manifests before torch is imported; run_file takes them as
    checked rather than reading every dataset again. The engine is stood in for by a
    stop (the run ends where the model would load: what comes after is not checked)."""
    from loraplex_engine import cli, engine
    from loraplex_engine.local import checks

    class ModelLoad(Exception):
        pass

    def no_model(*_a: object, **_k: object) -> None:
        raise ModelLoad

    calls: list[int] = []
    real = checks.check_resources
    monkeypatch.setattr(checks, "check_resources", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(engine, "Engine", no_model)
    (tmp_path / "m.yaml").write_text(manifest())
    argv = ["run", str(tmp_path / "m.yaml"), "--model", str(tiny_model_dir)]
    with pytest.raises(ModelLoad):
        cli.main([*argv, "--out", str(tmp_path / "out")])
    assert calls == [1]


STEPS = [
    ("no room for a prompt", "  rollout: {maxNewTokens: 512}\n", "spec.rollout.maxNewTokens"),
    (
        "step over --max-step-tokens",
        "  rollout: {maxNewTokens: 8}\n",
        "spec.algorithm.promptsPerStep",
    ),
]


@pytest.mark.parametrize(("case", "extra", "field"), STEPS, ids=[s[0] for s in STEPS])
def test_a_step_over_the_engine_limits_fails_before_the_model_loads(
    case: str, extra: str, field: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The step's token cost against the model's context (512 tokens) and the step limit
    needs the model's config (torch: imported, the weights are not loaded)."""
    text = manifest(extra)
    if "promptsPerStep" in field:  # 64 x 16 rows of up to 512 tokens > 2^18
        text = text.replace("{maxSteps: 2}", "{maxSteps: 2, groupSize: 64, promptsPerStep: 16}")
    out = run_cli(text, tiny_model_dir, tmp_path)
    assert out.code == 2, out.stderr
    (line,) = out.stderr.splitlines()
    assert f"document 0 ('a'): {field}:" in line, line
    assert LOADED not in out.stdout


def test_the_error_comes_sooner_than_a_good_run_loads_its_model(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The unknown reward was the engine's 422 only after the model had loaded: now it
    comes before, measured against a good manifest's time to load on the same machine."""
    loaded_s = seconds_to_model_loaded(manifest(), tiny_model_dir, tmp_path)
    bad = run_cli(manifest(task="{name: copy, reward: no-such-reward}"), tiny_model_dir, tmp_path)
    assert bad.code == 2 and "spec.task.reward" in bad.stderr
    assert bad.seconds < loaded_s, (bad.seconds, loaded_s)
    print(f"unknown reward: exit 2 after {bad.seconds:.2f}s; a good run loaded in {loaded_s:.2f}s")
    # The checks that read a file or the tokenizer: sooner too.
    eval_text = manifest("  eval: {everySteps: 1, dataset: missing.jsonl}\n")
    missing = run_cli(eval_text, tiny_model_dir, tmp_path)
    assert missing.code == 2 and "spec.eval.dataset" in missing.stderr, missing.stderr
    plain = without_chat_template(tiny_model_dir, tmp_path / "plain")
    chat = run_cli(manifest(task=CHAT), plain, tmp_path)
    assert chat.code == 2 and "spec.task.chatTemplate" in chat.stderr, chat.stderr
    assert max(missing.seconds, chat.seconds) < loaded_s, (missing, chat, loaded_s)
    print(f"eval dataset: {missing.seconds:.2f}s; chat template: {chat.seconds:.2f}s")
