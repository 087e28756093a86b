"""The local runner (`loraplex-engine run`, behind `make demo`) end to end at tiny size."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from loraplex_engine import cli
from loraplex_engine.local.runner import final_adapter
from loraplex_engine.spec.api_types import CheckpointRef

from tests.support.local_runs import STEPS, manifest, run_cli
from tests.support.lora_helpers import assert_peft_adapter_loads

# The summary.json schema, plus the extras README documents (per-phase seconds;
# per experiment its phase, reward curve and error): anything else is drift.
TOP_KEYS = {
    "interrupted": bool,
    "wall_seconds": float,
    "experiments": list,
    "phase_seconds": dict,
}
EXP_KEYS = {
    "id": str,
    "run_id": str,
    "name": str,
    "task": str,
    "steps": int,
    "reward_first": float,
    "reward_last": float,
    "adapter_path": str,
    "phase": str,
    "rewards": list,
    "logprob_gaps": list,
    "completion_tokens": list,
    "tis_weight_means": list,
    "tis_tokens": list,
    "evals": list,
    "rollout_versions": list,
    "error": type(None),
}


def test_summary_and_progress_carry_the_evals(tiny_model_dir, tmp_path, capsys) -> None:
    """spec.eval in a manifest: summary.json's ``evals`` holds one entry per eval (step 0,
    every everySteps, the last), the progress line the latest."""
    evaluated = manifest("say-yes", "{name: target-token, params: {target: 'yes'}}", 0)
    evaluated += "  eval: {everySteps: 4, prompts: 2, samples: 2, passAtK: 2, temperature: 1.0}\n"
    code, summary = run_cli([evaluated], tmp_path, tiny_model_dir)
    assert code == 0
    evals = summary["experiments"][0]["evals"]
    want_steps = sorted({*range(0, STEPS + 1, 4), STEPS})
    assert [e["step"] for e in evals] == want_steps
    for e in evals:
        assert set(e) == {"step", "reward", "pass_at_k", "k", "tokens"} and e["k"] == 2
        assert 0.0 <= e["reward"] <= 1.0 and 0.0 <= e["pass_at_k"] <= 1.0 and e["tokens"] > 0
    assert f"eval@{STEPS} " in capsys.readouterr().out


def _closed_port_url() -> str:
    with socket.socket() as s:  # a port nobody listens on once this socket closes
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/score"


def test_two_experiments_run_to_the_end(tiny_model_dir, tmp_path, capsys) -> None:
    """Exit 0; summary.json with exactly the documented keys and types; rewards.png;
    adapters PEFT loads as saved; progress with step, reward and tok/s. TIS (on say-yes)
    weighs every sampled token by exactly 1 under the torch rollout."""
    tis = ", offPolicyCorrection: tis, tisCap: 1.5"
    code, summary = run_cli(
        [
            manifest("say-yes", "{name: target-token, params: {target: 'yes'}}", 0, tis),
            manifest("copy-ab", "{name: copy, params: {length: '2', alphabet: ab}}", 1),
        ],
        tmp_path,
        tiny_model_dir,
    )
    assert code == 0
    assert_types(summary, TOP_KEYS)
    assert [e["name"] for e in summary["experiments"]] == ["say-yes", "copy-ab"]
    assert [e["task"] for e in summary["experiments"]] == ["target-token", "copy"]
    for exp in summary["experiments"]:
        assert_types(exp, EXP_KEYS)
        assert exp["phase"] == "Succeeded" and exp["steps"] == STEPS == len(exp["rewards"])
        assert exp["reward_first"] == pytest.approx(sum(exp["rewards"][:5]) / 5)
        assert exp["reward_last"] == pytest.approx(sum(exp["rewards"][-5:]) / 5)
        assert exp["logprob_gaps"] == []  # the torch rollout: the trainer samples itself
        assert len(exp["completion_tokens"]) == STEPS and min(exp["completion_tokens"]) > 0
        # the sync schedule: each step sampled with the weights of the step before
        assert exp["rollout_versions"] == list(range(STEPS))
        adapter = Path(exp["adapter_path"])
        # a PEFT adapter directory, not the whole checkpoint (no optimiser state)
        assert sorted(p.name for p in adapter.iterdir()) == [
            "adapter_config.json",
            "adapter_model.safetensors",
        ]
        assert_peft_adapter_loads(adapter, tiny_model_dir)
    yes, copy = summary["experiments"]
    assert yes["tis_weight_means"] == [1.0] * STEPS  # the sampler is the trainer
    assert yes["tis_tokens"] == yes["completion_tokens"]
    assert copy["tis_weight_means"] == copy["tis_tokens"] == []  # no TIS
    png = tmp_path / "out" / "rewards.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    assert_progress(capsys.readouterr().out, ["say-yes", "copy-ab"])


def test_batch_budgets_from_the_flags(tiny_model_dir, tmp_path, capsys) -> None:
    """--micro-batch-tokens and --rollout-kv-tokens reach the engine; a rollout budget
    of one row per micro-batch still trains every experiment to its end."""
    flags = ["--micro-batch-tokens", "64", "--rollout-kv-tokens", "8"]
    code, summary = run_cli(
        [manifest("a", "{name: target-token}", 0), manifest("b", "{name: target-token}", 1)],
        tmp_path,
        tiny_model_dir,
        *flags,
    )
    assert code == 0 and [e["steps"] for e in summary["experiments"]] == [STEPS, STEPS]
    assert "micro-batches of 64 tokens; rollout micro-batches of 8 KV tokens" in (
        capsys.readouterr().out
    )
    with pytest.raises(SystemExit) as bad:
        cli.main(["run", "x.yaml", "--model", "m", "--rollout-kv-tokens", "0"])
    assert bad.value.code == 2
    assert "--rollout-kv-tokens: invalid token count: '0'" in capsys.readouterr().err


def test_failed_experiment_gives_nulls_not_nan(tiny_model_dir, tmp_path, capsys) -> None:
    """A reward that fails at step 0: no rewards, no checkpoint. summary.json stays valid
    JSON (null, not NaN), names the error, and the CLI exits 1; the other one finishes."""
    bad_task = f"{{name: target-token, reward: http, rewardUrl: '{_closed_port_url()}'}}"
    (tmp_path / "out/adapters/bad").mkdir(parents=True)  # a previous run's: to be cleared
    code, summary = run_cli(
        [
            manifest("good", "{name: target-token}", 0),
            manifest("bad", bad_task, 1),
        ],
        tmp_path,
        tiny_model_dir,
    )
    assert code == 1
    good, bad = summary["experiments"]
    assert good["phase"] == "Succeeded" and isinstance(good["adapter_path"], str)
    assert bad["phase"] == "Failed" and bad["steps"] == 0 and bad["rewards"] == []
    assert bad["reward_first"] is None and bad["reward_last"] is None
    assert bad["adapter_path"] is None and not (tmp_path / "out/adapters/bad").exists()
    assert "reward failed" in bad["error"]
    assert "did not succeed: bad" in capsys.readouterr().err


def test_a_finished_experiment_without_a_checkpoint_gets_one_written() -> None:
    """The runner does not trust the engine to have checkpointed the last step."""
    written = []

    def checkpoint_experiment(exp_id: str) -> CheckpointRef:
        written.append(exp_id)
        return CheckpointRef(path=f"/ckpt/{exp_id}/step-6", step=6)

    eng = SimpleNamespace(checkpoint_experiment=checkpoint_experiment)
    done = SimpleNamespace(id="default.a", phase="Succeeded", adapter_path=None)
    failed = SimpleNamespace(id="default.b", phase="Failed", adapter_path=None)
    assert final_adapter(eng, done) == "/ckpt/default.a/step-6"
    assert final_adapter(eng, failed) is None and written == ["default.a"]


def assert_types(obj: dict[str, Any], schema: dict[str, type]) -> None:
    assert set(obj) == set(schema)
    for key, kind in schema.items():
        # bool is an int: a True "steps" would pass isinstance(…, int) unnoticed.
        assert type(obj[key]) is kind, (key, obj[key])


def assert_progress(text: str, names: list[str]) -> None:
    """The last progress block shows every experiment at its final step, with a reward
    and a positive token rate."""
    for name in names:
        pattern = rf"{name}\s+Succeeded\s+step\s+{STEPS}/{STEPS}\s+reward\s+(\S+)\s+(\S+) tok/s"
        match = re.findall(pattern, text)
        assert match, (name, text)
        reward, rate = (float(x) for x in match[-1])
        assert 0.0 <= reward <= 1.0 and rate > 0


def test_jsonl_datasets_are_read_beside_the_manifest_or_under_data_root(
    tiny_model_dir, tmp_path, capsys
) -> None:
    """The runner's data root is the manifest file's directory (or `--data-root`): a
    relative dataset is taken from there, one outside it is refused in one line."""
    row = json.dumps({"prompt": "say yes", "answer": "yes"}) + "\n"
    (tmp_path / "rows.jsonl").write_text(row)
    task = "{name: jsonl, dataset: rows.jsonl, reward: contains}"
    code, summary = run_cli([manifest("rows", task, 0)], tmp_path, tiny_model_dir)
    assert code == 0 and summary["experiments"][0]["phase"] == "Succeeded"

    elsewhere = tmp_path.parent / f"{tmp_path.name}-data"
    elsewhere.mkdir()
    (elsewhere / "rows.jsonl").write_text(row)
    path = tmp_path / "outside.yaml"
    task = f"{{name: jsonl, dataset: '{elsewhere / 'rows.jsonl'}', reward: contains}}"
    path.write_text(manifest("outside", task, 0))
    args = ["run", str(path), "--model", str(tiny_model_dir), "--out", str(tmp_path / "o2")]
    capsys.readouterr()
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "spec.task.dataset" in err and "not allowed" in err and len(err.splitlines()) == 1
    assert cli.main([*args, "--data-root", str(elsewhere)]) == 0
