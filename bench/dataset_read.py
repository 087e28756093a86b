"""What reading a dataset at admission costs the engine (issue 30 item 3): a Parquet file
of N rows from a data root and the same file from a real S3 API (moto's server on
loopback), read by the reader process into the spool (data/spool.py).

Measured, per source: the admission's wall time, the engine process's RSS before and
after (it should grow by about the index, 16 bytes a row), the reader's peak RSS
(``RUSAGE_CHILDREN``), and the time to sample one batch of 64 rows from the spool.

    python bench/dataset_read.py --rows 1000000 --out bench/results/dataset-read.json
"""

from __future__ import annotations

import argparse
import io
import json
import random
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import boto3
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
from loraplex_engine.data.sources import resolve_dataset
from loraplex_engine.tasks.dataset import DatasetTask
from loraplex_engine.tenancy.object_store import ObjectStore
from loraplex_engine.tenancy.trust import DataRoots, TrustPolicy


def table(rows: int) -> pa.Table:
    prompts = [
        f"Question {i}: what is {i} plus {i % 97}? Answer with the number." for i in range(rows)
    ]
    answers = [str(i + i % 97) for i in range(rows)]
    return pa.table({"question": prompts, "answer": answers})


def measure(trust: TrustPolicy, dataset: str) -> dict[str, float]:
    proc = psutil.Process()
    before = proc.memory_info().rss
    t0 = time.perf_counter()
    options = None
    from loraplex_engine.spec.data_options import DatasetOptions

    options = DatasetOptions.model_validate({"columns": {"prompt": "question"}})
    task = DatasetTask(resolve_dataset(trust, dataset, options, "team-a"))
    admission_s = time.perf_counter() - t0
    after = proc.memory_info().rss
    rng = random.Random(0)
    t1 = time.perf_counter()
    for _ in range(100):
        task.sample_prompts(64, rng)
    sample_ms = (time.perf_counter() - t1) / 100 * 1000
    rows = len(task)
    task.close()
    return {
        "rows": rows,
        "admission_s": round(admission_s, 2),
        "engine_rss_growth_mb": round((after - before) / 2**20, 1),
        "sample_64_rows_ms": round(sample_ms, 3),
        "reader_peak_rss_mb": round(
            resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1
        ),
    }


def start_moto(log: Path) -> tuple[subprocess.Popen[bytes], str]:
    out = log.open("wb")
    cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "0"]
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = re.search(r"Running on (http://127\.0\.0\.1:\d+)", log.read_text())
        if found:
            return proc, found.group(1)
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("moto did not start")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dataset-read-"))
    (work / "team-a").mkdir()
    data = table(args.rows)
    pq.write_table(data, work / "team-a" / "big.parquet")
    size_mb = (work / "team-a" / "big.parquet").stat().st_size / 2**20
    results: dict[str, object] = {"rows": args.rows, "parquet_mb": round(size_mb, 1)}
    results["local"] = measure(TrustPolicy(data=DataRoots((work,))), "big.parquet")
    proc, url = start_moto(work / "moto.log")
    try:
        creds = {"key": "bench", "secret": "bench"}
        s3 = boto3.client(
            "s3", endpoint_url=url, region_name="us-east-1",
            aws_access_key_id="bench", aws_secret_access_key="bench",
        )  # fmt: skip
        s3.create_bucket(Bucket="datasets")
        buf = io.BytesIO()
        pq.write_table(data, buf)
        s3.put_object(Bucket="datasets", Key="team-a/big.parquet", Body=buf.getvalue())
        store = ObjectStore.build(["s3://datasets/{namespace}/"], url, "us-east-1", creds)
        results["s3"] = measure(TrustPolicy(objects=store), "s3://datasets/team-a/big.parquet")
    finally:
        proc.kill()
    results["load_1m"] = psutil.getloadavg()[0]
    print(json.dumps(results, indent=2))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
