"""A dataset file with several hard links, on a real ``loraplex-engine serve``: refused by
default (a tenant that can hard-link another tenant's file into its own directory would
read it), admitted and trained on where the pool allows it
(``serve --allow-dataset-hard-links``: deduplicated or snapshot copies)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.support.server_process import EngineServer, wait_until

pytestmark = pytest.mark.slow

EXP = "team-a.linked"


def _spec(dataset: Path) -> dict:
    return {
        "lora": {"rank": 4, "alpha": 8, "targetModules": ["q_proj", "v_proj", "lm_head"]},
        "task": {"name": "jsonl", "dataset": str(dataset)},
        "algorithm": {"groupSize": 2, "promptsPerStep": 2, "learningRate": 0.05, "maxSteps": 0},
        "rollout": {"maxNewTokens": 2, "temperature": 1.0},
        "checkpoint": {"everySteps": 1000, "keep": 1},
    }


def _put(srv: EngineServer, dataset: Path):
    body = {"spec": _spec(dataset), "namespace": "team-a", "name": "linked"}
    with srv.client() as api:
        return api.put(f"/v1/experiments/{EXP}", json=body)


def test_a_hard_linked_dataset_is_refused_unless_the_flag_allows_it(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    own = tmp_path / "data" / "team-a"
    own.mkdir(parents=True)
    rows = [json.dumps({"prompt": f"{i} say yes:", "answer": "yes"}) for i in range(8)]
    (own / "rows.jsonl").write_text("\n".join(rows) + "\n")
    os.link(own / "rows.jsonl", own / "rows-copy.jsonl")  # a deduplicated copy
    args = ["--data-root", str(tmp_path / "data")]
    srv = EngineServer(tiny_model_dir, tmp_path / "ckpt", workdir=tmp_path, extra_args=args)
    with srv:
        r = _put(srv, own / "rows-copy.jsonl")
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert error["code"] == "invalid_spec" and error["field"] == "spec.task.dataset", error
        assert "2 hard links" in error["message"], error
        assert "--allow-dataset-hard-links" in error["message"], error

    srv.extra_args.append("--allow-dataset-hard-links")
    with srv, srv.client() as api:
        r = _put(srv, own / "rows-copy.jsonl")
        assert r.status_code == 201, r.text
        wait_until(lambda: api.get(f"/v1/experiments/{EXP}").json()["step"] >= 2)
        status = api.get(f"/v1/experiments/{EXP}").json()
        assert status["phase"] == "Running", status
