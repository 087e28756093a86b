"""tinker-cookbook's recipes, from the installed package and unchanged, against a real
``loraplex-engine serve --tinker-keys`` on the tiny model: only base_url, the key and the
model's name are the recipe's own settings (tests/support/cookbook.py: the tiny model
stands in the offline hub cache as the Qwen3 instruct model the cookbook knows, so the
recipe's renderer, tokenizer and base model all resolve from that name; the datasets
the recipes load by name are small stand-ins).

The engine serves the snapshot under that hub id, the name every recipe derives its
renderer from, and under ``Qwen/Qwen3.5-9B`` (``--served-model-name``), the name
``eval.custom_evaluators`` holds in its code (the cache holds the same files under it)."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support.cookbook import (
    HUB_ID,
    QWEN3_5_ID,
    REVISION,
    HubCache,
    RecipeRun,
    build_hub_cache,
    recipe_command,
    run_recipe,
)
from tests.support.cookbook_data import cache_stand_ins, write_conversations
from tests.support.server_process import EngineServer, record_measurement
from tests.support.tinker_clients import service_client

KEY = "tml-cookbookcookbookcookbook"
RECIPE_TIMEOUT_S = 240
# The SDK's warning for each poll of a pending future answered 200 try_again.
TRY_AGAIN_WARNING = "because of try_again"


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> HubCache:
    c = build_hub_cache(tmp_path_factory.mktemp("hf"))
    cache_stand_ins(c)
    return c


@pytest.fixture(scope="module")
def server(cache: HubCache, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    work = tmp_path_factory.mktemp("cookbook")
    keys = work / "keys.txt"
    keys.write_text(f"team-a {KEY}\n")
    srv = EngineServer(  # max rank 32: the DPO recipe's own rank
        cache.model_dir, work / "ckpt", max_adapters=4, max_rank=32, workdir=work,
        extra_args=["--tinker-keys", str(keys), "--served-model-name", f"{HUB_ID},{QWEN3_5_ID}"],
    )  # fmt: skip
    with srv:
        yield srv


def recipe(
    module: str, args: list[str], server: EngineServer, cache: HubCache, tmp: Path, rank=True
) -> RecipeRun:
    """``rank=False``: a recipe whose command line has no ``lora_rank`` (its default)."""
    common = [f"base_url={server.url}", f"model_name={HUB_ID}"] + ["lora_rank=8"] * rank
    run = run_recipe(module, common + args, cache, KEY, tmp / "run", RECIPE_TIMEOUT_S)
    assert run.returncode == 0, run.output[-4000:]
    assert TRY_AGAIN_WARNING not in run.output
    return run


def _steps(run: RecipeRun, key: str) -> list[float]:
    return [m[key] for m in run.metrics if key in m]


def _record(name: str, run: RecipeRun, step_key: str, note: str) -> None:
    """The recipe's wall time, with its mean step time (its own metric) in the note."""
    steps = _steps(run, step_key)
    step_s = sum(steps) / len(steps) if steps else float("nan")
    record_measurement(f"cookbook {name} s", run.seconds, f"{note}; mean step {step_s:.3f} s")


def _saved(server: EngineServer, run: RecipeRun) -> list[str]:
    """The checkpoints (weights/<name>) of the recipe's model on the engine's volume."""
    found = re.findall(r"tinker://([^/]+)/weights/final", run.output)
    assert found, run.output[-2000:]
    weights = server.checkpoint_root / "team-a" / "_tinker" / found[-1] / "weights"
    return sorted(p.name for p in weights.iterdir())


def test_the_engine_serves_the_snapshot_under_the_names_given(server: EngineServer) -> None:
    # (a hub cache snapshot's default name, its repo id: tests/engine/test_served_names.py)
    caps = server.client().get("/api/v1/get_server_capabilities", headers={"X-API-Key": KEY})
    assert [m["model_name"] for m in caps.json()["supported_models"]] == [HUB_ID, QWEN3_5_ID]
    # the directory's own name, the one it had before, is still taken (not listed)
    client = service_client(server.url, KEY)
    tc = client.create_lora_training_client(base_model=REVISION, rank=2).result()
    assert tc.get_info().model_data.model_name == HUB_ID
    assert tc.get_info().model_data.tokenizer_id == HUB_ID


def test_sl_loop_runs_and_lowers_the_loss(server, cache, tmp_path) -> None:
    args = ["batch_size=4", "learning_rate=1e-3", "save_every=2"]
    run = recipe("tinker_cookbook.recipes.sl_loop", args, server, cache, tmp_path)
    nll = _steps(run, "train_mean_nll")
    assert len(nll) == 4 and nll[-1] < nll[0], nll
    assert "final" in _saved(server, run) and "000002" in _saved(server, run)
    _record("sl_loop", run, "time_total", f"4 steps, nll {nll[0]:.3f}->{nll[-1]:.3f}")


def test_chat_sl_runs_supervised_train_and_lowers_the_loss(server, cache, tmp_path) -> None:
    data = write_conversations(tmp_path / "conversations.jsonl")
    args = [
        f"dataset={data}", "batch_size=4", "learning_rate=1e-3", "save_every=2",
        "behavior_if_log_dir_exists=delete",
    ]  # fmt: skip
    run = recipe("tinker_cookbook.recipes.chat_sl.train", args, server, cache, tmp_path)
    nll = _steps(run, "train_mean_nll")
    assert len(nll) == 4 and nll[-1] < nll[0], nll
    assert "final" in _saved(server, run)
    _record("chat_sl", run, "time/step", f"4 steps, nll {nll[0]:.3f}->{nll[-1]:.3f}")


def test_rl_loop_with_its_default_loss_runs_to_its_end(server, cache, tmp_path) -> None:
    # Its default loss, stable_reinforce: every sample is recorded (record_stability_info)
    # and answers sequence ids. The random tiny model never writes \boxed{...}: every
    # reward is 0, so the recipe skips its updates (all advantages zero); sampling,
    # recording, grading and checkpoints run.
    args = ["batch_size=2", "group_size=4", "max_tokens=8"]
    run = recipe("tinker_cookbook.recipes.rl_loop", args, server, cache, tmp_path)
    assert _steps(run, "reward/total") == [0.0] * 4
    assert "final" in _saved(server, run)
    _record("rl_loop", run, "time/total", "4 steps of 2x4 samples, 8 tokens, reward 0")


def test_dpo_lowers_its_loss_and_its_checkpoint_downloads(server, cache, tmp_path) -> None:
    args = ["batch_size=4", "learning_rate=1e-3", "max_length=256"]
    args.append("behavior_if_log_dir_exists=delete")
    run = recipe(
        "tinker_cookbook.recipes.preference.dpo.train", args, server, cache, tmp_path, False
    )
    loss = _steps(run, "dpo_loss")
    assert len(loss) == 4 and loss[0] == pytest.approx(0.6931, abs=1e-3) and loss[-1] < loss[0]
    assert _steps(run, "accuracy")[-1] == 1.0  # every chosen answer now the likelier
    _record("dpo", run, "time/total", f"4 steps of 4 pairs, dpo_loss {loss[0]:.3f}->{loss[-1]:.3f}")
    final = re.findall(r"tinker://[^'\"]+/weights/final", run.output)[-1]
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "tinker"), "checkpoint", "download", final,
         "--output", str(tmp_path / "dl")],
        env=cache.env(KEY) | {"TINKER_BASE_URL": server.url},
        capture_output=True, text=True, timeout=RECIPE_TIMEOUT_S,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (got,) = (tmp_path / "dl").iterdir()
    assert json.loads((got / "adapter_config.json").read_text())["r"] == 32  # DPO's own rank
    assert (got / "adapter_model.safetensors").stat().st_size > 0


def test_on_policy_distillation_runs_to_its_end(server, cache, tmp_path) -> None:
    # The teacher is the base model: the student starts equal to it (LoRA's B is zero), so
    # the reverse KL it minimises starts at 0 and stays at noise level.
    args = [
        f"teacher_model={HUB_ID}", "dataset=deepmath", "groups_per_batch=2", "group_size=2",
        "max_tokens=8", "learning_rate=1e-3", "behavior_if_log_dir_exists=delete",
    ]  # fmt: skip
    module = "tinker_cookbook.recipes.distillation.on_policy_distillation"
    run = recipe(module, args, server, cache, tmp_path)
    kl = _steps(run, "teacher_kl")
    assert len(kl) == 4 and abs(kl[0]) < 1e-5 and all(abs(v) < 0.05 for v in kl), kl
    assert "final" in _saved(server, run)
    _record("on_policy_distillation", run, "time/total", f"4 steps of 2x2 samples, kl {kl}")


def test_math_rl_runs_the_async_off_policy_path(server, cache, tmp_path) -> None:
    # max_steps_off_policy: the cookbook's async RL loop (sampling runs ahead of training),
    # with its default loss, stable_reinforce.
    args = [
        "env=arithmetic", "group_size=4", "groups_per_batch=2", "max_tokens=5", "max_steps=4",
        "max_steps_off_policy=2", "eval_every=0",
        "learning_rate=1e-3", "behavior_if_log_dir_exists=delete",
    ]  # fmt: skip
    run = recipe("tinker_cookbook.recipes.math_rl.train", args, server, cache, tmp_path)
    reward = _steps(run, "env/all/reward/total")
    assert len(reward) == 4, run.output[-2000:]
    # every step trained with the default loss, stable_reinforce (the metric is computed
    # from its forward_backward's answer)
    assert len(_steps(run, "optim/kl_sample_train_v1")) == 4, run.output[-2000:]
    assert "final" in _saved(server, run)
    _record("math_rl async", run, "time/total", f"4 steps of 2x4 samples, reward {reward}")


def test_math_rl_runs_rl_train_synchronously(server, cache, tmp_path) -> None:
    # No max_steps_off_policy: rl.train's synchronous loop (sample, then train, each step),
    # with its default loss, stable_reinforce.
    args = [
        "env=arithmetic", "group_size=4", "groups_per_batch=2", "max_tokens=5", "max_steps=4",
        "eval_every=0", "learning_rate=1e-3",
        "behavior_if_log_dir_exists=delete",
    ]  # fmt: skip
    run = recipe("tinker_cookbook.recipes.math_rl.train", args, server, cache, tmp_path)
    reward = _steps(run, "env/all/reward/total")
    assert len(reward) == 4, run.output[-2000:]
    assert len(_steps(run, "optim/kl_sample_train_v1")) == 4, run.output[-2000:]  # trained
    assert "final" in _saved(server, run)
    _record("math_rl sync", run, "time/total", f"4 steps of 2x4 samples, reward {reward}")


def _checkpoint_names(log_path: Path) -> list[str]:
    found = log_path / "checkpoints.jsonl"
    lines = found.read_text().splitlines() if found.exists() else []
    return [json.loads(line)["name"] for line in lines if line.endswith("}")]


def test_sl_loop_killed_mid_run_resumes_from_its_last_checkpoint(server, cache, tmp_path) -> None:
    common = [f"base_url={server.url}", f"model_name={HUB_ID}", "lora_rank=8"]
    args = [*common, "batch_size=2", "learning_rate=1e-3", "save_every=2"]  # 8 steps
    module, log_path = "tinker_cookbook.recipes.sl_loop", tmp_path / "run"
    first = subprocess.Popen(
        recipe_command(module, args, log_path), env=cache.env(KEY), cwd=tmp_path,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + RECIPE_TIMEOUT_S
    while "000004" not in _checkpoint_names(log_path) and time.monotonic() < deadline:
        time.sleep(0.02)
    first.kill()
    first.wait()
    assert "final" not in _checkpoint_names(log_path)  # killed before its end
    run = run_recipe(module, args, cache, KEY, log_path, RECIPE_TIMEOUT_S, fresh=False)
    assert run.returncode == 0, run.output[-4000:]
    resumed_from = int(re.findall(r"Resuming from batch (\d+)", run.output)[0])
    assert resumed_from >= 4
    steps = [m["step"] for m in run.metrics]
    assert steps[-1] == 7 and "final" in _checkpoint_names(log_path)
    # metrics.jsonl holds both runs: the rerun's first step starts from trained weights
    # (by hand: 5.99 at batch 4; the untrained model's 6.23 at batch 0, 6.18 at batch 4)
    nll = {m["step"]: m["train_mean_nll"] for m in run.metrics}  # the rerun's win
    assert nll[resumed_from] < nll[0] - 0.1, nll
    _record("sl_loop resumed", run, "time_total", f"resumed from batch {resumed_from} of 8")


def test_two_recipes_of_different_ranks_train_at_once(server, cache, tmp_path) -> None:
    def one(rank: int) -> RecipeRun:
        args = [f"base_url={server.url}", f"model_name={HUB_ID}", f"lora_rank={rank}"]
        args += ["batch_size=4", "learning_rate=1e-3"]
        log_path = tmp_path / f"rank{rank}"
        return run_recipe(
            "tinker_cookbook.recipes.sl_loop", args, cache, KEY, log_path, RECIPE_TIMEOUT_S
        )

    with ThreadPoolExecutor(2) as pool:
        runs = dict(zip((4, 32), pool.map(one, (4, 32)), strict=True))
    for rank, run in runs.items():
        assert run.returncode == 0, run.output[-4000:]
        nll = _steps(run, "train_mean_nll")
        assert len(nll) == 4 and nll[-1] < nll[0], (rank, nll)
        model = re.findall(r"tinker://([^/]+)/weights/final", run.output)[-1]
        final = server.checkpoint_root / "team-a" / "_tinker" / model / "weights" / "final"
        (config,) = final.rglob("adapter_config.json")
        assert json.loads(config.read_text())["r"] == rank
    _record("sl_loop rank 4 with rank 32", runs[4], "time_total", "4 steps each, at once")


def test_the_cookbook_gsm8k_benchmark_grades_the_engine_s_samples(server, cache, tmp_path) -> None:
    # The random model scores 0 (its 16 tokens never hold the answer); sampling through
    # the engine, grading and saving run.
    script = Path(__file__).parents[4] / "tests" / "support" / "cookbook_benchmark.py"
    proc = subprocess.run(
        [sys.executable, str(script), server.url, HUB_ID, str(tmp_path / "bench")],
        env=cache.env(KEY), capture_output=True, text=True, timeout=RECIPE_TIMEOUT_S,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert (result["num_examples"], result["num_errors"], result["score"]) == (2, 0, 0.0)
    assert any((tmp_path / "bench").rglob("*.jsonl"))  # the graded trajectories
    record_measurement("cookbook gsm8k benchmark s", result["s"], "2 examples, 16 tokens")


def test_custom_evaluators_runs_its_own_main_against_the_engine(server, cache, tmp_path) -> None:
    # Its __main__ as shipped: QA_DATASET (3 questions) in code, Qwen/Qwen3.5-9B's
    # tokenizer and base model, renderer qwen3_5_disable_thinking (its parse_response needs
    # the cache's one-token </think>); the engine reached through TINKER_BASE_URL.
    asked = server.log_text().count("POST /api/v1/asample 200")
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "tinker_cookbook.eval.custom_evaluators"],
        env=cache.env(KEY) | {"TINKER_BASE_URL": server.url},
        capture_output=True, text=True, timeout=RECIPE_TIMEOUT_S, cwd=tmp_path,
    )  # fmt: skip
    seconds = time.monotonic() - t0
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    assert set(result) == {"accuracy"} and 0.0 <= result["accuracy"] <= 1.0, result
    # one sample a question, answered by the engine
    assert server.log_text().count("POST /api/v1/asample 200") - asked == 3
    record_measurement("cookbook custom_evaluators s", seconds, f"3 questions, {result}")
