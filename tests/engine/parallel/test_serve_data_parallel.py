"""`loraplex-engine serve --world-size N` (issue 17): one engine over N ranks in one pod,
driven over HTTP only. Real `serve` processes with the tiny model on 127.0.0.1; rank 0
starts rank 1 itself (gloo on the CPU).

- experiments bound and unbound through the API train on both ranks to the adapters a
  one-rank server trains (an unbind mid-run, and a new adapter into the freed slot);
- a base sharded over the ranks (--shard-base) trains to the one-rank adapters and
  serves completions through both ranks;
- a killed rank ends the engine at once, naming the rank, and the engine started again
  on the same checkpoints resumes the experiment from its last one;
- flags and LORAPLEX_WORLD_SIZE.
"""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from loraplex_engine.cli import build_parser, main

from tests.support import child_processes
from tests.support.adapter_parity import AdapterGap, adapter_gap_of_files, assert_same_training
from tests.support.machine import scaled
from tests.support.server_process import EngineServer, wait_until
from tests.support.server_specs import put_body, small_spec

pytestmark = pytest.mark.slow

# DP=2 and DP=1 differ by float rounding alone (the ranks pack their rows into different
# micro-batches): adapter_parity says how far that can carry the adapters.
LR = small_spec(seed=0)["algorithm"]["learningRate"]
A, B, C = "default.dp-a", "default.dp-b", "team-c.dp-c"


def server(tiny: Path, work: Path, *args: str, **kw: Any) -> EngineServer:
    return EngineServer(tiny, work / "ckpt", max_adapters=2, workdir=work, extra_args=[*args], **kw)


def spec(max_words: int, seed: int, *, rank: int = 4, max_steps: int = 0) -> dict[str, Any]:
    """short-reply: a dense reward (fewer words score more), so a random tiny model's
    groups differ from the first step and every step moves the adapter."""
    body = small_spec(seed=seed, rank=rank, max_steps=max_steps)
    body["task"] = {"name": "short-reply", "params": {"maxWords": str(max_words)}}
    body["rollout"]["maxNewTokens"] = 6
    return body


def status(api: httpx.Client, exp_id: str) -> dict[str, Any]:
    r = api.get(f"/v1/experiments/{exp_id}")
    assert r.status_code == 200, r.text
    return r.json()


def put(api: httpx.Client, exp_id: str, spec: dict[str, Any], **kw: Any) -> dict[str, Any]:
    r = api.put(f"/v1/experiments/{exp_id}", json=put_body(exp_id, spec, **kw))
    assert r.status_code in (200, 201), r.text
    return r.json()


def finished(api: httpx.Client, exp_id: str) -> dict[str, Any] | None:
    s = status(api, exp_id)
    assert s["phase"] in ("Running", "Succeeded"), s
    return s if s["phase"] == "Succeeded" else None


def bind_unbind_rebind(api: httpx.Client) -> dict[str, dict[str, Any]]:
    """A (4 steps) and B (unbounded) bound; B unbound once it has trained 2 steps, while
    A goes on; then C (another rank and task) bound into B's freed slot, 3 steps."""
    put(api, A, spec(1, seed=1, max_steps=4))
    put(api, B, spec(2, seed=2))
    wait_until(lambda: status(api, B)["step"] >= 2, timeout=120)
    assert api.delete(f"/v1/experiments/{B}").status_code == 200
    put(api, C, spec(1, seed=3, rank=8, max_steps=3))
    return {e: wait_until(lambda e=e: finished(api, e), timeout=120) for e in (A, C)}


def gap(one: dict[str, Any], two: dict[str, Any]) -> AdapterGap:
    """Two experiment statuses' adapters, after the same steps, in Adam steps."""
    assert one["step"] == two["step"]
    return adapter_gap_of_files(Path(one["adapterPath"]), Path(two["adapterPath"]), LR, one["step"])


@pytest.mark.numeric
def test_two_ranks_train_bound_and_unbound_experiments_to_the_one_rank_adapters(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Same binds and unbind on `serve --world-size 2` and `serve` (one rank): A (which
    trained on while B left) and C (added after, into B's slot) end where the one-rank
    adapters do (adapter_parity), so rank 1 held them in rank 0's slots with rank 0's weights
    and added its gradient share every step; greedy completions from A (served by rank
    0) match. SIGTERM then checkpoints, finds both ranks' adapters (weights, Adam moments,
    steps) identical bit for bit, and releases rank 1: exit 0."""
    two = server(tiny_model_dir, tmp_path / "two", "--world-size", "2")
    one = server(tiny_model_dir, tmp_path / "one")
    with two, one, two.client() as api2, one.client() as api1:
        (worker,) = psutil.Process(two.proc.pid).children()
        got = {"two": bind_unbind_rebind(api2), "one": bind_unbind_rebind(api1)}
        # Served completions run on rank 0 (in its rollout): the same as one rank's.
        ask = {"model": A, "prompt": "Name a fruit.", "max_tokens": 6, "temperature": 0.0}
        texts = [api.post("/v1/completions", json=ask) for api in (api2, api1)]
        assert [r.status_code for r in texts] == [200, 200], texts[0].text
        assert texts[0].json()["choices"][0]["text"] == texts[1].json()["choices"][0]["text"]
        assert two.stop() == 0, two.log_tail()
        assert not worker.is_running(), "rank 1 outlived a clean shutdown"
    log = two.log_text()
    assert "data parallel over 2 ranks (gloo)" in log
    for line in (f"added adapter {A} in slot 1", f"added adapter {B} in slot 2",
                 f"removed adapter {B} from slot 2", f"added adapter {C} in slot 2"):  # fmt: skip
        assert f"rank 1: {line}" in log, log[-3000:]
    # Before releasing rank 1, rank 0 compared them: A and C, bit for bit.
    assert "all 2 ranks hold the same 2 trained adapters" in log, log[-3000:]
    assert "rank 1 released by rank 0" in log
    assert [got["one"][A]["step"], got["one"][C]["step"]] == [4, 3]
    gaps = {exp: gap(got["one"][exp], got["two"][exp]) for exp in (A, C)}
    with capsys.disabled():
        print(f"\n|serve DP=2 - DP=1| per adapter, in Adam steps: {gaps}")
    assert_same_training(gaps)


@pytest.mark.numeric
def test_a_sharded_base_trains_and_serves_completions_through_both_ranks(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`serve --world-size 2 --shard-base`: the base is sharded on both ranks (every
    forward a collective), A trains 2 steps to where the unsharded one-rank adapter
    does (adapter_parity), and a served completion, in a tick of its own once A is done,
    runs on both ranks in lockstep (rank 1 joins its rollout with dummy forwards; rank 0
    alone would hang in the first layer's all-gather) and equals the one-rank text."""
    two = server(tiny_model_dir, tmp_path / "two", "--world-size", "2", "--shard-base")
    one = server(tiny_model_dir, tmp_path / "one")
    with two, one, two.client() as api2, one.client() as api1:
        got = {}
        for key, api in (("two", api2), ("one", api1)):
            put(api, A, spec(1, seed=1, max_steps=2))
            got[key] = wait_until(lambda api=api: finished(api, A), timeout=120)
        ask = {"model": A, "prompt": "Name a fruit.", "max_tokens": 6, "temperature": 0.0}
        texts = [api.post("/v1/completions", json=ask, timeout=60) for api in (api2, api1)]
        assert [r.status_code for r in texts] == [200, 200], texts[0].text
        assert texts[0].json()["choices"][0]["text"] == texts[1].json()["choices"][0]["text"]
        assert two.stop() == 0, two.log_tail()
    log = two.log_text()
    assert log.count("base sharded over 2 ranks (FSDP2)") == 2, log[-3000:]  # both ranks
    assert "all 2 ranks hold the same 1 trained adapters" in log, log[-3000:]
    gaps = {A: gap(got["one"], got["two"])}
    with capsys.disabled():
        print(f"\n|serve sharded DP=2 - DP=1| after 2 steps, in Adam steps: {gaps}")
    assert_same_training(gaps)


def test_a_killed_rank_ends_the_engine_and_the_restart_resumes_the_checkpoint(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """LORAPLEX_WORLD_SIZE=2 with a short --dist-timeout (5 s on an idle machine): idle
    longer than that, the heartbeats keep rank 1 in (a worker waiting for a message would
    time out). Then SIGKILL rank 1 mid-training: the server exits 1 within seconds, one
    line naming the rank, nothing left running. Started again on the same checkpoint root
    and bound as the operator binds it (resumeFrom its last checkpoint, its runId), the
    experiment goes on from that checkpoint's step; SIGKILL rank 0 and rank 1 exits too.
    The timeout and the exit limits scale with the machine's load (tests/support/machine.py):
    a fixed 5 s gloo timeout failed a fresh-clone run whose installs loaded the 2 cores."""
    dist_timeout, exit_within = scaled(5.0), scaled(10.0)
    srv = server(
        tiny_model_dir,
        tmp_path,
        *("--dist-timeout", f"{dist_timeout:.1f}"),
        env={"LORAPLEX_WORLD_SIZE": "2"},
    )
    with srv, srv.client() as api:
        time.sleep(dist_timeout + 2)  # idle past the timeout
        put(api, A, spec(1, seed=1), run_id="r1")
        ckpt = wait_until(lambda: status(api, A)["checkpoint"], timeout=120)
        (worker,) = psutil.Process(srv.proc.pid).children()
        worker.kill()
        start = time.monotonic()
        code = srv.proc.wait(30)
        took = time.monotonic() - start
    assert code == 1, srv.log_tail()
    assert "loraplex-engine serve: error: rank 1 was killed by signal 9" in srv.log_text()
    assert took < exit_within, took
    assert not child_processes.survivors()

    last = max(Path(ckpt["path"]).parent.glob("step-*"), key=lambda p: int(p.name[5:]))
    step = int(last.name[5:])
    with srv, srv.client() as api:
        # The operator's resumeFrom is the last checkpoint it saw; the engine takes the
        # run's newest intact one from there: nothing lost.
        resumed = put(api, A, spec(1, seed=1), resume_from=ckpt["path"], run_id="r1")
        assert resumed["step"] == step and step >= ckpt["step"], (resumed, step)
        wait_until(lambda: status(api, A)["step"] >= step + 2, timeout=120)
        (worker,) = psutil.Process(srv.proc.pid).children()
        srv.proc.kill()  # rank 0 alone
        start = time.monotonic()
        worker.wait(30)
        gone = time.monotonic() - start
    with capsys.disabled():
        print(
            f"\nrank 1 killed -> engine exit {took:.2f}s; rank 0 killed -> rank 1 exit {gone:.2f}s"
            f" (--dist-timeout {dist_timeout:.1f}s, limit {exit_within:.1f}s at this load)"
        )
    assert gone < exit_within, gone


def test_torchrun_starts_every_rank_and_a_killed_one_ends_the_engine(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Every rank started by torchrun (RANK set): rank 0 alone serves, rank 1 follows its
    adds and trains; SIGKILL rank 1 and rank 0 (no watcher here: its next collective
    fails, or torchrun stops it) exits non-zero, so torchrun does, naming rank 1."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    with socket.socket() as s:  # the agent's store; a port race here only fails the start
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun += ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    command = [*torchrun, "-m", "loraplex_engine.cli"]
    srv = server(tiny_model_dir, tmp_path, "--world-size", "2", command=command)
    with srv, srv.client() as api:
        put(api, A, spec(1, seed=1))
        wait_until(lambda: status(api, A)["step"] >= 2, timeout=120)
        ranks = {int(p.environ()["RANK"]): p for p in psutil.Process(srv.proc.pid).children()}
        assert sorted(ranks) == [0, 1]
        ranks[1].kill()
        code = srv.proc.wait(60)
    log = srv.log_text()
    assert f"rank 1: added adapter {A} in slot 1" in log
    assert code != 0 and "rank      : 1" in log, log[-3000:]
    assert not child_processes.survivors()


def test_world_size_flags_and_variable(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LORAPLEX_WORLD_SIZE", "3")
    monkeypatch.setenv("LORAPLEX_DIST_TIMEOUT", "30")
    args = build_parser().parse_args(["serve"])
    assert (args.world_size, args.dist_timeout) == (3, 30.0)
    assert build_parser().parse_args(["serve", "--world-size", "2"]).world_size == 2
    monkeypatch.setenv("LORAPLEX_WORLD_SIZE", "0")
    with pytest.raises(SystemExit):
        main(["serve", "--model", str(tiny_model_dir), "--insecure-no-auth"])
    assert "--world-size: invalid value: '0' (from LORAPLEX_WORLD_SIZE)" in capsys.readouterr().err
    monkeypatch.delenv("LORAPLEX_WORLD_SIZE")
    base = ["serve", "--model", str(tiny_model_dir), "--insecure-no-auth"]
    assert main([*base, "--shard-base"]) == 2  # one rank: nothing to shard over
    assert "--shard-base needs --world-size above 1" in capsys.readouterr().err
