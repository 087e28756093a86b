#!/usr/bin/env python3
"""Write samples/local/gsm8k-sample.jsonl: generated GSM8K-style problems in GSM8K's own
row format (``{"question": ..., "answer": "<steps>\\n#### <n>"}``), so the dataset path
(task ``dataset`` with ``datasetOptions.columns: {prompt: question}``) has a file to read
where no dataset can be downloaded. Seeded: rerunning writes the same bytes
(tests/engine/tasks/test_gsm8k.py checks the committed file is what this writes).

    scripts/gen_gsm8k_sample.py [--out PATH] [--rows N] [--seed S] [--max-steps K]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from loraplex_engine.tasks.gsm8k_problems import generate

OUT = Path(__file__).resolve().parents[1] / "samples" / "local" / "gsm8k-sample.jsonl"


def rows(n: int, seed: int, max_steps: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    problems = [generate(rng, 1, max_steps) for _ in range(n)]
    return [{"question": p.question, "answer": p.solution} for p in problems]


def render(n: int = 64, seed: int = 0, max_steps: int = 4) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows(n, seed, max_steps))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-steps", type=int, default=4)
    args = ap.parse_args()
    args.out.write_text(render(args.rows, args.seed, args.max_steps))
    print(f"wrote {args.rows} rows to {args.out}")


if __name__ == "__main__":
    main()
