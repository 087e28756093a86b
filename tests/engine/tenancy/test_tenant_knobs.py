"""Per-tenant training knobs: learning-rate schedules and gradient clipping, per adapter.

References are torch's own: torch.optim.AdamW with a LambdaLR/CosineAnnealingLR schedule
and torch.nn.utils.clip_grad_norm_ over one adapter's parameters alone.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from loraplex_engine.spec.errors import AdapterError
from loraplex_engine.spec.experiment import parse_spec
from loraplex_engine.store.checkpoint import load_trainer_state, save_trainer_state
from loraplex_engine.train.lr_schedule import lr_factor
from loraplex_engine.train.optim import AdamWSettings, PerAdapterAdamW, adamw_settings

from tests.support.lora_helpers import multi_model

COSINE = AdamWSettings(
    lr=1e-2, weight_decay=0.0, lr_schedule="cosine", warmup_steps=2, total_steps=6
)
WARM_CONSTANT = AdamWSettings(lr=5e-3, weight_decay=0.1, warmup_steps=3)


# ---- the schedule as a pure function ---------------------------------------------------


def test_warmup_ramps_linearly_to_the_full_rate() -> None:
    assert [lr_factor(k, "constant", 4) for k in (1, 2, 3, 4, 5, 100)] == [
        0.25, 0.5, 0.75, 1.0, 1.0, 1.0,
    ]  # fmt: skip
    assert lr_factor(1, "constant") == 1.0  # no warmup: full rate from the first step


def test_cosine_key_steps() -> None:
    total, warmup = 12, 2
    f = [lr_factor(k, "cosine", warmup, total) for k in range(1, total + 1)]
    assert f[:2] == [0.5, 1.0]  # warmup
    assert f[2] == 1.0  # the first decay step is at the full rate
    decay = f[2:]
    assert all(a > b for a, b in itertools.pairwise(decay))  # strictly decreasing
    assert decay[5] == pytest.approx(0.5)  # halfway through the 10 decay steps
    assert 0 < f[-1] < 0.03  # the last step still moves the weights
    assert lr_factor(total + 5, "cosine", warmup, total) == f[-1]  # past the end: stays


def test_cosine_equals_torch_cosine_annealing() -> None:
    total = 7
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total)
    for k in range(1, total + 1):
        assert lr_factor(k, "cosine", 0, total) == pytest.approx(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()


def test_bad_schedules_are_refused() -> None:
    with pytest.raises(ValueError, match="total_steps"):
        lr_factor(1, "cosine", 0, 0)
    with pytest.raises(AdapterError, match="cosine needs total_steps"):
        AdamWSettings(lr=1e-3, lr_schedule="cosine", warmup_steps=5, total_steps=5)
    with pytest.raises(AdapterError, match="max_grad_norm"):
        AdamWSettings(lr=1e-3, max_grad_norm=0.0)


# ---- the spec --------------------------------------------------------------------------


def _spec(**algorithm):
    return parse_spec({"task": {"name": "copy"}, "algorithm": algorithm})


def test_spec_maps_to_optimiser_settings() -> None:
    spec = _spec(learningRate=0.01, lrSchedule="cosine", warmupSteps=3, maxSteps=20,
                 maxGradNorm=0.5)  # fmt: skip
    s = adamw_settings(spec.algorithm)
    assert (s.lr, s.lr_schedule, s.warmup_steps, s.total_steps, s.max_grad_norm) == (
        0.01, "cosine", 3, 20, 0.5,
    )  # fmt: skip
    default = adamw_settings(_spec().algorithm)
    assert (default.lr_schedule, default.warmup_steps, default.max_grad_norm) == (
        "constant", 0, None,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("algorithm", "field"),
    [
        ({"lrSchedule": "cosine", "maxSteps": 0}, "spec.algorithm.lrSchedule"),
        ({"lrSchedule": "cosine", "maxSteps": 4, "warmupSteps": 4}, "spec.algorithm.warmupSteps"),
        ({"maxGradNorm": 0.0}, "spec.algorithm.maxGradNorm"),
        ({"warmupSteps": -1}, "spec.algorithm.warmupSteps"),
        ({"lrSchedule": "linear"}, "spec.algorithm.lrSchedule"),
    ],
)
def test_spec_refuses_bad_knobs(algorithm: dict, field: str) -> None:
    with pytest.raises(Exception, match=field.replace(".", r"\.")):
        _spec(**algorithm)


def test_continual_run_may_warm_up_a_constant_rate() -> None:
    assert _spec(maxSteps=0, warmupSteps=10).algorithm.warmup_steps == 10


# ---- gradient clipping, per adapter ----------------------------------------------------


def _fused_grads(model, spike: dict[str, float]) -> None:
    """One fused forward/backward over rows of adapters a and b; b's loss scaled by
    ``spike[b]`` (a tenant whose loss blew up)."""
    g = torch.Generator().manual_seed(0)
    names = ("a", "b")
    ids = torch.randint(4, 200, (4, 8), generator=g)
    slots = torch.tensor([model.slot_of(n) for n in names for _ in range(2)])
    logits = model(ids, slot_ids=slots).logits
    per_row = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    per_adapter = per_row.mean(1).view(2, 2).mean(1)
    (per_adapter * torch.tensor([spike.get(n, 1.0) for n in names])).sum().backward()


def _adapter_grads(model, name: str) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.adapter_views(name, lambda p: p.grad).items()}


def _torch_reference(model, name, grads, settings: AdamWSettings) -> dict[str, torch.Tensor]:
    """One torch AdamW step on the adapter alone, its gradient clipped by clip_grad_norm_."""
    params = {k: v.clone().requires_grad_() for k, v in model.adapter_state_dict(name).items()}
    for k, p in params.items():
        p.grad = grads[k].clone()
    if settings.max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(list(params.values()), settings.max_grad_norm)
    opt = torch.optim.AdamW(list(params.values()), lr=settings.lr, weight_decay=0.0)
    opt.step()
    return {k: p.detach() for k, p in params.items()}


@pytest.mark.parametrize("spike", [1.0, 1e4], ids=["calm", "b-spikes"])
def test_clipping_is_per_adapter_and_equals_clip_grad_norm(tiny_model_dir, spike) -> None:
    settings = {
        "a": AdamWSettings(lr=1e-2, weight_decay=0.0, max_grad_norm=0.05),
        "b": AdamWSettings(lr=1e-2, weight_decay=0.0, max_grad_norm=1.0),
    }
    model = multi_model(tiny_model_dir)
    opt = PerAdapterAdamW(model)
    for name, s in settings.items():
        opt.add_adapter(name, s)
    _fused_grads(model, {"b": spike})
    grads = {n: _adapter_grads(model, n) for n in settings}
    norms = opt.grad_norms()
    for n in settings:  # the stacked per-slot norm is the adapter's own norm
        own = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads[n].values()]))
        torch.testing.assert_close(norms[model.slot_of(n)], own)
    assert norms[model.slot_of("a")] > 0.05  # a is really clipped, calm or not
    expected = {n: _torch_reference(model, n, grads[n], s) for n, s in settings.items()}
    opt.step([model.slot_of(n) for n in settings])
    for n in settings:
        got = model.adapter_state_dict(n)
        for key, ref in expected[n].items():
            torch.testing.assert_close(got[key], ref, rtol=1e-6, atol=1e-8)


def test_a_spike_in_one_tenant_leaves_the_other_update_unchanged(tiny_model_dir) -> None:
    """a's update is the same whether b's gradient is calm or 10,000 times larger: a
    global norm over the fused step would have shrunk a's update with b's spike."""
    after = []
    for spike in (1.0, 1e4):
        model = multi_model(tiny_model_dir)
        opt = PerAdapterAdamW(model)
        for n in ("a", "b"):
            opt.add_adapter(n, AdamWSettings(lr=1e-2, max_grad_norm=0.05))
        _fused_grads(model, {"b": spike})
        opt.step([model.slot_of("a"), model.slot_of("b")])
        after.append(model.adapter_state_dict("a"))
    for key, t in after[0].items():
        torch.testing.assert_close(after[1][key], t, rtol=1e-6, atol=1e-8)


# ---- schedules, fused across tenants and across a resume -------------------------------


def _random_grads(model, names, g) -> None:
    for p in (p for layer in model.lora_layers.values() for p in (layer.lora_A, layer.lora_B)):
        p.grad = torch.zeros_like(p)
    for n in names:
        for view in model.adapter_views(n, lambda p: p.grad).values():
            view.copy_(torch.randn(view.shape, generator=g))


def _fused_run(model_dir, steps: int, settings: dict[str, AdamWSettings]):
    model = multi_model(model_dir)
    opt = PerAdapterAdamW(model)
    for n, s in settings.items():
        opt.add_adapter(n, s)
    return model, opt, torch.Generator().manual_seed(7)


def _take_steps(model, opt, g, names, steps: int) -> list[dict[str, dict[str, torch.Tensor]]]:
    """``steps`` fused steps over ``names``; returns each step's gradients per adapter."""
    taken = []
    for _ in range(steps):
        _random_grads(model, names, g)
        taken.append({n: _adapter_grads(model, n) for n in names})
        opt.step([model.slot_of(n) for n in names])
        opt.zero_grad()
    return taken


def test_fused_tenants_on_different_schedules_each_equal_torch_alone(tiny_model_dir) -> None:
    settings = {"a": COSINE, "b": WARM_CONSTANT}
    model, opt, g = _fused_run(tiny_model_dir, 6, settings)
    start = {n: model.adapter_state_dict(n) for n in settings}
    grads = _take_steps(model, opt, g, list(settings), 6)
    for n, s in settings.items():
        params = {k: v.clone().requires_grad_() for k, v in start[n].items()}
        ref = torch.optim.AdamW(list(params.values()), lr=s.lr, weight_decay=s.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(
            ref, lambda e, s=s: lr_factor(e + 1, s.lr_schedule, s.warmup_steps, s.total_steps)
        )
        for step_grads in grads:
            for k, p in params.items():
                p.grad = step_grads[n][k]
            ref.step()
            sched.step()
        got = model.adapter_state_dict(n)
        for k, p in params.items():
            torch.testing.assert_close(got[k], p.detach(), rtol=1e-6, atol=1e-8)
    # The schedules really differ at the end: cosine near 0, constant at its full rate.
    assert COSINE.lr_at(6) < 0.2 * COSINE.lr and WARM_CONSTANT.lr_at(6) == WARM_CONSTANT.lr


def test_resume_keeps_the_schedule_position(tiny_model_dir, tmp_path: Path) -> None:
    """Stop after 3 of 6 cosine steps, restore into a fresh optimiser from the checkpoint
    (settings from the spec, step count from the state): steps 4-6 match the run that
    never stopped, which they would not if the schedule restarted at step 1."""
    settings = {"a": COSINE}
    model, opt, g = _fused_run(tiny_model_dir, 6, settings)
    _take_steps(model, opt, g, ["a"], 3)
    save_trainer_state(tmp_path, opt, "a")
    saved_weights = model.adapter_state_dict("a")
    g_state = g.get_state()
    _take_steps(model, opt, g, ["a"], 3)
    expected = model.adapter_state_dict("a")

    model2 = multi_model(tiny_model_dir)
    model2.load_adapter_state_dict("a", saved_weights)
    opt2 = PerAdapterAdamW(model2)
    load_trainer_state(tmp_path, opt2, "a")
    opt2.configure("a", adamw_settings(_spec(learningRate=1e-2, lrSchedule="cosine",
                                             warmupSteps=2, maxSteps=6).algorithm))  # fmt: skip
    assert opt2.step_count("a") == 3
    g2 = torch.Generator()
    g2.set_state(g_state)
    _take_steps(model2, opt2, g2, ["a"], 3)
    for k, t in expected.items():
        torch.testing.assert_close(model2.adapter_state_dict("a")[k], t, rtol=1e-6, atol=1e-8)
    assert math.isclose(opt2.settings[model2.slot_of("a")].lr_at(4), COSINE.lr_at(4))


def test_checkpoint_settings_from_before_the_knobs_still_load() -> None:
    """A trainer state written before these settings existed has only lr/betas/eps/wd."""
    old = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    s = AdamWSettings(**old)
    assert (s.lr_schedule, s.max_grad_norm, s.lr_at(10)) == ("constant", None, 1e-3)


# ---- through the engine ----------------------------------------------------------------


def test_engine_takes_the_knobs_from_the_spec_and_resumes_mid_schedule(
    tiny_model_dir, tmp_path: Path
) -> None:
    """The engine's optimiser gets the spec's schedule and clipping at placement, and a
    resume from the checkpoint on a fresh engine continues at the saved step count."""
    from tests.support.engine_builders import engine, spec

    body = spec(steps=6, group=2, prompts=1).to_json()
    body["algorithm"] |= {"lrSchedule": "cosine", "warmupSteps": 1, "maxGradNorm": 0.5}
    knobs = parse_spec(body)
    first = engine(tiny_model_dir, tmp_path / "a")
    first.put_experiment("default.x", knobs)
    first.tick()
    first.tick()
    ref = first.checkpoint_experiment("default.x")
    assert ref.step == 2 and first.optimizer.step_count("default.x") == 2
    first.close()

    second = engine(tiny_model_dir, tmp_path / "a")  # resumeFrom must lie under its root
    second.put_experiment("default.x", knobs, resume_from=ref.path)
    slot = second.model.slot_of("default.x")
    assert second.optimizer.step_count("default.x") == 2
    assert second.optimizer.settings[slot] == adamw_settings(knobs.algorithm)
    assert second.optimizer.settings[slot].lr_at(3) == pytest.approx(
        0.02 * lr_factor(3, "cosine", 1, 6)
    )
    second.close()


def test_clipping_leaves_other_slots_gradients_exactly_alone(tiny_model_dir) -> None:
    """Only the clipped slots are scaled: another slot's gradient, even a non-finite one
    (which the engine's guard refuses on its own), is untouched bit for bit."""
    model = multi_model(tiny_model_dir)
    opt = PerAdapterAdamW(model)
    opt.add_adapter("a", AdamWSettings(lr=1e-2, max_grad_norm=1e-3))
    opt.add_adapter("b", AdamWSettings(lr=1e-2))
    _random_grads(model, ["a", "b"], torch.Generator().manual_seed(3))
    next(iter(model.adapter_views("b", lambda p: p.grad).values()))[0, 0] = math.inf
    before = _adapter_grads(model, "b")
    opt.step([model.slot_of("a")])
    after = _adapter_grads(model, "b")
    assert all(torch.equal(after[k], t) for k, t in before.items())
    clipped = torch.linalg.vector_norm(
        torch.stack([g.norm() for g in _adapter_grads(model, "a").values()])
    )
    assert clipped == pytest.approx(1e-3, rel=1e-4)
