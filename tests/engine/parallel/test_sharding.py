"""A sharded base (FSDP2, issue 17) and rollouts across the data-parallel ranks: the
rollout split and wire format (pure), two real gloo processes against one unsharded
process, and `loraplex-engine run --world-size 2 --shard-base` against `--world-size 1`."""

from __future__ import annotations

import json
import socket
import subprocess

import pytest
import torch
import torch.multiprocessing as mp
from loraplex_engine import cli
from loraplex_engine.parallel import distributed, rollout_shares
from loraplex_engine.rollout.base import Completion, RolloutRequest
from loraplex_engine.train.row_split import split_rollout

from tests.support import child_processes, shard_worker
from tests.support.adapter_parity import assert_same_training
from tests.support.parallel_runs import run_cmd, run_gaps, short_demo, spawn_run

# ---- the rollout split and the wire (pure) ---------------------------------------------


class _Sink:
    def push(self, token_id: int, logprob: float, top: dict[int, float] | None) -> None:
        pass

    def cancelled(self) -> bool:
        return False


def _req(group: str, gen: torch.Generator | None, prompt: int = 3, new: int = 4, sink=None):
    return RolloutRequest(1, list(range(prompt)), new, 1.0, gen, group, sink=sink)


def test_a_sampling_stream_is_decoded_whole_by_one_rank_and_served_rows_stay_on_rank_0() -> None:
    """Rows of one generator go to one rank (its state then advances in one place);
    experiments are balanced by KV tokens, largest first; a row with a sink (a served
    completion streaming to rank 0's client) stays on rank 0, and counts as its load."""
    g = [torch.Generator().manual_seed(i) for i in range(3)]
    reqs = [
        *[_req("a", g[0], prompt=10) for _ in range(4)],  # 4 x 14 = 56 tokens
        *[_req("b", g[1]) for _ in range(4)],  # 28
        *[_req("c", g[2]) for _ in range(4)],  # 28
        _req("~job", None, prompt=20, sink=_Sink()),  # 24, pinned to rank 0
    ]
    shares = split_rollout(reqs, 2)
    # rank 0 starts at 24 (the served row): a (56) to rank 1, then b and c to rank 0
    assert shares == [[4, 5, 6, 7, 8, 9, 10, 11, 12], [0, 1, 2, 3]]
    assert split_rollout(reqs, 2) == shares  # deterministic
    assert split_rollout(reqs, 1) == [list(range(len(reqs)))]
    assert split_rollout(reqs[:4], 3) == [[0, 1, 2, 3], [], []]  # ranks may get nothing
    shared = [_req("a", g[0]), _req("b", g[0])]  # one generator, two groups: one unit
    assert sorted(map(len, split_rollout(shared, 2))) == [0, 2]


def test_the_wire_keeps_which_rows_share_a_generator_and_merge_advances_rank_0s() -> None:
    g = [torch.Generator().manual_seed(i) for i in range(2)]
    reqs = [_req("a", g[0]), _req("a", g[0]), _req("x", None), _req("b", g[1], sink=_Sink())]
    batch = rollout_shares.to_wire(reqs, [[0, 1, 2, 3], []])
    assert batch.streams == [0, 0, None, 1]
    assert all(r.generator is None and r.sink is None for r in batch.requests)
    rebuilt, gens = rollout_shares.from_wire(batch)
    assert rebuilt[0].generator is rebuilt[1].generator is gens[0] and rebuilt[2].generator is None
    draw = torch.rand(3, generator=gens[0])  # the worker samples from its copy
    assert torch.equal(torch.rand(3, generator=torch.Generator().manual_seed(0)), draw)
    done = [Completion([i], [0.0]) for i in range(2)]
    result = rollout_shares.share_result([0, 1], done, batch.streams, gens)
    assert set(result.states) == {0}
    mine = rollout_shares.share_result(
        [2, 3], [Completion([2], [0.0]), Completion([3], [0.0])], *rollout_shares.stream_ids(reqs)
    )
    merged = rollout_shares.merge([mine, result], 4, rollout_shares.stream_ids(reqs)[1])
    assert [c.token_ids for c in merged] == [[0], [1], [2], [3]]
    assert torch.equal(torch.rand(3, generator=g[0]), torch.rand(3, generator=gens[0]))
    with pytest.raises(RuntimeError, match=r"rollout rows \[2, 3\] were decoded by no rank"):
        rollout_shares.merge([result], 4, rollout_shares.stream_ids(reqs)[1])


# ---- two gloo ranks, the base sharded, against one unsharded process -------------------

# |sharded - unsharded| relative to the gradient's size: the same sums in another order
# (all-gathered weights are bit-equal; the shares' micro-batches differ). Measured 1e-7.
GRAD_RTOL = 1e-5


@pytest.fixture(scope="module")
def two_ranks(tiny_model_dir, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("shard")
    with socket.socket() as s:
        s.bind((distributed.LOOPBACK, 0))
        port = s.getsockname()[1]
    mp.spawn(shard_worker.run_rank, args=(port, str(tiny_model_dir), str(out)), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("case", ["all-on-0", "head-vs-layers"])
def test_a_sharded_base_gives_the_unsharded_gradients(
    tiny_model_dir, two_ranks, case, ckpt
) -> None:
    """Every LoRA gradient, summed over the two sharded ranks, equals one unsharded
    backward over all the rows, with gradient checkpointing on and off, while the ranks'
    work differs: rank 1 with no rows at all, or rank 0 with only an lm_head adapter's
    rows (no gradient through the layers of its own) and fewer micro-batches. Both ranks
    hold the same sums."""
    model = shard_worker.build(tiny_model_dir)
    rows = shard_worker.tick_rows(model)
    shard_worker.train_grads(model, rows, shard_worker.count_rows(rows), ckpt)
    want = shard_worker.lora_grads(model)
    key = f"grads/{case}/{ckpt}"
    got = [r[key] for r in two_ranks]
    assert got[0].keys() == got[1].keys() == want.keys() and want
    for name, w in want.items():
        for g in got:
            err = float((g[name] - w).norm() / w.norm().clamp_min(1e-30))
            assert err <= GRAD_RTOL, (name, err)
        assert torch.equal(got[0][name], got[1][name])


@pytest.mark.parametrize("case", ["all-on-0", "head-vs-layers"])
def test_sharded_ranks_rescore_their_shares_as_one_process(tiny_model_dir, two_ranks, case):
    """A vLLM rollout under a sharded base (issue 17): each rank scores its own share of
    the rows (score_rows in lockstep: rank 1 with none, or the ranks with different
    micro-batch counts) and gets the log-probs one unsharded process gives those rows."""
    model = shard_worker.build(tiny_model_dir)
    rows = shard_worker.tick_rows(model)
    want = dict(zip(map(id, rows), shard_worker.score(model, rows), strict=True))
    for rank, mine in enumerate(shard_worker.shares(rows, case)):  # the same row objects
        got = two_ranks[rank][f"scores/{case}"]
        assert len(got) == len(mine) and (mine or rank == 1)
        for row, g in zip(mine, got, strict=True):
            w = want[id(row)]
            assert g.shape == w.shape and torch.allclose(g, w, atol=1e-5), (case, rank)


def test_the_ranks_hold_a_share_of_the_base_and_plain_adapters(two_ranks) -> None:
    """static_bytes (the memory plan's) counts this rank's shards, about half the base
    (the head and the LoRA slots are not sharded), plus the reserve for FSDP's unsharded
    copies in flight (on a 2-layer model that reserve outweighs the saving; on a real
    depth it is a few layers of many); adapters leave as plain tensors."""
    for r in two_ranks:
        whole, local, reserve = r["bytes"]
        assert reserve > 0, "no FSDP group found on the sharded base"
        assert local - reserve < 0.75 * whole, (local, reserve, whole)
        assert r["plain_adapter"]
    assert two_ranks[0]["rounds"] == two_ranks[1]["rounds"] > two_ranks[0]["train_rounds"]


@pytest.mark.parametrize("case", ["two", "one"])
def test_rollouts_across_sharded_ranks_equal_one_process(tiny_model_dir, two_ranks, case) -> None:
    """Per-rank rollouts (each experiment decoded whole on one rank, in lockstep over a
    sharded base) give the tokens one unsharded process gives for the same seeds, and
    leave rank 0's generators where that process leaves them; 'one': a single experiment
    over several micro-batches while rank 1 decodes nothing (it runs dummy forwards)."""
    model = shard_worker.build(tiny_model_dir)
    want, states = shard_worker.reference_rollout(model, case)
    got = two_ranks[0][f"rollout/{case}"]
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0
        )
    for a, b in zip(two_ranks[0][f"states/{case}"], states, strict=True):
        assert torch.equal(a, b)


# ---- `loraplex-engine run --world-size 2 --shard-base`, real processes -------------------

SHARD_STEPS = 4


def test_shard_base_trains_the_demo_to_the_adapters_of_world_size_1(
    tiny_model_dir, tmp_path, capsys
) -> None:
    """The demo's four experiments: the base sharded over two ranks (each decoding and
    training its share) writes the adapters one unsharded rank writes (within
    adapter_parity's tolerances), after the same reward curves."""
    manifest = short_demo(tmp_path, SHARD_STEPS)
    two = spawn_run(
        run_cmd(manifest, tiny_model_dir, tmp_path / "sh2", "--world-size", "2", "--shard-base"),
        tmp_path / "sh2.err",
        stdout=subprocess.PIPE,
    )
    try:
        one = ["run", str(manifest), "--model", str(tiny_model_dir), "--out", str(tmp_path / "dp1")]
        assert cli.main(one) == 0
        stdout, _ = two.communicate(timeout=600)
    finally:
        child_processes.kill_group(two)
    assert two.returncode == 0, (tmp_path / "sh2.err").read_text()[-3000:]
    assert "over 2 ranks, base sharded (FSDP2)" in stdout
    one = json.loads((tmp_path / "dp1" / "summary.json").read_text())
    sh2 = json.loads((tmp_path / "sh2" / "summary.json").read_text())
    assert [e["rewards"] for e in sh2["experiments"]] == [e["rewards"] for e in one["experiments"]]
    gaps = run_gaps(manifest, tmp_path / "dp1", tmp_path / "sh2")
    with capsys.disabled():
        print(f"\n|sharded DP=2 - DP=1| in Adam steps after {SHARD_STEPS} steps: {gaps}")
    assert_same_training(gaps, trained=3)  # the adapters that had a nonzero reward


def test_shard_base_needs_ranks(tiny_model_dir, tmp_path, capsys) -> None:
    manifest = short_demo(tmp_path, 1)
    argv = ["run", str(manifest), "--model", str(tiny_model_dir), "--out", str(tmp_path / "o")]
    assert cli.main([*argv, "--shard-base"]) == 2
    assert "--shard-base needs --world-size above 1" in capsys.readouterr().err


def test_a_tied_head_stays_replicated_with_its_embedding(tmp_path) -> None:
    """The tiny Gemma 3 ties its head to its embedding: sharded over two ranks the shared
    weight stays a plain tensor (ignored with the head), the layers are sharded, and the
    checkpointed gradient equals the unsharded one."""
    from loraplex_engine.dev.tiny_model import build_model

    model_dir = tmp_path / "gemma3"
    build_model(model_dir, arch="gemma3")
    with socket.socket() as s:
        s.bind((distributed.LOOPBACK, 0))
        port = s.getsockname()[1]
    mp.spawn(
        shard_worker.run_tied_rank, args=(port, str(model_dir), str(tmp_path)), nprocs=2, join=True
    )
    model = shard_worker.tied_model(model_dir)
    want = shard_worker.tied_grads(model, shard_worker.tied_rows(model))
    for rank in range(2):
        got = torch.load(tmp_path / f"tied{rank}.pt", weights_only=False)
        assert got["head_plain"] and got["sharded_layers"]
        assert got["grads"].keys() == want.keys() and want
        for name, w in want.items():
            err = float((got["grads"][name] - w).norm() / w.norm().clamp_min(1e-30))
            assert err <= GRAD_RTOL, (name, err)
