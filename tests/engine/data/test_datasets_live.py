"""Datasets beyond local JSONL on a real ``loraplex-engine serve`` process (issue 30 item 3):
Parquet, JSONL and a saved datasets directory read through a real S3 API (moto's server,
with IAM authentication on: a wrong key is refused) under the namespace's prefix, with the
credentials the pool's Secret gives (``LORAPLEX_S3_*``), and a saved directory from a data
root; each trains. Another namespace's URL into team-a's prefix, a URL that walks out of
its own, and a hostile object are each a 422 naming the rule or the row, while team-a's
experiment keeps training. The pure checks are test_object_store.py and
test_dataset_formats.py."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import datasets
import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from loraplex_engine.data.sources import resolve_dataset
from loraplex_engine.spec.errors import TaskError
from loraplex_engine.tasks.dataset import DatasetTask
from loraplex_engine.tenancy.object_store import ObjectStore
from loraplex_engine.tenancy.trust import TrustPolicy

from tests.support import child_processes
from tests.support.jsonl_rows import jsonl_row
from tests.support.server_process import EngineServer, engine_api_fixture, wait_until

pytestmark = pytest.mark.slow

BUCKET = "datasets"
PREFIX = "s3://datasets/{namespace}/"
TARGETS = ["q_proj", "v_proj", "lm_head"]
# moto answers the first requests unauthenticated (creating the engine's IAM user and its
# key), then checks every request's signature against its IAM users.
ADMIN_ACTIONS = 3


class S3:
    def __init__(self, url: str, key: str, secret: str):
        self.url, self.key, self.secret = url, key, secret

    def client(self, secret: str | None = None) -> Any:
        return boto3.client(
            "s3",
            endpoint_url=self.url,
            region_name="us-east-1",
            aws_access_key_id=self.key,
            aws_secret_access_key=secret or self.secret,
        )

    def store(self, secret: str | None = None) -> ObjectStore:
        credentials = {"key": self.key, "secret": secret or self.secret}
        return ObjectStore.build([PREFIX], self.url, "us-east-1", credentials)


def _start_moto(log: Path) -> tuple[subprocess.Popen[bytes], str]:
    cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "0"]
    env = {"INITIAL_NO_AUTH_ACTION_COUNT": str(ADMIN_ACTIONS), "PATH": "/usr/bin:/bin"}
    out = log.open("wb")
    proc = child_processes.spawn(cmd, "moto", stdout=out, stderr=subprocess.STDOUT, env=env)
    found = wait_until(
        lambda: re.search(r"Running on (http://127\.0\.0\.1:\d+)", log.read_text()),
        timeout=60,
    )
    return proc, found.group(1)


def _iam_user(url: str) -> tuple[str, str]:
    """The engine's user and key, allowed every S3 action (the prefix rule is the
    engine's to enforce, so the store itself does not help it)."""
    kw = {"aws_access_key_id": "admin", "aws_secret_access_key": "admin"}
    iam = boto3.client("iam", endpoint_url=url, region_name="us-east-1", **kw)
    iam.create_user(UserName="engine")
    key = iam.create_access_key(UserName="engine")["AccessKey"]
    allow = {"Effect": "Allow", "Action": "s3:*", "Resource": "*"}
    policy = json.dumps({"Version": "2012-10-17", "Statement": [allow]})
    iam.put_user_policy(UserName="engine", PolicyName="s3", PolicyDocument=policy)
    return key["AccessKeyId"], key["SecretAccessKey"]


def _parquet(table: dict[str, list[Any]]) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.table(table), buf)
    return buf.getvalue()


def _upload(s3: S3, work: Path) -> None:
    c = s3.client()
    c.create_bucket(Bucket=BUCKET)
    prompts = [f"question {i}: say yes" for i in range(200)]
    c.put_object(
        Bucket=BUCKET,
        Key="team-a/gsm.parquet",
        Body=_parquet({"question": prompts, "solution": ["yes"] * 200}),
    )
    rows = "".join(jsonl_row(p) for p in prompts)
    c.put_object(Bucket=BUCKET, Key="team-a/rows.jsonl", Body=rows.encode())
    c.put_object(
        Bucket=BUCKET,
        Key="team-a/nulls.parquet",
        Body=_parquet({"prompt": ["a", "b", None], "answer": ["y", "y", "y"]}),
    )
    saved = work / "saved"
    datasets.Dataset.from_dict({"prompt": prompts, "answer": ["yes"] * 200}).save_to_disk(
        str(saved)
    )
    for f in saved.iterdir():
        c.put_object(Bucket=BUCKET, Key=f"team-a/saved/{f.name}", Body=f.read_bytes())
    local = work / "data" / "team-a" / "gsm8k"
    split = datasets.Dataset.from_dict({"q": prompts, "a": ["yes"] * 200})
    datasets.DatasetDict({"train": split, "test": split}).save_to_disk(str(local))
    (work / "data" / "team-b").mkdir(parents=True)


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3]:
    work = tmp_path_factory.mktemp("s3")
    proc, url = _start_moto(work / "moto.log")
    try:
        store = S3(url, *_iam_user(url))
        _upload(store, work)
        store.work = work  # type: ignore[attr-defined]
        yield store
    finally:
        child_processes.kill_group(proc)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, s3: S3) -> Iterator[EngineServer]:
    work: Path = s3.work  # type: ignore[attr-defined]
    args = ["--max-prompt-tokens", "64", "--max-step-tokens", "10000"]
    args += ["--data-root", str(work / "data"), "--object-store-prefix", PREFIX]
    args += ["--object-store-endpoint", s3.url, "--object-store-region", "us-east-1"]
    # What the pool's Secret gives the engine pod (manifests.py: secretKeyRef env).
    env = {"LORAPLEX_S3_ACCESS_KEY_ID": s3.key, "LORAPLEX_S3_SECRET_ACCESS_KEY": s3.secret}
    srv = EngineServer(
        tiny_model_dir, work / "ckpt", max_adapters=4, workdir=work, extra_args=args, env=env
    )
    srv.start()
    yield srv
    srv.kill()


api = engine_api_fixture()


def _spec(dataset: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    task: dict[str, Any] = {"name": "dataset", "dataset": dataset}
    if options is not None:
        task["datasetOptions"] = options
    return {
        "lora": {"rank": 4, "alpha": 8, "targetModules": TARGETS},
        "task": task,
        "algorithm": {"groupSize": 2, "promptsPerStep": 2, "learningRate": 0.05, "maxSteps": 0},
        "rollout": {"maxNewTokens": 2, "temperature": 1.0},
        "checkpoint": {"everySteps": 1000, "keep": 1},
    }


def _put(api: httpx.Client, exp_id: str, spec: dict[str, Any]) -> httpx.Response:
    namespace, name = exp_id.split(".", 1)
    return api.put(
        f"/v1/experiments/{exp_id}", json={"spec": spec, "namespace": namespace, "name": name}
    )


def _step(api: httpx.Client, exp_id: str) -> int:
    r = api.get(f"/v1/experiments/{exp_id}")
    assert r.status_code == 200, r.text
    assert r.json()["phase"] in ("Pending", "Running"), r.json()
    return int(r.json()["step"])


def _trains(api: httpx.Client, exp_id: str, steps: int = 2) -> None:
    start = _step(api, exp_id)
    wait_until(lambda: _step(api, exp_id) >= start + steps, timeout=120)


def _refused(api: httpx.Client, exp_id: str, spec: dict[str, Any]) -> str:
    r = _put(api, exp_id, spec)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["field"] == "spec.task.dataset", error
    return str(error["message"])


def test_a_parquet_dataset_in_s3_trains_with_its_columns_mapped(api: httpx.Client) -> None:
    columns = {"prompt": "question", "answer": "solution"}
    r = _put(api, "team-a.parquet", _spec("s3://datasets/team-a/gsm.parquet", {"columns": columns}))
    assert r.status_code == 201, r.text
    _trains(api, "team-a.parquet")


def test_jsonl_and_a_saved_directory_in_s3_and_one_in_a_data_root_train(
    api: httpx.Client,
) -> None:
    local = {"format": "hf-disk", "split": "test", "columns": {"prompt": "q", "answer": "a"}}
    specs = {
        "team-a.jsonl": _spec("s3://datasets/team-a/rows.jsonl"),
        "team-a.saved": _spec("s3://datasets/team-a/saved/", {"format": "hf-disk"}),
        "team-a.local": _spec("gsm8k", local),
    }
    for exp_id, spec in specs.items():
        assert _put(api, exp_id, spec).status_code == 201, exp_id
    for exp_id in specs:
        _trains(api, exp_id, steps=1)
    for exp_id in ("team-a.jsonl", "team-a.local"):  # slots for the next test
        assert api.delete(f"/v1/experiments/{exp_id}").status_code in (200, 202, 204)


def test_urls_outside_the_namespace_prefix_fail_only_their_experiment(api: httpx.Client) -> None:
    theirs = _refused(api, "team-b.steal", _spec("s3://datasets/team-a/gsm.parquet"))
    assert "team-b's datasets must lie under s3://datasets/team-b/" in theirs
    walk = _refused(api, "team-b.walk", _spec("s3://datasets/team-b/../team-a/gsm.parquet"))
    assert "'..' segments" in walk
    escaped = _refused(api, "team-b.esc", _spec("s3://datasets/team-b/%2E%2E/team-a/gsm.parquet"))
    assert "percent-encoding" in escaped
    bucket = _refused(api, "team-b.bucket", _spec("s3://other/team-b/gsm.parquet"))
    assert "must lie under" in bucket
    null = _refused(api, "team-a.nulls", _spec("s3://datasets/team-a/nulls.parquet"))
    assert "row 2: column 'prompt' is null" in null
    missing = _refused(api, "team-a.missing", _spec("s3://datasets/team-a/nope.parquet"))
    assert "no such object" in missing
    _trains(api, "team-a.parquet")  # the bystander never stopped


def test_a_wrong_key_is_refused_by_the_store(s3: S3) -> None:
    """Without the engine: the same reader process, with a secret the store does not
    know (the credentials are really used, not ignored by the test server)."""
    url = "s3://datasets/team-a/gsm.parquet"
    for secret, ok in ((None, True), ("not-the-secret", False)):
        trust = TrustPolicy(objects=s3.store(secret))
        source = resolve_dataset(trust, url, None, "team-a")
        if ok:
            with pytest.raises(TaskError, match="no column 'prompt'"):
                DatasetTask(source)  # read: the columns are the next problem
        else:
            with pytest.raises(TaskError, match=r"gsm\.parquet: access denied") as info:
                DatasetTask(source)
            assert "not-the-secret" not in info.value.message


def test_an_eval_set_reads_any_dataset_source_under_the_same_rules(api: httpx.Client) -> None:
    """spec.eval.dataset through the training data's resolver: a Parquet object in S3 with
    its columns mapped is the eval set of an experiment that trains to the end, scored at
    every step; an eval URL into another namespace's prefix is refused naming the eval."""
    spec = _spec("s3://datasets/team-a/rows.jsonl")
    spec["algorithm"]["maxSteps"] = 2
    spec["eval"] = {
        "everySteps": 1,
        "prompts": 4,
        "dataset": "s3://datasets/team-a/gsm.parquet",
        "datasetOptions": {"columns": {"prompt": "question", "answer": "solution"}},
    }
    assert _put(api, "team-a.evals", spec).status_code == 201
    done = wait_until(
        lambda: (
            (s := api.get("/v1/experiments/team-a.evals").json())["phase"] != "Running"
            and s["phase"] != "Pending"
            and s
        ),
        timeout=180,
    )
    assert done["phase"] == "Succeeded" and done["evalStep"] == 2, done
    assert 0.0 <= done["evalReward"] <= 1.0 and done["evalTokens"] > 0, done
    assert api.delete("/v1/experiments/team-a.evals").status_code in (200, 202, 204)
    theirs = {**_spec("s3://datasets/team-b/rows.jsonl"), "task": {"name": "arithmetic"}}
    theirs["eval"] = {"dataset": "s3://datasets/team-a/gsm.parquet"}
    r = _put(api, "team-b.peek", theirs)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["field"] == "spec.eval.dataset", error
    assert "team-b's datasets must lie under s3://datasets/team-b/" in error["message"]
