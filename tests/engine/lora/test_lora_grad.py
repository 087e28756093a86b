"""One fused backward over a mixed batch gives each slot the gradient it would get alone."""

import torch
import torch.nn.functional as F

from tests.support.lora_helpers import CONFIGS, batch, multi_model, peft_model, rel_err

ROWS = ["b", "a", None, "c", "a", "b", "c", "c"]


def _token_loss(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the real (unpadded) tokens."""
    losses = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    valid = mask[:, 1:].flatten().float()
    return (losses * valid).sum() / valid.sum()


def _peft_grads(model) -> dict[str, torch.Tensor]:
    """peft's grads under the saved key names (drop the ``.default`` adapter name)."""
    return {
        k.replace(".default", ""): p.grad for k, p in model.named_parameters() if p.requires_grad
    }


def test_fused_backward_equals_each_adapter_trained_alone(tiny_model_dir) -> None:
    model = multi_model(tiny_model_dir)
    ids, mask = batch(len(ROWS), 10, seed=3)
    slots = torch.tensor([model.slot_of(n) if n else 0 for n in ROWS])
    logits = model(ids, mask, slot_ids=slots).logits
    loss = sum(
        _token_loss(logits[rows], ids[rows], mask[rows])
        for name in CONFIGS
        for rows in [[i for i, n in enumerate(ROWS) if n == name]]
    )
    loss.backward()

    for name, cfg in CONFIGS.items():
        rows = [i for i, n in enumerate(ROWS) if n == name]
        ref_model = peft_model(tiny_model_dir, cfg, model.adapter_state_dict(name))
        out = ref_model(input_ids=ids[rows], attention_mask=mask[rows]).logits
        _token_loss(out, ids[rows], mask[rows]).backward()
        ref = _peft_grads(ref_model)
        got = model.adapter_views(name, lambda p: p.grad)
        assert got.keys() == ref.keys()
        for key in got:
            assert ref[key].norm() > 0, key
            assert rel_err(got[key], ref[key]) < 1e-5, (name, key)


def test_gradient_stays_inside_each_slots_block(tiny_model_dir) -> None:
    """Slot 0, free slots, rank padding and untargeted layers get exactly zero gradient."""
    model = multi_model(tiny_model_dir, max_adapters=5)
    ids, mask = batch(len(ROWS), 6)
    slots = torch.tensor([model.slot_of(n) if n else 0 for n in ROWS])
    model(ids, mask, slot_ids=slots).logits.square().mean().backward()
    for path, layer in model.lora_layers.items():
        grad_a, grad_b = layer.lora_A.grad.clone(), layer.lora_B.grad.clone()
        for name, cfg in CONFIGS.items():
            s, r = model.slot_of(name), cfg.rank
            if path.rsplit(".", 1)[-1] in cfg.target_modules:
                assert grad_a[s, :r].abs().sum() > 0 and grad_b[s, :, :r].abs().sum() > 0
                grad_a[s, :r] = 0
                grad_b[s, :, :r] = 0
        assert grad_a.abs().sum() == 0 and grad_b.abs().sum() == 0, path


def test_gradient_checkpointing_with_backward_inside_route(tiny_model_dir) -> None:
    """Checkpointed layers recompute in backward(), so backward runs inside the route block."""
    grads = []
    for checkpointing in (False, True):
        model = multi_model(tiny_model_dir)
        if checkpointing:
            model.base_model.gradient_checkpointing_enable({"use_reentrant": False})
        model.train()
        ids, mask = batch(len(ROWS), 6)
        slots = torch.tensor([model.slot_of(n) if n else 0 for n in ROWS])
        with model.route(slots):
            out = model.base_model(input_ids=ids, attention_mask=mask).logits
            out.square().mean().backward()
        grads.append(model.adapter_views("b", lambda p: p.grad))
    for key, ref in grads[0].items():
        assert rel_err(grads[1][key], ref) < 1e-6, key
