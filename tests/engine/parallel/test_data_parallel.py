"""Data parallelism (issue 17, first slice): the row split, the gradient all-reduce over
real gloo processes, and `loraplex-engine run --world-size 2` against `--world-size 1`."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import time
from types import SimpleNamespace

import psutil
import pytest
import torch
import torch.multiprocessing as mp
from loraplex_engine import cli
from loraplex_engine.parallel import distributed
from loraplex_engine.parallel.data_parallel import DataParallelTraining, NewAdapter, TrainMessage
from loraplex_engine.parallel.distributed import World
from loraplex_engine.train.algorithms import ClippedRatioLoss
from loraplex_engine.train.optim import AdamWSettings
from loraplex_engine.train.row_split import row_units, split_row_indices, split_rows_by_rank
from loraplex_engine.train.rows import TrainRow, count_rows
from loraplex_engine.train.shared_prefix import shared_prefix_forward
from loraplex_engine.train.step import fused_backward

from tests.support import child_processes, dp_worker
from tests.support.adapter_parity import (
    STEP_RMS_TOL,
    adapter_gap,
    assert_same_training,
)
from tests.support.lora_helpers import CONFIGS, multi_model, random_tick_rows
from tests.support.parallel_runs import run_cmd, run_gaps, short_demo, spawn_run


def row(exp: str, group: int | None, prompt: int, completion: int) -> TrainRow:
    return TrainRow(
        exp, 1, list(range(prompt)), [7] * completion, [0.0] * completion, 0.5, 1.0, group
    )


def groups_of(rows: list[TrainRow], share: list[TrainRow]) -> set[tuple[str, int | None]]:
    return {(r.experiment, r.group) for r in share}


def test_whole_prompt_groups_go_to_one_rank() -> None:
    rows = [row(e, g, 4 + g, 3) for e in ("a", "b") for g in range(5) for _ in range(4)]
    random.Random(0).shuffle(rows)
    shares = split_rows_by_rank(rows, 3)
    assert sorted(id(r) for s in shares for r in s) == sorted(id(r) for r in rows)
    seen = [groups_of(rows, s) for s in shares]
    for i in range(3):
        for j in range(i + 1, 3):
            assert not seen[i] & seen[j], "a prompt group split between ranks"
    # each rank keeps the tick's row order
    for share in shares:
        positions = [next(k for k, r in enumerate(rows) if r is x) for x in share]
        assert positions == sorted(positions)


def test_token_balanced_largest_first() -> None:
    """LPT on units of 3, 10, 2, 9, 8, 2 tokens over 2 ranks: 10 -> rank 0, 9 -> 1,
    8 -> 1 (9 < 10), 3 -> 0, 2 -> 0, 2 -> 0 (15 < 17): 17 tokens each."""
    sizes = [3, 10, 2, 9, 8, 2]  # one row per group: prompt 1 + completion size - 1
    rows = [row("a", g, 1, n - 1) for g, n in enumerate(sizes)]
    assert split_row_indices(rows, 2) == [[0, 1, 2, 5], [3, 4]]
    # a unit of several rows weighs their sum: 4 rows of 6 outweigh one of 20
    rows = [row("a", 0, 3, 3) for _ in range(4)] + [row("a", 1, 10, 10)]
    assert split_row_indices(rows, 2) == [[0, 1, 2, 3], [4]]


def test_deterministic_and_independent_of_world_size_one() -> None:
    rows = [row("a", g % 3, 5, 1 + g) for g in range(12)]
    assert split_row_indices(rows, 4) == split_row_indices(list(rows), 4)
    assert split_row_indices(rows, 1) == [list(range(12))]


def test_rows_without_a_group_are_units_alone_and_ranks_may_be_empty() -> None:
    rows = [row("a", None, 3, 2), row("a", None, 3, 2), row("b", 0, 3, 2), row("b", 0, 3, 2)]
    assert row_units(rows) == [[0], [1], [2, 3]]
    shares = split_row_indices(rows, 5)
    assert sorted(len(s) for s in shares) == [0, 0, 1, 1, 2]
    assert split_row_indices([], 2) == [[], []]
    with pytest.raises(ValueError, match="world_size"):
        split_row_indices(rows, 0)


def test_groups_of_different_experiments_are_different_units() -> None:
    rows = [row("a", 0, 3, 2), row("b", 0, 3, 2)]
    assert row_units(rows) == [[0], [1]]
    assert sorted(map(len, split_row_indices(rows, 2))) == [1, 1]


# ---- the gradient maths: each rank's share, under the tick's loss weights -------------


@pytest.mark.numeric
def test_shares_under_the_ticks_row_counts_sum_to_the_one_rank_gradient(tiny_model_dir) -> None:
    """The loss normalisation DP relies on: with ``row_counts`` of the whole tick, the
    gradients of each rank's share of the rows (as split_rows_by_rank gives them) add up
    to the gradient of all rows in one backward; with each share's own counts (the naive
    way) they would not."""
    model = multi_model(tiny_model_dir)
    model.train()
    rows = _tick_rows(model)
    updates = {n: ClippedRatioLoss(kl_coef=0.1 if n == "b" else 0.0) for n in CONFIGS}

    def forward(ids, attn, slots):
        return model(input_ids=ids, attention_mask=attn, slot_ids=slots).logits.float()

    share = shared_prefix_forward(model, torch.device("cpu"))

    def grads(parts: list[list[TrainRow]], counts: dict[str, int] | None) -> list[torch.Tensor]:
        for p in model.parameters():
            p.grad = None
        for part in parts:
            fused_backward(forward, part, updates, 0, 4096, share, row_counts=counts)
        return [p.grad.clone() for n, p in model.named_parameters() if "lora_" in n]

    whole = grads([rows], None)
    shares = split_rows_by_rank(rows, 2)
    assert all(shares) and len({id(r) for s in shares for r in s}) == len(rows)
    summed = grads(shares, count_rows(rows))
    for a, b in zip(whole, summed, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    naive = grads(shares, None)
    assert max(float((a - b).abs().max()) for a, b in zip(whole, naive, strict=True)) > 1e-4
    with pytest.raises(ValueError, match="row_counts has no count"):
        fused_backward(forward, rows, updates, 0, 4096, share, row_counts={"a": 3})


def _tick_rows(model) -> list[TrainRow]:
    """Three tenants, prompt groups of 1-4 rows with shared prompts, random completions."""
    return random_tick_rows(model, CONFIGS, (4, 3, 1, 2), max_prompt=9, max_done=6)


def test_a_worker_without_rank_0s_slots_or_config_refuses_to_train(tiny_model_dir) -> None:
    """A worker checks rank 0's slot map and new adapters' LoRA configs against its own
    before any tensor is broadcast into them."""
    model = multi_model(tiny_model_dir)
    worker = SimpleNamespace(model=model, world=World(1, 2))
    settings = AdamWSettings(lr=0.01)
    ok = {n: NewAdapter(model.slot_of(n), CONFIGS[n], settings, 0) for n in CONFIGS}
    slots = {n: model.slot_of(n) for n in CONFIGS}
    DataParallelTraining._check_adapters(worker, TrainMessage([], {}, slots, ok))
    moved = TrainMessage([], {}, {**slots, "a": slots["b"]}, {})
    with pytest.raises(RuntimeError, match="rank 1: adapter 'a' is in slot 2 on rank 0 but 1"):
        DataParallelTraining._check_adapters(worker, moved)
    other = {"c": NewAdapter(slots["c"], CONFIGS["a"], settings, 0)}
    with pytest.raises(RuntimeError, match="rank 1: adapter 'c' has LoRA config"):
        DataParallelTraining._check_adapters(worker, TrainMessage([], {}, slots, other))


def test_a_worker_that_would_not_rescore_as_rank_0_does_refuses_to_train(tiny_model_dir) -> None:
    """A vLLM rollout (issue 17): rank 0 says whether the ranks rescore the sampled rows
    (then each rank's gaps are gathered); a worker that disagrees fails naming it, before
    the gather that would otherwise wait for it forever."""
    model = multi_model(tiny_model_dir)
    slots = {n: model.slot_of(n) for n in CONFIGS}
    worker = SimpleNamespace(model=model, world=World(1, 2), recompute_old_logprobs=False)
    worker._check_adapters = lambda msg: DataParallelTraining._check_adapters(worker, msg)
    msg = TrainMessage([], {}, slots, {}, rescore=True)
    with pytest.raises(RuntimeError, match="rank 1: rank 0 rescores the sampled rows"):
        DataParallelTraining._on_train(worker, msg)


# ---- the collectives, on two real gloo processes -------------------------------------


@pytest.mark.numeric
def test_lora_grads_are_summed_over_two_gloo_ranks(tmp_path) -> None:
    """all_reduce_lora_grads (64-byte buckets: many per call) over two processes joined by
    torchrun's env:// rendezvous: inside the slots in play every rank holds the sum,
    a rank without a gradient gets the sum (zeros elsewhere), a parameter without one on
    any rank keeps None; slots outside stay as each rank had them. broadcast_tensors
    writes rank 0's values into a strided view in place; broadcast_object sends rank 0's."""
    with socket.socket() as s:  # torchrun's way: rank 0 serves env://'s store on it
        s.bind((distributed.LOOPBACK, 0))
        port = s.getsockname()[1]
    mp.spawn(dp_worker.run_rank, args=(port, str(tmp_path)), nprocs=2, join=True)
    out = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    local = [dp_worker.rank_grads(r) for r in range(2)]
    inside = dp_worker.SLOTS
    for i in (0, 1, 3):
        want = sum(g[i] if g[i] is not None else torch.zeros(dp_worker.SHAPES[i]) for g in local)
        for r in range(2):
            got = out[r]["grads"][i]
            torch.testing.assert_close(got[inside], want[inside], rtol=0, atol=1e-6)
            mine = local[r][i] if local[r][i] is not None else torch.zeros(dp_worker.SHAPES[i])
            torch.testing.assert_close(got[:1], mine[:1], rtol=0, atol=0)
            torch.testing.assert_close(got[3:], mine[3:], rtol=0, atol=0)
        assert torch.equal(out[0]["grads"][i][inside], out[1]["grads"][i][inside])
    assert out[0]["grads"][2] is None and out[1]["grads"][2] is None
    assert torch.equal(out[0]["grads"][0][inside], torch.full((2, 3, 5), 3.0))
    for r in range(2):
        assert torch.equal(out[r]["whole"], torch.arange(5.0))
        assert torch.equal(out[r]["stacked"][:, 1:3], torch.full((4, 2), 7.0))
        assert torch.equal(out[r]["stacked"][:, [0, 3]], torch.zeros(4, 2))
        assert out[r]["obj"] == {"from": 0}


@pytest.mark.numeric
def test_worker_ranks_apply_rank_0s_off_policy_correction(tiny_model_dir, tmp_path) -> None:
    """Under a vLLM rollout with offPolicyCorrection tis, two ranks train every adapter
    to where one rank does: the worker weights its share of the tokens by TIS as rank 0
    does (its losses arrive whole in rank 0's message). The same update without TIS
    ends elsewhere, so a worker that dropped the correction would fail here. Rank 0's
    TIS statistic covers both ranks' tokens: every completion token, with one rank's
    mean weight."""
    with socket.socket() as s:
        s.bind((distributed.LOOPBACK, 0))
        port = s.getsockname()[1]
    mp.spawn(dp_worker.run_tis_rank, args=(port, str(tiny_model_dir), str(tmp_path), 2.0), nprocs=2)
    saved = [torch.load(tmp_path / f"tis-rank{r}.pt") for r in range(2)]
    ranks = [s["adapters"] for s in saved]
    trainer = dp_worker.tis_trainer(str(tiny_model_dir), None)
    one, one_tis = dp_worker.train_with_tis(trainer, 2.0)
    plain, plain_tis = dp_worker.train_with_tis(
        dp_worker.tis_trainer(str(tiny_model_dir), None), None
    )
    tokens = dp_worker.tis_tokens_of(trainer.model)
    lr = dp_worker.TIS_LR
    for name, want in one.items():
        assert all(torch.equal(ranks[1][name][k], v) for k, v in ranks[0][name].items())
        assert_same_training({name: adapter_gap(want, ranks[0][name], lr, 1)})
        without = adapter_gap(want, plain[name], lr, 1)
        assert without.rms > 100 * STEP_RMS_TOL, (name, without)
        mean, n = saved[0]["tis"][name]
        assert n == one_tis[name][1] == tokens[name], (name, n, one_tis[name], tokens)
        assert mean == pytest.approx(one_tis[name][0], rel=1e-5) and mean != 1.0
        assert plain_tis[name] == (None, 0)


# ---- `loraplex-engine run --world-size N`, real processes -----------------------------

DEMO_STEPS = 8  # of the demo's 30: every experiment has had a nonzero reward by then


@pytest.mark.numeric
def test_world_size_2_trains_the_demo_to_the_adapters_of_world_size_1(
    tiny_model_dir, tmp_path, capsys
) -> None:
    """The demo's four experiments, same seeds: `--world-size 2` (rank 0 + one worker
    process, gloo) writes the adapters `--world-size 1` writes (within adapter_parity's
    tolerances), after the same reward curves; every adapter trained. Both on
    ``--device cpu`` given explicitly (rank 0 passes it to its worker)."""
    manifest = short_demo(tmp_path, DEMO_STEPS)
    two = spawn_run(
        run_cmd(manifest, tiny_model_dir, tmp_path / "dp2", "--world-size", "2", "--device", "cpu"),
        tmp_path / "dp2.err",
        stdout=subprocess.PIPE,
    )
    try:  # DP=1 in this process, meanwhile
        assert (
            cli.main(
                [
                    "run",
                    str(manifest),
                    "--model",
                    str(tiny_model_dir),
                    "--out",
                    str(tmp_path / "dp1"),
                    "--device",
                    "cpu",
                ]
            )
            == 0
        )
        stdout, _ = two.communicate(timeout=600)
    finally:
        child_processes.kill_group(two)
    assert two.returncode == 0, (tmp_path / "dp2.err").read_text()[-3000:]
    assert "data parallel over 2 ranks" in stdout and " on cpu, torch rollout" in stdout
    one = json.loads((tmp_path / "dp1" / "summary.json").read_text())
    dp2 = json.loads((tmp_path / "dp2" / "summary.json").read_text())
    assert [e["rewards"] for e in dp2["experiments"]] == [e["rewards"] for e in one["experiments"]]
    for exp in one["experiments"]:
        assert exp["phase"] == "Succeeded" and exp["steps"] == DEMO_STEPS
    gaps = run_gaps(manifest, tmp_path / "dp1", tmp_path / "dp2")
    with capsys.disabled():
        print(f"\n|DP=2 - DP=1| in Adam steps after {DEMO_STEPS} steps: {gaps}")
    assert_same_training(gaps)


def test_a_rank_that_dies_fails_the_run_loudly(tiny_model_dir, tmp_path) -> None:
    """SIGKILL the worker mid-run: rank 0 fails within seconds (not a collective's
    timeout), exit 1, one line naming the rank; nothing is left running."""
    manifest = short_demo(tmp_path, 1000)
    cmd = run_cmd(manifest, tiny_model_dir, tmp_path / "out", "--world-size", "2")
    rank0 = spawn_run([*cmd, "--dist-timeout", "300"], tmp_path / "err", stdout=subprocess.PIPE)
    try:
        for line in rank0.stdout:  # progress: the ranks are training
            if " step " in line:
                break
        (worker,) = psutil.Process(rank0.pid).children()
        worker.kill()
        start = time.monotonic()
        rank0.communicate(timeout=120)
        took = time.monotonic() - start
    finally:
        child_processes.kill_group(rank0)
    err = (tmp_path / "err").read_text()
    assert rank0.returncode == 1, err[-3000:]
    assert "loraplex-engine run: error: rank 1 was killed by signal 9" in err
    assert took < 60, took
    assert not child_processes.survivors()


def test_a_world_size_below_one_is_a_usage_error(tiny_model_dir, tmp_path, capsys) -> None:
    manifest = short_demo(tmp_path, 1)
    args = ["run", str(manifest), "--model", str(tiny_model_dir), "--world-size", "0"]
    with pytest.raises(SystemExit) as e:  # argparse's: the value is the flag's to refuse
        cli.main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert "argument --world-size: invalid value: '0'; must be at least 1" in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--world-size", "2", "--train-mode", "timesliced"], "needs --train-mode fused"),
        (["--world-size", "2", "--dist-timeout", "0"], "--dist-timeout must be > 0"),
    ],
)
def test_bad_world_flags_are_one_line_errors(tiny_model_dir, tmp_path, capsys, flags, message):
    manifest = short_demo(tmp_path, 1)
    args = ["run", str(manifest), "--model", str(tiny_model_dir), "--out", str(tmp_path / "o")]
    assert cli.main([*args, *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.splitlines()) == 1, err
