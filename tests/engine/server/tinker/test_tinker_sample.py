"""samples/tinker/sft.py (docs/tinker.md's example) run as a user runs it: the official
tinker SDK in its own process against a real ``loraplex-engine serve --tinker-keys`` with
the tiny model. It must learn both answers and sample them back, so the doc stays true."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.server_process import EngineServer

REPO = Path(__file__).resolve().parents[4]
KEY = "tml-demo-0123456789abcdef"  # the doc's key


def test_the_documented_sft_sample_learns_and_samples_its_answers(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text(f"demo {KEY}\n")
    srv = EngineServer(
        tiny_model_dir, tmp_path / "ckpt", max_adapters=2, workdir=tmp_path,
        extra_args=["--tinker-keys", str(keys)],
    )  # fmt: skip
    with srv:
        env = {**os.environ, "TINKER_API_KEY": KEY, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(
            [sys.executable, str(REPO / "samples" / "tinker" / "sft.py"), "--url", srv.url],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "base model: tiny-llama" in out
    assert "'What is the capital of France? Answer:' -> ' Paris.' (stop)" in out
    assert "'Say hello: ' -> 'hello world' (stop)" in out
    losses = [float(line.split()[-1]) for line in out.splitlines() if "loss per token" in line]
    assert len(losses) == 9 and losses[-1] < 0.05 * losses[0], out
    saved = next(line for line in out.splitlines() if line.startswith("saved: "))
    model_id = saved.removeprefix("saved: tinker://").split("/")[0]
    assert (tmp_path / "ckpt" / "demo" / "_tinker" / model_id / "weights" / "sft-final").is_dir()
