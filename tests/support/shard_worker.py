"""One rank of the two-process sharded-base tests in test_sharding.py (torch.multiprocessing
spawns it): the tiny model's base sharded with FSDP2 over two gloo ranks, trained and
decoded with unequal work per rank; it saves what came out for the parent to compare
with one unsharded process."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import torch
from loraplex_engine.lora.layers import LoRAConfig
from loraplex_engine.lora.model import MultiLoRAModel, adaptable_module_names, decode_forward
from loraplex_engine.memory.capacity_plan import static_bytes
from loraplex_engine.memory.plan_sharding import fsdp_groups, unsharded_reserve
from loraplex_engine.parallel import distributed, sharding
from loraplex_engine.parallel.data_parallel import DataParallelTraining
from loraplex_engine.parallel.distributed import World
from loraplex_engine.parallel.lockstep import Lockstep
from loraplex_engine.rollout.backends import TorchRollout
from loraplex_engine.rollout.base import Completion, RolloutRequest
from loraplex_engine.train.algorithms import ClippedRatioLoss
from loraplex_engine.train.chunked_logprobs import HiddenStatesForward
from loraplex_engine.train.optim import AdamWSettings, PerAdapterAdamW
from loraplex_engine.train.rows import TrainRow, count_rows
from loraplex_engine.train.step import fused_backward, score_rows

from tests.support.lora_helpers import CONFIGS, load_base, random_tick_rows, randomise_b

CPU = torch.device("cpu")
HEAD_ONLY = LoRAConfig(rank=4, alpha=8.0, target_modules=("lm_head",))
BUDGET = 48  # training tokens per micro-batch: several micro-batches per share
KV_TOKENS = 40  # rollout KV tokens per micro-batch: an experiment spans several


def build(model_dir: Path) -> MultiLoRAModel:
    """Adapters a, b, c (decoder projections) and d (lm_head alone), random A and B."""
    base = load_base(model_dir)
    model = MultiLoRAModel(base, 4, 8, target_modules=adaptable_module_names(base))
    for i, (name, cfg) in enumerate({**CONFIGS, "d": HEAD_ONLY}.items()):
        model.add_adapter(name, cfg, seed=i)
        randomise_b(model, name, seed=100 + i)
    return model


def tick_rows(model: MultiLoRAModel) -> list[TrainRow]:
    """Prompt groups of 1-3 rows for each adapter, random tokens."""
    return random_tick_rows(model, (*CONFIGS, "d"), (3, 1, 2), max_prompt=7, max_done=5)


UPDATES = {n: ClippedRatioLoss(kl_coef=0.1 if n == "b" else 0.0) for n in (*CONFIGS, "d")}


def shares(rows: list[TrainRow], case: str) -> list[list[TrainRow]]:
    """Per rank, its rows: 'all-on-0' (rank 1 has none), 'head-vs-layers' (rank 0 only
    the lm_head adapter's rows, fewer micro-batches; rank 1 the others, with KL)."""
    if case == "all-on-0":
        return [rows, []]
    return [[r for r in rows if r.experiment == "d"], [r for r in rows if r.experiment != "d"]]


def lora_grads(model: MultiLoRAModel) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def train_grads(
    model: MultiLoRAModel, rows: list[TrainRow], counts: dict[str, int], ckpt: bool, lockstep=None
) -> None:
    fused_backward(
        HiddenStatesForward(model, CPU),
        rows,
        UPDATES,
        0,
        BUDGET,
        None,
        gradient_checkpointing=ckpt,
        row_counts=counts,
        lockstep=lockstep,
    )


@torch.no_grad()
def score(model: MultiLoRAModel, rows: list[TrainRow], lockstep=None) -> list[torch.Tensor]:
    """The trainer's old log-probs of ``rows`` (AdapterTrainer.rescore's score_rows)."""
    model.eval()
    return score_rows(HiddenStatesForward(model, CPU), rows, 0, BUDGET, None, lockstep)


def requests(case: str) -> list[RolloutRequest]:
    """'two': experiments a (sampled) and c (greedy), split over the ranks;
    'one': experiment b alone (rank 1 decodes nothing) over several micro-batches."""
    out = []
    names = ["a", "c"] if case == "two" else ["b"]
    for i, name in enumerate(names):
        gen = torch.Generator().manual_seed(40 + i)
        for p in range(3):
            prompt = [5 + p, 17 + 3 * p, 9, 33 + i]
            for _ in range(2):
                temp = 0.0 if name == "c" else 1.0
                out.append(RolloutRequest(1 + "abc".index(name), prompt, 6, temp, gen, name))
    return out


def torch_rollout(model: MultiLoRAModel, lockstep=None) -> TorchRollout:
    return TorchRollout(model.route, decode_forward(model), 0, (), KV_TOKENS, lockstep)


def run_rank(rank: int, port: int, model_dir: str, out: str) -> None:
    os.environ.update(MASTER_ADDR=distributed.LOOPBACK, MASTER_PORT=str(port))
    torch.set_num_threads(1)
    world = World(rank, 2)
    distributed.join(world, CPU, timeout_s=120)
    try:
        _run(world, Path(model_dir), Path(out))
    finally:
        distributed.leave()


def _run(world: World, model_dir: Path, out: Path) -> None:
    model = build(model_dir)
    unsharded_bytes = static_bytes(model).base
    sharding.shard_base(model, world, CPU)
    lockstep = Lockstep(CPU)
    saved: dict[str, Any] = {
        # (whole base, this rank's static bytes, FSDP's unsharded reserve within them)
        "bytes": (
            unsharded_bytes,
            static_bytes(model).base,
            unsharded_reserve(*fsdp_groups(model.base_model)),
        ),
        "plain_adapter": all(
            type(t) is torch.Tensor for t in model.adapter_state_dict("a").values()
        ),
    }
    rows = tick_rows(model)
    for case in ("all-on-0", "head-vs-layers"):
        for ckpt in (False, True):
            model.zero_grad(set_to_none=True)
            mine = shares(rows, case)[world.rank]
            train_grads(model, mine, count_rows(rows), ckpt, lockstep)
            optimizer_params = [
                p for layer in model.lora_layers.values() for p in layer.parameters(recurse=False)
            ]
            distributed.all_reduce_lora_grads(optimizer_params)
            saved[f"grads/{case}/{ckpt}"] = lora_grads(model)
    for case in ("all-on-0", "head-vs-layers"):  # the trainer's rescoring (a vLLM rollout)
        saved[f"scores/{case}"] = score(model, shares(rows, case)[world.rank], lockstep)
    saved["train_rounds"] = lockstep.rounds

    optimizer = PerAdapterAdamW(model)
    for name in model.adapters():
        optimizer.add_adapter(name, AdamWSettings(lr=0.01))
    dp = DataParallelTraining(
        model, optimizer, CPU, 0, BUDGET, None, world=world, lockstep=lockstep
    )
    dp.decode = torch_rollout(model, lockstep).generate_local
    if world.is_leader:
        for case in ("two", "one"):
            reqs = requests(case)
            saved[f"rollout/{case}"] = dp.rollout(reqs)
            saved[f"states/{case}"] = [r.generator.get_state() for r in reqs]
        dp.stop()
    else:
        dp.follow()
    saved["rounds"] = lockstep.rounds
    torch.save(saved, out / f"rank{world.rank}.pt")


def reference_rollout(
    model: MultiLoRAModel, case: str
) -> tuple[list[Completion], list[torch.Tensor]]:
    reqs = requests(case)
    done = torch_rollout(model).generate(reqs)
    return done, [r.generator.get_state() for r in reqs]


def tied_model(model_dir: Path) -> MultiLoRAModel:
    """A tied-head model (the tiny Gemma 3) with one adapter on q and v, random B."""
    base = load_base(model_dir)
    model = MultiLoRAModel(base, 1, 4, target_modules=adaptable_module_names(base))
    model.add_adapter("a", LoRAConfig(rank=4, alpha=8.0), seed=0)
    randomise_b(model, "a", seed=1)
    return model


def tied_grads(model: MultiLoRAModel, rows: list[TrainRow]) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    train_grads(model, rows, count_rows(rows), ckpt=True)
    return lora_grads(model)


def tied_rows(model: MultiLoRAModel) -> list[TrainRow]:
    rng = random.Random(1)
    return [
        TrainRow("a", 1, [rng.randrange(4, 200) for _ in range(5)], [7, 9], [-5.0, -5.0], adv, 1.0)
        for adv in (0.5, -1.0, 0.25)
    ]


def run_tied_rank(rank: int, port: int, model_dir: str, out: str) -> None:
    """Shard a tied model (its embedding is its head: kept replicated) and train all the
    rows on each rank, checkpointed: the gradient is the unsharded one."""
    os.environ.update(MASTER_ADDR=distributed.LOOPBACK, MASTER_PORT=str(port))
    torch.set_num_threads(1)
    world = World(rank, 2)
    distributed.join(world, CPU, timeout_s=120)
    try:
        model = tied_model(Path(model_dir))
        sharding.shard_base(model, world, CPU)
        head = model.base_model.get_output_embeddings().weight
        saved = {
            "grads": tied_grads(model, tied_rows(model)),
            "head_plain": type(head) is not torch.distributed.tensor.DTensor,
            "sharded_layers": sharding.is_sharded(model),
        }
        torch.save(saved, Path(out) / f"tied{rank}.pt")
    finally:
        distributed.leave()
