"""Failures stay contained: a bad experiment fails alone, a crash loses no checkpoint."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import torch
from loraplex_engine.spec.errors import (
    BadCheckpointError,
    ConflictError,
    InvalidSpecError,
    NoCapacityError,
)

from tests.support.engine_builders import engine, run_to_end, spec
from tests.support.paths import REPO_ROOT


class _BrokenReward(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.send_response(500)
        self.end_headers()
        self.wfile.write(b"reward function raised ZeroDivisionError")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def broken_reward_url():
    server = HTTPServer(("127.0.0.1", 0), _BrokenReward)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/score"
    server.shutdown()


def test_reward_that_raises_fails_only_its_experiment(tiny_model_dir, tmp_path, broken_reward_url):
    eng = engine(tiny_model_dir, tmp_path)
    bad_task = {"name": "target-token", "reward": "http", "rewardUrl": broken_reward_url}
    eng.put_experiment("default.good", spec(steps=4), "default", "good")
    eng.put_experiment("default.bad", spec(bad_task, steps=4), "default", "bad")
    run_to_end(eng, ["default.good", "default.bad"])
    bad, good = (
        eng.get_experiment("default.bad"),
        eng.get_experiment("default.bad".replace("bad", "good")),
    )
    assert bad.phase == "Failed" and bad.step == 0
    assert "reward failed" in bad.error and "500" in bad.error
    assert good.phase == "Succeeded" and good.step == 4


def test_diverged_adapter_fails_alone_and_keeps_its_last_checkpoint(tiny_model_dir, tmp_path):
    eng = engine(tiny_model_dir, tmp_path)
    eng.put_experiment("default.good", spec(steps=4, every=2), "default", "good")
    eng.put_experiment("default.nan", spec(steps=4, every=2, seed=1), "default", "nan")
    eng.tick()
    eng.tick()  # both checkpoint at step 2
    slot = eng.model.slot_of("default.nan")
    with torch.no_grad():  # fault injection: the adapter's weights blow up
        next(iter(eng.model.lora_layers.values())).lora_B[slot].fill_(float("nan"))
    run_to_end(eng, ["default.good", "default.nan"])
    bad = eng.get_experiment("default.nan")
    assert bad.phase == "Failed" and "non-finite" in bad.error
    assert bad.checkpoint.step == 2
    saved = Path(bad.checkpoint.path) / "adapter_model.safetensors"
    from safetensors.torch import load_file

    assert all(torch.isfinite(t).all() for t in load_file(saved).values())
    assert eng.get_experiment("default.good").phase == "Succeeded"


def test_kill_9_then_resume_continues_the_same_run(tiny_model_dir, tmp_path):
    body = spec(steps=8, every=3).to_json()
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.support.train_worker",
            str(tiny_model_dir),
            str(tmp_path / "crashed"),
            json.dumps(body),
        ],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    for line in worker.stdout:  # wait for progress past the step-3 checkpoint
        if int(line) >= 4:
            break
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    ckpts = sorted((tmp_path / "crashed" / "default" / "crash").glob("*/step-*"))
    assert [p.name for p in ckpts] == ["step-00000003"], "no half-written checkpoint is left"

    resumed = engine(tiny_model_dir, tmp_path / "crashed")
    status, _ = resumed.put_experiment(
        "default.crash", spec(steps=8, every=3), "default", "crash", resume_from=str(ckpts[-1])
    )
    assert status.step == 3
    tail = run_to_end(resumed, ["default.crash"])["default.crash"]

    straight = engine(tiny_model_dir, tmp_path / "straight")
    straight.put_experiment("default.crash", spec(steps=8, every=3), "default", "crash")
    full = run_to_end(straight, ["default.crash"])["default.crash"]
    assert len(tail) == 5
    assert tail == pytest.approx(full[3:], abs=1e-6)
    for key, value in straight.model.adapter_state_dict("default.crash").items():
        torch.testing.assert_close(resumed.model.adapter_state_dict("default.crash")[key], value)


def test_checkpoint_settings_edited_between_placements_apply_on_resume(tiny_model_dir, tmp_path):
    """spec.checkpoint is the one training-side block the CRD lets users edit: a loaded
    experiment keeps the settings it was given (a PUT with others is a 409), the next
    placement (resume from its checkpoint) writes and prunes by the edited ones."""
    eng = engine(tiny_model_dir, tmp_path)
    small = {"group": 2, "prompts": 2, "steps": 6}
    eng.put_experiment("default.ck", spec(every=2, keep=3, **small), "default", "ck")
    eng.tick()
    eng.tick()
    with pytest.raises(ConflictError, match="different spec"):
        eng.put_experiment("default.ck", spec(every=3, keep=2, **small), "default", "ck")
    unloaded = eng.remove_experiment("default.ck")
    assert unloaded.checkpoint is not None and unloaded.checkpoint.step == 2

    status, created = eng.put_experiment(
        "default.ck",
        spec(every=3, keep=2, **small),
        "default",
        "ck",
        resume_from=unloaded.checkpoint.path,
    )
    assert created and status.step == 2
    run_to_end(eng, ["default.ck"])
    assert eng.get_experiment("default.ck").phase == "Succeeded"
    # every 2, keep 3 would have left step-2, step-4 and step-6
    exp_dir = tmp_path / "default" / "ck"
    assert [p.name for p in exp_dir.iterdir()] == [status.run_id]  # one run, resumed
    kept = sorted(p.name for p in (exp_dir / status.run_id).glob("step-*"))
    assert kept == ["step-00000003", "step-00000006"]


def test_bad_requests_change_nothing(tiny_model_dir, tmp_path):
    eng = engine(tiny_model_dir, tmp_path, max_adapters=1, max_registered=1)  # no paging
    with pytest.raises(InvalidSpecError) as err:
        eng.put_experiment("default.big", spec(lora={"rank": 64, "alpha": 16}), "default", "big")
    assert err.value.field == "spec.lora.rank"
    with pytest.raises(InvalidSpecError) as err:
        eng.put_experiment(
            "default.odd",
            spec(lora={"rank": 4, "alpha": 8, "targetModules": ["conv"]}),
            "default",
            "odd",
        )
    assert err.value.field == "spec.lora.targetModules"
    bogus = tmp_path / "default" / "r" / "bogus"  # in its own directory: tenancy/trust.py
    bogus.mkdir(parents=True)
    with pytest.raises(BadCheckpointError, match=r"adapter_config\.json"):
        eng.put_experiment("default.r", spec(), "default", "r", resume_from=str(bogus))
    assert eng.list_experiments() == [] and eng.model.free_slots() == [1]
    eng.put_experiment("default.one", spec(), "default", "one")
    with pytest.raises(NoCapacityError):
        eng.put_experiment("default.two", spec(), "default", "two")
    assert [s.id for s in eng.list_experiments()] == ["default.one"]


def test_a_spec_asking_for_too_much_work_per_step_is_refused(tiny_model_dir, tmp_path):
    eng = engine(tiny_model_dir, tmp_path, max_step_tokens=4000, max_prompt_tokens=24)
    # 16 x 8 rows x (24 prompt + 8 new) tokens; prompts count, not only completions.
    with pytest.raises(InvalidSpecError, match=r"= 4096 tokens per step .* limit of 4000") as err:
        eng.put_experiment("default.big", spec(group=16, prompts=8), "default", "big")
    assert err.value.field == "spec.algorithm.promptsPerStep"
    assert eng.list_experiments() == [] and len(eng.model.free_slots()) == 4


def _record_rollout_prompts(eng) -> list[str]:
    """Every prompt the rollout backend is asked to complete, decoded, from now on."""
    seen: list[str] = []
    generate = eng.backend.generate

    def recording(requests):
        seen.extend(eng.tokenizer.decode(r.prompt_ids, skip_special_tokens=True) for r in requests)
        return generate(requests)

    eng.backend.generate = recording
    return seen


def test_continual_experiment_reads_appended_rows_and_publishes_versions(tiny_model_dir, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "say yes", "answer": "yes"}) + "\n")
    eng = engine(tiny_model_dir, tmp_path / "ckpt")
    task = {"name": "jsonl", "dataset": str(data), "reward": "contains"}
    eng.put_experiment("default.live", spec(task, steps=0, every=2, keep=10), "default", "live")
    rolled_out = _record_rollout_prompts(eng)
    for _ in range(4):
        eng.tick()
    assert set(rolled_out) == {"say yes"}
    rolled_out.clear()
    with data.open("a") as f:
        for i in range(3):
            f.write(json.dumps({"prompt": f"new row {i}", "answer": "no"}) + "\n")
    versions = set()
    for _ in range(4):
        eng.tick()
        versions.add(eng.get_experiment("default.live").adapter_path)
    status = eng.get_experiment("default.live")
    assert status.phase == "Running" and status.step == 8 and status.max_steps == 0
    assert len(eng._experiments["default.live"].task) == 4  # the appended rows are in
    # ... and reach the rollouts: 16 draws from 4 rows (seeded) include the new ones.
    assert {t for t in rolled_out if t.startswith("new row")}, rolled_out
    # the adapter published at steps 4, 6 and 8 (every 2) as the policy went on learning
    assert sorted(Path(v).name for v in versions) == [
        "step-00000004",
        "step-00000006",
        "step-00000008",
    ]
    published = sorted(p.name for p in (tmp_path / "ckpt/default/live").glob("*/step-*"))
    assert published == ["step-00000002", "step-00000004", "step-00000006", "step-00000008"]


def test_demo_cli_rejects_bad_manifests_up_front(tiny_model_dir, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "apiVersion: loraplex.dev/v1alpha1\nkind: LoRAExperiment\nmetadata: {name: a}\n"
        "spec: {task: {name: nope}}\n---\n"
        "apiVersion: loraplex.dev/v1alpha1\nkind: LoRAExperiment\nmetadata: {name: b}\n"
        "spec: {lora: {rank: 128}, task: {name: copy}}\n---\n"
        "apiVersion: loraplex.dev/v1alpha1\nkind: LoRAExperiment\nmetadata: {name: c}\n"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "loraplex_engine.cli",
            "run",
            str(bad),
            "--model",
            str(tiny_model_dir),
            "--out",
            str(tmp_path / "out"),
            "--max-rank",
            "64",
        ],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 2
    assert "spec.task.name" in result.stderr
    assert "spec.lora.rank" in result.stderr
    assert "document 2 ('c'): spec" in result.stderr
    assert not (tmp_path / "out").exists()
