"""`--device` of `run` and `serve` (one setting, settings/engine.py): what each value means per
rank, and the process group's backend (pure functions, tested directly; the CUDA
branches included, which this CPU machine cannot run)."""

from __future__ import annotations

import pytest
import torch
from loraplex_engine.cli import build_parser
from loraplex_engine.parallel.distributed import backend_for, device_for_rank, local_rank
from loraplex_engine.spec.errors import UsageError


@pytest.mark.parametrize(
    ("requested", "world_size", "rank", "gpus", "device"),
    [
        ("auto", 1, 0, 0, "cpu"),
        ("auto", 1, 0, 2, "cuda"),
        ("auto", 2, 1, 2, "cuda:1"),  # each rank its own GPU
        ("auto", 2, 1, 0, "cpu"),  # gloo ranks on the CPU
        ("cpu", 2, 1, 8, "cpu"),  # cpu asked for: never a GPU
        ("cuda", 1, 0, 1, "cuda"),
        ("cuda", 2, 0, 2, "cuda:0"),
        ("cuda", 4, 3, 8, "cuda:3"),
        ("cuda:1", 1, 0, 2, "cuda:1"),
    ],
)
def test_each_rank_gets_its_device(requested, world_size, rank, gpus, device) -> None:
    assert device_for_rank(requested, world_size, rank, gpus) == device


@pytest.mark.parametrize(
    ("requested", "world_size", "gpus", "message"),
    [
        ("cuda", 1, 0, "--device cuda: torch sees no CUDA device here"),
        ("cuda:0", 2, 0, "--device cuda:0: torch sees no CUDA device here"),
        ("cuda:0", 2, 2, "--device cuda:0 puts every rank on one GPU"),
        ("cuda:2", 1, 2, "--device cuda:2: torch sees 2 CUDA device(s)"),
        ("cuda", 4, 2, "--world-size 4 on cuda needs a GPU per rank; torch sees 2"),
        ("auto", 4, 2, "--world-size 4 on cuda needs a GPU per rank; torch sees 2"),
    ],
)
def test_a_device_this_machine_lacks_is_named(requested, world_size, gpus, message) -> None:
    with pytest.raises(UsageError) as e:
        device_for_rank(requested, world_size, 0, gpus)
    assert str(e.value).startswith(message)


def test_nccl_on_cuda_gloo_on_the_cpu() -> None:
    assert backend_for(torch.device("cuda:1")) == "nccl"
    assert backend_for(torch.device("cpu")) == "gloo"


def test_local_rank_from_torchruns_variables() -> None:
    assert local_rank({}) == 0  # rank 0 starting its own workers
    assert local_rank({"RANK": "3"}) == 3
    assert local_rank({"RANK": "9", "LOCAL_RANK": "1"}) == 1  # a second node's rank 9


@pytest.mark.parametrize("command", ["run", "serve"])
def test_device_values_parse_the_same_for_run_and_serve(command, capsys) -> None:
    base = ["run", "m.yaml", "--model", "m"] if command == "run" else ["serve"]
    parse = build_parser().parse_args
    assert parse(base).device == "auto"
    for given, parsed in (("cpu", "cpu"), ("CUDA", "cuda"), ("cuda:3", "cuda:3"), ("", "auto")):
        assert parse([*base, "--device", given]).device == parsed
    for bad in ("gpu", "cuda:", "cuda:x", "cuda:-1", "mps"):
        with pytest.raises(SystemExit) as e:
            parse([*base, "--device", bad])
        assert e.value.code == 2
        err = capsys.readouterr().err.splitlines()[-1]
        assert f"argument --device: invalid device: {bad!r}; choose auto, cpu, cuda" in err


def test_serve_reads_its_device_and_shard_base_from_the_environment(monkeypatch, capsys) -> None:
    monkeypatch.setenv("LORAPLEX_DEVICE", "cpu")
    monkeypatch.setenv("LORAPLEX_SHARD_BASE", "true")
    args = build_parser().parse_args(["serve"])
    assert (args.device, args.shard_base) == ("cpu", True)
    assert build_parser().parse_args(["serve", "--device", "cuda"]).device == "cuda"
    monkeypatch.setenv("LORAPLEX_DEVICE", "tpu")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve"])
    assert "invalid device: 'tpu' (from LORAPLEX_DEVICE)" in capsys.readouterr().err
    monkeypatch.delenv("LORAPLEX_SHARD_BASE")
    assert build_parser().parse_args(["serve", "--device", "cpu"]).shard_base is False
