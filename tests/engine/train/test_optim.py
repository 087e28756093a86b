import pytest
import torch
from loraplex_engine.spec.errors import AdapterError
from loraplex_engine.train.optim import AdamWSettings, PerAdapterAdamW

from tests.support.lora_helpers import CONFIGS, batch, multi_model, peft_model, rel_err

SETTINGS = {
    "a": AdamWSettings(lr=1e-2),
    "b": AdamWSettings(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
    "c": AdamWSettings(lr=1e-2, weight_decay=0.0),
}


def _set_grads(model, grads_by_name):
    """Write per-adapter gradients (PEFT keys) into the stacked .grad tensors."""
    for p in (p for layer in model.lora_layers.values() for p in (layer.lora_A, layer.lora_B)):
        p.grad = torch.zeros_like(p)
    for name, grads in grads_by_name.items():
        views = model.adapter_views(name, lambda p: p.grad)
        for key, g in grads.items():
            views[key].copy_(g)


def test_k_steps_equal_a_torch_adamw_per_adapter(tiny_model_dir) -> None:
    model = multi_model(tiny_model_dir)
    opt = PerAdapterAdamW(model)
    refs, ref_opts = {}, {}
    for name, s in SETTINGS.items():
        opt.add_adapter(name, s)
        refs[name] = {
            k: v.clone().requires_grad_() for k, v in model.adapter_state_dict(name).items()
        }
        ref_opts[name] = torch.optim.AdamW(
            list(refs[name].values()),
            lr=s.lr,
            betas=s.betas,
            eps=s.eps,
            weight_decay=s.weight_decay,
        )
    g = torch.Generator().manual_seed(0)
    # Step 3 leaves out "c": it must not be stepped (no step count, no decay, no momentum).
    schedule = [("a", "b", "c"), ("a", "b", "c"), ("a", "b"), ("a", "b", "c"), ("b", "c")]
    for names in schedule:
        grads = {
            n: {k: torch.randn(v.shape, generator=g) for k, v in refs[n].items()} for n in names
        }
        _set_grads(model, grads)
        assert sorted(opt.step()) == sorted(model.slot_of(n) for n in names)
        opt.zero_grad()
        for n in names:
            for k, p in refs[n].items():
                p.grad = grads[n][k]
            ref_opts[n].step()
            ref_opts[n].zero_grad()
    for name in SETTINGS:
        assert opt.step_count(name) == sum(name in s for s in schedule)
        got = model.adapter_state_dict(name)
        for key, ref in refs[name].items():
            torch.testing.assert_close(got[key], ref.detach(), rtol=1e-6, atol=1e-8)
            state = ref_opts[name].state[ref]
            assert state["step"].item() == opt.step_count(name)


def test_step_rejects_slots_without_settings(tiny_model_dir) -> None:
    model = multi_model(tiny_model_dir)
    opt = PerAdapterAdamW(model)
    opt.add_adapter("a", SETTINGS["a"])
    for p in opt.params:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in opt.params]
    with pytest.raises(AdapterError, match="no optimiser settings"):
        opt.step()
    assert all(torch.equal(b, p) for b, p in zip(before, opt.params, strict=True))
    assert opt.step_count("a") == 0


def test_state_dict_roundtrip(tiny_model_dir) -> None:
    model = multi_model(tiny_model_dir)
    opt = PerAdapterAdamW(model)
    opt.add_adapter("b", SETTINGS["b"])
    for p in opt.params:
        p.grad = torch.randn_like(p)
    opt.step([model.slot_of("b")])
    sd = opt.state_dict("b")
    assert sd["step"] == 1 and sd["settings"]["lr"] == SETTINGS["b"].lr
    opt2 = PerAdapterAdamW(model)
    opt2.load_state_dict("b", sd)
    assert opt2.state_dict("b")["step"] == 1
    for key, t in sd["exp_avg_sq"].items():
        assert torch.equal(opt2.state_dict("b")["exp_avg_sq"][key], t)
    bad = {**sd, "exp_avg": {k: t[..., :1] for k, t in sd["exp_avg"].items()}}
    with pytest.raises(AdapterError, match="has shape"):
        opt2.load_state_dict("b", bad)


def test_step_refuses_a_slot_reused_without_new_optimiser_state(tiny_model_dir) -> None:
    model = multi_model(tiny_model_dir)
    opt = PerAdapterAdamW(model)
    opt.add_adapter("a", SETTINGS["a"])
    slot = model.slot_of("a")
    model.remove_adapter("a")
    assert model.add_adapter("new", model.config_of("b"), seed=1) == slot
    for p in opt.params:
        p.grad = torch.ones_like(p)
    with pytest.raises(AdapterError, match=f"slot {slot} holds adapter 'new' in the model but 'a'"):
        opt.step([slot])
    opt.add_adapter("new", SETTINGS["b"])
    assert opt.step([slot]) == [slot] and opt.step_count("new") == 1


def test_fused_training_equals_peft_and_torch_adamw_per_adapter(tiny_model_dir) -> None:
    """End to end: k fused steps over a mixed batch == each adapter trained alone in peft."""
    model = multi_model(tiny_model_dir)
    opt = PerAdapterAdamW(model)
    refs = {}
    for name, s in SETTINGS.items():
        opt.add_adapter(name, s)
        peft = peft_model(tiny_model_dir, CONFIGS[name], model.adapter_state_dict(name))
        params = [p for p in peft.parameters() if p.requires_grad]
        refs[name] = (
            peft,
            torch.optim.AdamW(
                params, lr=s.lr, betas=s.betas, eps=s.eps, weight_decay=s.weight_decay
            ),
        )
    names = list(SETTINGS)
    slots = torch.tensor([model.slot_of(n) for n in names for _ in range(2)])
    for step in range(3):
        ids, mask = batch(2 * len(names), 8, seed=step)
        logits = model(ids, mask, slot_ids=slots).logits
        losses = [logits[2 * i : 2 * i + 2].square().mean() for i in range(len(names))]
        sum(losses).backward()
        opt.step()
        opt.zero_grad()
        for i, name in enumerate(names):
            peft, ref_opt = refs[name]
            rows = slice(2 * i, 2 * i + 2)
            peft(input_ids=ids[rows], attention_mask=mask[rows]).logits.square().mean().backward()
            ref_opt.step()
            ref_opt.zero_grad()
    for name in names:
        got = model.adapter_state_dict(name)
        ref = {k.replace(".default", ""): p for k, p in refs[name][0].named_parameters()}
        for key, t in got.items():
            assert rel_err(t, ref[key].detach()) < 1e-5, (name, key)
