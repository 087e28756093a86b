"""The torch rollout beside training (rollout/torch/streams.py, docs/design/pipeline.md).

The side stream itself needs a GPU (bench/gpu_device.py ``torch_pipelined`` times it and
checks parity there). Here, on the CPU, what it rests on:

- routing is per thread: two threads forwarding the same multi-LoRA model through
  different slots at the same moment each get their own adapters' output (the side
  stream's rollout thread and the tick thread do that);
- the checks that decide whether a tick may overlap (pure);
- on the CPU the pipelined engine never takes the side stream, so its behaviour is the
  one test_pipelined.py checks against the sync schedule.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch
from loraplex_engine.rollout.torch.streams import (
    StaticFacts,
    TickFacts,
    fits,
    overlap_blocker,
    static_blocker,
)
from loraplex_engine.spec.api_types import MemoryPlan
from loraplex_engine.tick.pipelined import PipelinedTick

from tests.support.engine_builders import engine
from tests.support.lora_helpers import multi_model


def test_two_threads_route_one_model_each_through_its_own_slots(tiny_model_dir: Path) -> None:
    model = multi_model(tiny_model_dir)
    ids = torch.tensor([[5, 9, 13, 2]] * 2)
    alone = {}
    with torch.no_grad():
        for slot in (1, 2):
            alone[slot] = model(ids, slot_ids=torch.tensor([slot, slot])).logits
    assert not torch.allclose(alone[1], alone[2])  # the adapters differ: the test can tell
    inside = threading.Barrier(2)
    got: dict[int, torch.Tensor] = {}

    def forward(slot: int) -> None:
        with torch.no_grad(), model.route(torch.tensor([slot, slot])):
            inside.wait(10)  # both routes are set before either forward runs
            got[slot] = model.base_model(input_ids=ids).logits
            inside.wait(10)  # neither route is unset before both forwards ran

    threads = [threading.Thread(target=forward, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for slot in (1, 2):
        torch.testing.assert_close(got[slot], alone[slot], rtol=0, atol=0)
    assert all(layer.router is None for layer in model.lora_layers.values())


def _facts(**kw: object) -> StaticFacts:
    base = dict(
        device_type="cuda",
        torch_rollout=True,
        single_process=True,
        checkpointing=False,
        attention_dropout=0.0,
    )
    return StaticFacts(**(base | kw))  # type: ignore[arg-type]


def test_when_the_torch_rollout_can_ever_overlap() -> None:
    assert static_blocker(_facts()) is None
    assert static_blocker(_facts(device_type="cpu")) == "not on CUDA"
    assert static_blocker(_facts(torch_rollout=False)) == "the sampler is not the trainer's model"
    assert static_blocker(_facts(single_process=False)) == "data parallel or lockstep ranks"
    assert static_blocker(_facts(checkpointing=True)) == "gradient checkpointing is on"
    assert static_blocker(_facts(attention_dropout=0.1)) == "the base model has attention dropout"


GIB = 2**30


def _plan(**kw: object) -> MemoryPlan:
    base = dict(
        device_total_bytes=80 * GIB,
        device_bytes=80 * GIB,
        headroom=0.0,
        base_bytes=16 * GIB,
        slot_bytes=1 * GIB,
        slots=9,  # static: 25 GiB, so 55 GiB free
        activation_fixed_bytes=1 * GIB,
        activation_bytes_per_token=1_000_000,
        activation_bytes_per_adapter=10_000_000,
        kv_bytes_per_token=100_000,
        micro_batch_tokens=40_000,
        rollout_kv_tokens=500_000,
        derived=[],
    )
    return MemoryPlan(**(base | kw))  # type: ignore[arg-type]


def test_both_working_sets_must_fit_in_what_the_static_bytes_leave() -> None:
    plan = _plan()
    # train: 1 GiB + 20k tokens x 1 MB + 4 x 10 MB ≈ 19.7 GiB; KV: 300k x 100 kB ≈ 27.9 GiB
    assert fits(plan, train_tokens=20_000, adapters=4, rollout_tokens=300_000)
    # The micro-batch is at most its budget (40k tokens: 38.3 GiB of activations) however
    # many tokens train; with 200k KV tokens (18.6 GiB) that is more than 55 GiB.
    assert not fits(plan, train_tokens=10**6, adapters=4, rollout_tokens=200_000)
    assert fits(plan, train_tokens=10**6, adapters=4, rollout_tokens=100_000)
    # The KV cache is at most its budget: one micro-batch of the rollout at a time.
    assert fits(_plan(rollout_kv_tokens=10_000), train_tokens=20_000, adapters=4,
                rollout_tokens=10**7)  # fmt: skip
    assert not fits(_plan(headroom=0.5), train_tokens=20_000, adapters=4, rollout_tokens=300_000)
    # Costs the plan did not measure (micro-batch budget given, CPU without --device-memory)
    assert not fits(_plan(activation_fixed_bytes=None), 1, 1, 1)
    assert not fits(_plan(device_bytes=None), 1, 1, 1)


def _tick(**kw: object) -> TickFacts:
    base = dict(
        rollout_slots=frozenset({1, 2}),
        trained_slots=frozenset({3, 4}),
        dropout_slots=frozenset({4}),
        client_train=False,
        train_tokens=1000,
        train_adapters=2,
        rollout_tokens=1000,
    )
    return TickFacts(**(base | kw))  # type: ignore[arg-type]


def test_a_tick_overlaps_only_disjoint_cohorts() -> None:
    plan = _plan()
    assert overlap_blocker(plan, _tick()) is None
    assert overlap_blocker(plan, _tick(rollout_slots=frozenset({1, 3}))) == (
        "a slot is read by the rollout and written by the update"
    )  # a stale experiment generating while its own update is made
    assert overlap_blocker(plan, _tick(dropout_slots=frozenset({2}))) == (
        "a slot the rollout reads has LoRA dropout"
    )
    assert overlap_blocker(plan, _tick(client_train=True)) == "a client model trains"
    assert overlap_blocker(plan, _tick(rollout_tokens=10**6, train_tokens=10**6)) == (
        "the two working sets do not fit together"
    )
    assert overlap_blocker(None, _tick()) == "the two working sets do not fit together"


def test_on_the_cpu_the_pipelined_engine_never_takes_a_side_stream(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from tests.support.pipelined_specs import staleness_specs

    eng = engine(tiny_model_dir, tmp_path, schedule="pipelined")
    tick = eng._tick
    assert isinstance(tick, PipelinedTick)
    assert tick.streams is None and tick.stream_blocker == "not on CUDA"
    for exp_id, s in staleness_specs(0).items():
        eng.put_experiment(exp_id, s)
    while eng.tick() is not None:
        pass
    assert tick.side_stream_ticks == 0 and tick.stream_blocker == "not on CUDA"


def test_each_tick_decides_from_its_own_cohorts(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The per-tick decision on a real engine's cohorts, with the CUDA side stream stood in
    for (none exists on the CPU: the decision is recorded, the stages then run in turn).
    On-policy cohorts are disjoint, so every tick that trains and generates may overlap;
    an experiment allowing staleness generates in the tick that trains it, so those may
    not (its slot would be read while written)."""
    from tests.support.pipelined_specs import staleness_specs

    def decisions(staleness: int, root: Path) -> list[str | None]:
        eng = engine(tiny_model_dir, root, schedule="pipelined")
        tick = eng._tick
        side, got = object(), []
        tick.streams, tick.memory_plan = side, _plan()  # type: ignore[assignment]
        decide = tick._side_stream

        def record(*args: object) -> None:
            chosen = decide(*args)  # type: ignore[arg-type]
            got.append(None if chosen is side else tick.stream_blocker)
            return None  # the CPU runs the stages in turn

        tick._side_stream = record  # type: ignore[method-assign]
        for exp_id, s in staleness_specs(staleness).items():
            eng.put_experiment(exp_id, s)
        while eng.tick() is not None:
            pass
        assert all(eng.get_experiment(e).phase == "Succeeded" for e in staleness_specs(staleness))
        return got

    strict = decisions(0, tmp_path / "strict")
    assert strict and all(d is None for d in strict), strict
    stale = decisions(1, tmp_path / "stale")
    assert "a slot is read by the rollout and written by the update" in stale, stale
