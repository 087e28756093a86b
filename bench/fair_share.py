"""Fair share: a co-tenant's steps/s alone vs beside a slow, a maximal and a long-prompt
neighbour (issue 15). A benchmark, not a test: it prints and writes numbers.

    .venv/bin/python bench/fair_share.py [--seconds 45] [--threads 1] [--scenarios a,b]
                                         [--out bench/results/fair-share.json]

One real ``loraplex-engine serve`` process with the tiny model (tests' fixture), engine
defaults but ``--max-prompt-tokens 384`` (the tiny model's context is 512 tokens) and
``--max-step-tokens 32768`` (a CPU pool's setting: at the default, 262144, one maximal
step takes tens of seconds on CPU, so any co-tenant waits that long once per step). The
co-tenant (target-token, 8 x 4 rows, 16 new tokens) trains throughout; each scenario adds
one neighbour, lets it start, then counts the co-tenant's steps over ``--seconds``:

- ``alone``: no neighbour (measured first and last; the ratio uses their mean);
- ``slow_reward``: an HTTP reward service that sleeps 20 s per call (under its 30 s timeout);
- ``maximal_spec``: the largest spec the engine admits at 128 new tokens (16 x 4 rows:
  64 x (384 + 128) = 32768 tokens);
- ``long_prompt``: JSONL prompts of about 380 tokens (just under the prompt limit).
- ``slow_environment``: a multi-turn environment (the test plug-ins' ``sleeps``, installed
  as a platform installs its own) that answers each episode's turn after 0.5 s: 16 s for
  the call that carries its step's 32 episodes (under the 30 s plug-in bound). Its turns
  are off the tick's thread, its step completes in a later tick.

``--scenarios slow_environment`` runs that one only (between the two ``alone`` runs).

The target is a co-tenant at >= 70% of its steps/s alone in every scenario.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the test helpers, as tests.support

from tests.support.plugin_install import install, with_path  # noqa: E402
from tests.support.reward_server import reward_server  # noqa: E402
from tests.support.server_process import EngineServer, wait_until  # noqa: E402
from tests.support.spec_bodies import spec_body  # noqa: E402
from tests.support.tiny_models import tiny_model  # noqa: E402

COTENANT = "default.cotenant"
NEIGHBOUR = "team-b.neighbour"
SLOW_REWARD_S = 20.0
SLOW_ENVIRONMENT_S = 0.5  # per episode's turn: 16 s for the 32 of a step, one call
MAX_PROMPT_TOKENS = 384
MAX_STEP_TOKENS = 32768


def spec(task: dict[str, Any] | None = None, **numbers: int) -> dict[str, Any]:
    """Each scenario's ``group``, ``prompts``, ``new_tokens`` and ``seed`` (all four)."""
    return spec_body(task, rank=8, lr=0.02, steps=0, every=1000, keep=1, **numbers)


def slow_reward(path: str, items: list[dict[str, Any]]) -> list[float]:
    time.sleep(SLOW_REWARD_S)
    return [0.5] * len(items)


def put(api: httpx.Client, exp_id: str, body: dict[str, Any]) -> None:
    namespace, name = exp_id.split(".", 1)
    r = api.put(
        f"/v1/experiments/{exp_id}", json={"spec": body, "namespace": namespace, "name": name}
    )
    r.raise_for_status()


def step(api: httpx.Client, exp_id: str) -> int:
    return api.get(f"/v1/experiments/{exp_id}").json()["step"]


def measure(api: httpx.Client, seconds: float) -> dict[str, float]:
    """The co-tenant's (and the neighbour's, if any) steps over ``seconds``."""
    ids = [s["id"] for s in api.get("/v1/experiments").json()["experiments"]]
    t0, before = time.monotonic(), {i: step(api, i) for i in ids}
    time.sleep(seconds)
    took, after = time.monotonic() - t0, {i: step(api, i) for i in ids}
    out = {
        "seconds": round(took, 2),
        "cotenant_steps_per_s": (after[COTENANT] - before[COTENANT]) / took,
    }
    if NEIGHBOUR in after:
        out["neighbour_steps"] = after[NEIGHBOUR] - before[NEIGHBOUR]
    return out


def neighbours(reward_url: str, data: Path) -> dict[str, dict[str, Any]]:
    http = {
        "name": "target-token",
        "params": {"target": "no"},
        "reward": "http",
        "rewardUrl": reward_url,
    }
    sleeps = {"name": "sleeps", "params": {"seconds": f"{SLOW_ENVIRONMENT_S:g}"}, "maxTurns": 1}
    env = {"name": "target-token", "params": {"target": "no"}, "environment": sleeps}
    return {
        "slow_reward": spec(http, group=8, prompts=4, new_tokens=16, seed=1),
        "maximal_spec": spec(group=16, prompts=4, new_tokens=128, seed=2),
        "long_prompt": spec(
            {"name": "jsonl", "dataset": str(data)}, group=8, prompts=4, new_tokens=16, seed=3
        ),
        "slow_environment": spec(env, group=8, prompts=4, new_tokens=16, seed=4),
    }


def long_prompt_dataset(path: Path, tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    words = "the answer is a token of"
    text = words
    while len(tok(text + " " + words).input_ids) < MAX_PROMPT_TOKENS - 4:
        text += " " + words
    rows = [{"prompt": f"{text} {i}", "answer": "yes"} for i in range(16)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seconds", type=float, default=45.0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "fair-share.json")
    p.add_argument("--scenarios", default="", help="comma-separated; default: every one")
    args = p.parse_args()
    model = tiny_model()
    work = Path(tempfile.mkdtemp(prefix="fair-share-"))
    data = work / "long.jsonl"
    long_prompt_dataset(data, model)
    limits = ["--max-prompt-tokens", str(MAX_PROMPT_TOKENS)]
    limits += ["--max-step-tokens", str(MAX_STEP_TOKENS)]
    limits += ["--allow-reward-host", "127.0.0.1"]  # the slow reward service, on loopback
    plugins = with_path(install(work / "plugins"))  # the slow environment's package
    srv = EngineServer(
        model,
        work / "ckpt",
        max_adapters=4,
        threads=args.threads,
        workdir=work,
        extra_args=limits,
        env=plugins,
    )
    chosen = set(filter(None, args.scenarios.split(",")))
    results: dict[str, Any] = {}
    with reward_server(slow_reward) as reward_url, srv, srv.client() as api:
        put(api, COTENANT, spec(group=8, prompts=4, new_tokens=16, seed=0))
        wait_until(lambda: step(api, COTENANT) >= 3)
        results["alone"] = measure(api, args.seconds)
        for name, body in neighbours(f"{reward_url}/score", data).items():
            if chosen and name not in chosen:
                continue
            put(api, NEIGHBOUR, body)
            time.sleep(2.0)  # it starts: the slow reward is pending, the big step has run
            results[name] = measure(api, args.seconds)
            results[name]["neighbour_status"] = api.get(f"/v1/experiments/{NEIGHBOUR}").json()[
                "phase"
            ]
            api.delete(f"/v1/experiments/{NEIGHBOUR}").raise_for_status()
            print(name, results[name], flush=True)
        results["alone_again"] = measure(api, args.seconds)
    alone = (
        results["alone"]["cotenant_steps_per_s"] + results["alone_again"]["cotenant_steps_per_s"]
    ) / 2
    for name in set(results) - {"alone", "alone_again"}:
        results[name]["vs_alone"] = round(results[name]["cotenant_steps_per_s"] / alone, 3)
    report = {
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "engine": {"maxPromptTokens": MAX_PROMPT_TOKENS, "maxStepTokens": MAX_STEP_TOKENS,
                   "rewardDeadline": "default (1.0 s)", "threads": args.threads},
        "seconds_per_scenario": args.seconds,
        "results": results,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print("\n| scenario | co-tenant steps/s | vs alone | neighbour steps |\n|---|---|---|---|")
    for name, r in results.items():
        cells = [
            name,
            f"{r['cotenant_steps_per_s']:.2f}",
            r.get("vs_alone", ""),
            r.get("neighbour_steps", ""),
        ]
        print("| " + " | ".join(str(c) for c in cells) + " |")


if __name__ == "__main__":
    main()
