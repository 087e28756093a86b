"""Stop at step k, resume in a fresh process, take step k+1: same weights as never stopping."""

import os
import subprocess
import sys
from pathlib import Path

import resume_worker as w
import torch
from safetensors import safe_open


def test_resume_in_fresh_process_matches_uninterrupted_run(tiny_model_dir, tmp_path) -> None:
    k = 3
    model, opt, gens = w.setup(tiny_model_dir)
    for _ in range(k):
        w.train_step(model, opt, gens)
    w.save_all(model, opt, gens, tmp_path / "ckpt", step=k)
    w.train_step(model, opt, gens)  # the uninterrupted run's step k+1
    expected = w.weights(model)

    here = Path(__file__).parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")]),
    }
    out = tmp_path / "resumed.safetensors"
    subprocess.run(
        [
            sys.executable,
            str(here / "resume_worker.py"),
            str(tiny_model_dir),
            str(tmp_path / "ckpt"),
            str(out),
        ],
        check=True,
        env=env,
        timeout=300,
    )
    with safe_open(out, "pt") as f:
        assert f.metadata()["step"] == str(k + 1)
        got = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    assert got.keys() == expected.keys()
    for key, t in expected.items():
        assert torch.equal(got[key], t), key
    assert opt.step_count("a") == k + 1
