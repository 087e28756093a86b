"""GRPO's KL reference inside the engine is the base model with every adapter off."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from loraplex_engine.train import step as training
from loraplex_engine.train.algorithms import token_logprobs
from loraplex_engine.train.rows import TrainRow

from tests.support.engine_builders import engine, spec

Captured = tuple[list[TrainRow], torch.Tensor, list[torch.Tensor]]


def _spy_on_micro_batches(monkeypatch: pytest.MonkeyPatch) -> list[Captured]:
    """Record each micro-batch's rows, completion mask and every log-prob tensor the loss
    computes: the policy's first, then (when some row has klCoef > 0) the reference."""
    captured: list[Captured] = []
    original = training._micro_batch_loss

    def spy(logprobs_of: Callable[..., torch.Tensor], rows, batch, *rest: Any) -> torch.Tensor:
        outputs: list[torch.Tensor] = []

        def recording(b: dict[str, torch.Tensor]) -> torch.Tensor:
            out = logprobs_of(b)
            outputs.append(out.detach().clone())
            return out

        loss = original(recording, rows, batch, *rest)
        captured.append((list(rows), batch["mask"].clone(), outputs))
        return loss

    monkeypatch.setattr(training, "_micro_batch_loss", spy)
    return captured


def _base_logprobs(base: torch.nn.Module, row: TrainRow) -> torch.Tensor:
    """The completion's log-probs under a plain transformers model, one row unpadded."""
    ids = torch.tensor([row.prompt_ids + row.completion_ids])
    with torch.no_grad():
        logits = base(input_ids=ids).logits[0, len(row.prompt_ids) - 1 : -1].float()
    return token_logprobs(logits / row.temperature, torch.tensor(row.completion_ids))


# Both training forwards: prompts once per group (shared KV prefix), or every row whole.
@pytest.mark.parametrize("share_prefix", [True, False], ids=["shared-prefix", "whole-rows"])
def test_kl_reference_is_the_base_model_with_adapters_off(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, share_prefix: bool
) -> None:
    from transformers import AutoModelForCausalLM

    eng = engine(tiny_model_dir, tmp_path, share_prompt_prefix=share_prefix)
    # Two tenants in the batch, only one with a KL term: the reference must switch off
    # every row's adapter, whichever experiment it belongs to.
    eng.put_experiment("default.kl", spec(kl=0.1, seed=0), "default", "kl")
    eng.put_experiment("default.nokl", spec(kl=0.0, seed=1), "default", "nokl")
    for _ in range(4):  # let the adapters move off their zero-delta start
        eng.tick()
    captured = _spy_on_micro_batches(monkeypatch)
    eng.tick()
    assert captured, "no micro-batch trained"

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    moved = 0.0
    for rows, mask, outputs in captured:
        assert len(outputs) == 2, "the loss computed no KL reference"
        policy, ref = outputs
        for i, row in enumerate(rows):
            on = mask[i] > 0
            expected = _base_logprobs(base, row)
            # Float noise only: padding and the shared-prefix path change reduction order.
            torch.testing.assert_close(ref[i][on].cpu(), expected, rtol=0, atol=1e-4)
            moved = max(moved, (policy[i][on].cpu() - expected).abs().max().item())
    assert {r.experiment for rows, _, _ in captured for r in rows} == {"default.kl", "default.nokl"}
    # The comparison means something only if the policy is not the base any more.
    assert moved > 1e-2, moved
