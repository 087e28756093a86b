"""Stop at step k, resume in a fresh process, take step k+1: same weights as never stopping."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.support import resume_worker as w
from tests.support.paths import REPO_ROOT


@pytest.mark.parametrize("dropout", [0.0, 0.3], ids=["no-dropout", "dropout"])
def test_resume_in_fresh_process_matches_uninterrupted_run(
    dropout: float, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """With dropout the masks of step k+1 come from torch's global RNG: the resumed
    process only matches if the trainer state restored that RNG too."""
    k = 3
    model, opt, gens = w.setup(tiny_model_dir, dropout)
    for _ in range(k):
        w.train_step(model, opt, gens)
    w.save_all(model, opt, gens, tmp_path / "ckpt", step=k)
    w.train_step(model, opt, gens)  # the uninterrupted run's step k+1
    expected = w.weights(model)

    got = resume_in_fresh_process(tiny_model_dir, tmp_path, dropout, step=k + 1)
    assert got.keys() == expected.keys()
    for key, t in expected.items():
        assert torch.equal(got[key], t), key
    assert opt.step_count("a") == k + 1


def test_dropout_resume_needs_the_global_rng(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The control for the dropout case above: masks drawn from a different global RNG
    state give different weights, so that test's equality is not vacuous."""
    model, opt, gens = w.setup(tiny_model_dir, 0.3)
    w.train_step(model, opt, gens)
    w.save_all(model, opt, gens, tmp_path / "ckpt", step=1)
    w.train_step(model, opt, gens)
    expected = w.weights(model)

    model2, opt2, gens2, _ = w.resume(tiny_model_dir, tmp_path / "ckpt", 0.3)
    torch.manual_seed(1234)  # what a fresh process without the saved global RNG amounts to
    w.train_step(model2, opt2, gens2)
    got = w.weights(model2)
    assert any(not torch.equal(got[key], t) for key, t in expected.items())


def resume_in_fresh_process(
    model_dir: Path, tmp_path: Path, dropout: float, step: int
) -> dict[str, torch.Tensor]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    out = tmp_path / "resumed.safetensors"
    worker = [sys.executable, "-m", "tests.support.resume_worker", str(model_dir)]
    subprocess.run(
        [*worker, str(tmp_path / "ckpt"), str(out), str(dropout)],
        check=True,
        env=env,
        timeout=300,
    )
    with safe_open(out, "pt") as f:
        assert f.metadata()["step"] == str(step)
        return {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (safe_open is no dict)
