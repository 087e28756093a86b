"""The torch rollout decodes in micro-batches under a KV-cache token budget: the packing
(pure), outputs that do not depend on the budget, and the cache's measured peak bounded
by the budget whatever the number of tenants."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from loraplex_engine.lora.model import decode_forward
from loraplex_engine.memory.tracker import LiveBytes, storage_bytes
from loraplex_engine.rollout.base import RolloutRequest
from loraplex_engine.rollout.torch.backend import generate
from loraplex_engine.rollout.torch.packing import kv_tokens, pack_rollout
from loraplex_engine.rollout.torch.sampling import Sampler
from loraplex_engine.rollout.vllm.config import kv_bytes_per_token

from tests.support.engine_builders import engine, spec

UNLIMITED = 10**9


def _req(group: str, prompt: list[int], new: int = 4, slot: int = 1, **kw: Any) -> RolloutRequest:
    return RolloutRequest(slot, prompt, new, kw.pop("temperature", 0.0), group=group, **kw)


def _random_requests(seed: int) -> list[RolloutRequest]:
    """Several experiments of GRPO groups, prompts and limits of varied lengths, the
    experiments' rows interleaved in request order."""
    rng = random.Random(seed)
    rows = []
    for e in range(rng.randint(1, 6)):
        for _ in range(rng.randint(1, 3)):
            prompt = [rng.randrange(3, 50) for _ in range(rng.randint(1, 12))]
            new = rng.randint(1, 10)
            rows += [_req(f"e{e}", prompt, new, slot=e % 3) for _ in range(rng.randint(1, 6))]
    rng.shuffle(rows)
    return rows


# ---- packing (pure) --------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(40))
def test_packing_bounds_every_batch_and_places_every_row_once(seed: int) -> None:
    requests = _random_requests(seed)
    budget = random.Random(seed).choice([1, 10, 30, 80, 200, UNLIMITED])
    batches = pack_rollout(requests, budget)
    rows = [r for b in batches for r in b]
    assert sorted(rows) == list(range(len(requests)))
    for b in batches:
        assert b, "no empty micro-batch"
        assert kv_tokens(requests, b) <= budget or len(b) == 1
    assert pack_rollout(requests, budget) == batches  # deterministic


def test_an_experiment_that_fits_is_never_split_nor_depends_on_others() -> None:
    a = [_req("a", [5, 6, 7], 5) for _ in range(4)]  # 4 x 8 = 32 tokens
    b = [_req("b", [9], 3) for _ in range(6)]  # 6 x 4 = 24
    c = [_req("c", [4, 4], 2) for _ in range(3)]  # 3 x 4 = 12
    requests = [*a[:2], *b, *a[2:], *c]
    batches = pack_rollout(requests, 45)  # b + c: 9 rows x (2 + 3), padded
    groups = [{requests[i].group for i in batch} for batch in batches]
    assert groups == [{"a"}, {"b", "c"}]  # b does not fit next to a: a new batch
    assert batches[0] == [0, 1, 8, 9]  # a's rows together, in request order


def test_an_experiment_over_the_budget_splits_by_prompt_group_then_by_rows() -> None:
    g1 = [_req("a", [5, 6], 2) for _ in range(3)]  # 3 x 4 = 12 tokens
    g2 = [_req("a", [7, 8], 2) for _ in range(5)]  # 5 x 4 = 20: over the budget
    before = [_req("z", [3], 1)]  # 2 tokens
    requests = [*before, *g1, *g2]
    batches = pack_rollout(requests, 13)
    assert batches == [[0], [1, 2, 3], [4, 5, 6], [7, 8]]
    # The split does not depend on who came before: alone it is the same.
    assert pack_rollout(requests[1:], 13) == [[i - 1 for i in b] for b in batches[1:]]


def test_a_row_over_the_budget_goes_alone_and_a_bad_budget_is_refused() -> None:
    requests = [_req("a", [5] * 10, 10), _req("a", [5] * 10, 10), _req("b", [6], 1)]
    assert pack_rollout(requests, 5) == [[0], [1], [2]]
    with pytest.raises(ValueError, match="rollout_kv_tokens must be at least 1"):
        pack_rollout(requests, 0)


# ---- the device sampler ------------------------------------------------------------------


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 1.0), (1.3, 0.8)])
def test_the_exponential_race_samples_the_tempered_nucleus(temperature, top_p) -> None:
    """40,000 rows, one draw each, against the exact distribution (sd of a frequency
    here <= 0.0025; measured max deviation 0.0018)."""
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0])
    n, gen = 40000, torch.Generator().manual_seed(1)
    rows = [
        RolloutRequest(0, [1], 1, temperature, generator=gen, group="a", top_p=top_p)
        for _ in range(n)
    ]
    draw = Sampler(rows, torch.device("cpu")).step(logits.expand(n, 5).clone())
    freq = torch.bincount(draw.tokens, minlength=5).float() / n
    p = (logits / temperature).softmax(-1)
    ranked, order = p.sort(descending=True)
    keep = ranked.cumsum(0) - ranked < top_p
    want = torch.zeros(5).index_put((order[keep],), ranked[keep])
    assert (freq - want / want.sum()).abs().max() < 0.01
    assert torch.equal(draw.logprobs, (logits / temperature).log_softmax(-1)[draw.tokens])


def test_a_non_finite_row_breaks_its_group_only() -> None:
    a = [RolloutRequest(0, [1], 1, 1.0, group="a") for _ in range(2)]
    b = [RolloutRequest(0, [1], 1, 0.0, group="b") for _ in range(2)]
    logits = torch.zeros(4, 5)
    logits[1, 3] = float("nan")
    draw = Sampler([*a, *b], torch.device("cpu")).step(logits)
    assert draw.broken.tolist() == [True, True, False, False]
    assert draw.tokens[:2].tolist() == [0, 0] and draw.logprobs[:2].isnan().all()
    assert draw.logprobs[2:].isfinite().all()


# ---- generate on the tiny model ----------------------------------------------------------


@pytest.fixture(scope="module")
def eng(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """An engine with two adapters of random B (fresh ones decode like the base)."""
    e = engine(tiny_model_dir, tmp_path_factory.mktemp("ckpt"))
    gen = torch.Generator().manual_seed(0)
    for target in ("yes", "no"):
        e.put_experiment(f"t.{target}", spec(), "t")
        slot = e.model.slot_of(f"t.{target}")
        with torch.no_grad():
            for layer in e.model.lora_layers.values():
                b = layer.lora_B[slot]
                b.copy_(torch.randn(b.shape, generator=gen) * 0.5)
    yield e
    e.close()


def _tenants(eng: Any, count: int, temperature: float = 1.0) -> list[RolloutRequest]:
    """``count`` experiments of 2 prompts x 4 samples (6 prompt + 8 new tokens each),
    over the base and both adapters, each with its own seeded generator."""
    slots = [0, eng.model.slot_of("t.yes"), eng.model.slot_of("t.no")]
    rows = []
    for t in range(count):
        gen = torch.Generator().manual_seed(1000 + t)
        for p in range(2):
            prompt = [(7 * t + 3 * p + k) % 400 + 5 for k in range(6)]
            rows += [
                RolloutRequest(slots[t % 3], prompt, 8, temperature, generator=gen, group=f"t{t}")
                for _ in range(4)
            ]
    return rows


def _run(eng: Any, requests: list[RolloutRequest], budget: int, forward: Any = None) -> list:
    fwd = forward or decode_forward(eng.model, eng.device)
    return generate(eng.model.route, fwd, requests, eng.codec.pad_id, (), budget)


def _mixed(eng: Any, temperature: float) -> list[RolloutRequest]:
    """Tenants with prompts of different lengths, interleaved in request order."""
    yes, no = eng.model.slot_of("t.yes"), eng.model.slot_of("t.no")
    short, long = eng.codec.encode("say"), eng.codec.encode("the answer say yes:")
    rows = []
    for t, (slot, prompt, new) in enumerate([(yes, long, 6), (no, short, 9), (0, long, 4)]):
        gen = torch.Generator().manual_seed(t)
        rows += [
            RolloutRequest(slot, prompt, new, temperature, generator=gen, group=f"e{t}")
            for _ in range(3)
        ]
    return [rows[i] for i in (0, 3, 6, 1, 4, 7, 2, 5, 8)]


def test_greedy_outputs_do_not_depend_on_the_budget(eng) -> None:
    requests = _mixed(eng, 0.0)
    whole = _run(eng, requests, UNLIMITED)
    for budget in (1, 25, 60):  # a row per batch; groups split by rows; some together
        small = _run(eng, requests, budget)
        for got, ref in zip(small, whole, strict=True):
            assert got.token_ids == ref.token_ids
            torch.testing.assert_close(got.logprobs, ref.logprobs, rtol=1e-4, atol=1e-5)
    assert len({tuple(c.token_ids) for c in whole}) > 1  # the rows do differ


def test_sampled_outputs_do_not_depend_on_the_budget_while_each_experiment_fits(eng) -> None:
    # Each experiment costs 3 x (longest prompt + its limit) tokens; the budget fits the
    # largest alone, so they decode in different micro-batches than under no limit.
    rows = _mixed(eng, 1.0)
    one = max(
        kv_tokens(rows, [i for i, r in enumerate(rows) if r.group == g]) for g in ("e0", "e1", "e2")
    )
    assert one < kv_tokens(rows, range(len(rows)))
    ref = _run(eng, _mixed(eng, 1.0), UNLIMITED)
    got = _run(eng, _mixed(eng, 1.0), one)
    assert [c.token_ids for c in got] == [c.token_ids for c in ref]
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=1e-4, atol=1e-5)
    # ... and the draw is random: another seed samples otherwise.
    other = _mixed(eng, 1.0)
    for r in other:
        r.generator = torch.Generator().manual_seed(99)
    assert [c.token_ids for c in _run(eng, other, one)] != [c.token_ids for c in ref]


def test_a_streamed_row_reports_its_tokens_and_stops_when_cancelled(eng) -> None:
    class Sink:
        def __init__(self, stop_after: int | None) -> None:
            self.tokens: list[int] = []
            self.stop_after = stop_after

        def push(self, token_id: int, logprob: float, top: dict[int, float] | None) -> None:
            self.tokens.append(token_id)

        def cancelled(self) -> bool:
            return self.stop_after is not None and len(self.tokens) >= self.stop_after

    sinks = [Sink(None), Sink(3)]
    requests = _mixed(eng, 0.0)[:3]
    requests[0].sink, requests[1].sink = sinks
    requests[0].top_logprobs = 2
    out = _run(eng, requests, 1)
    assert sinks[0].tokens == out[0].token_ids and len(out[0].token_ids) == 6
    assert out[0].top_logprobs is not None and all(len(t) == 2 for t in out[0].top_logprobs)
    assert sinks[1].tokens == out[1].token_ids and len(out[1].token_ids) == 3
    assert out[1].finish_reason == "cancelled" and out[2].finish_reason == "length"


# ---- measured KV memory ------------------------------------------------------------------


def _measured(eng: Any, tenants: int, budget: int) -> tuple[int, int]:
    """(peak bytes of the KV cache after any forward, peak of all bytes the rollout
    allocates) for ``tenants`` experiments."""
    cache: list[int] = []

    def forward(ids, mask, positions, past):  # type: ignore[no-untyped-def]
        logits, past = decode_forward(eng.model, eng.device)(ids, mask, positions, past)
        layers = past.layers
        cache.append(storage_bytes([t for x in layers for t in (x.keys, x.values)]))
        return logits, past

    requests = _tenants(eng, tenants)
    with LiveBytes() as tracker:
        _run(eng, requests, budget, forward)
    return max(cache), tracker.peaks["default"].bytes


def test_peak_kv_memory_is_bounded_by_the_budget_whatever_the_tenants(eng) -> None:
    per_token = kv_bytes_per_token(eng.model.base_model.config, 4)  # float32
    budget = 256  # two tenants' 8 rows x 14 tokens
    bounded = {n: _measured(eng, n, budget) for n in (2, 8, 32)}
    unbounded = {n: _measured(eng, n, UNLIMITED) for n in (2, 8, 32)}
    for cache, _ in bounded.values():
        assert cache <= budget * per_token
    assert bounded[32][0] == bounded[2][0]  # the cache: one micro-batch, the same for each
    assert bounded[32][1] <= 1.1 * bounded[2][1]  # everything the rollout allocates
    assert unbounded[32][0] >= 12 * unbounded[2][0]  # one batch: grows with the tenants
    # Measured: bounded 1.03 MB for 2, 8 and 32 tenants; unbounded 1.03, 1.9, 5.4 MB.
    assert unbounded[32][1] >= 4 * bounded[32][1]
