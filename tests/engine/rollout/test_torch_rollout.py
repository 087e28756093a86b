"""The torch rollout loop prefills each distinct (adapter, prompt) once and hands every
row of a GRPO group a copy of that prompt's KV cache. The rows must decode exactly as
if each had been prefilled on its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from loraplex_engine.rollout.base import RolloutRequest
from loraplex_engine.rollout.torch.backend import distinct_prompts, generate

from tests.support.engine_builders import engine, spec


def _request(slot: int, prompt: list[int], new: int = 6) -> RolloutRequest:
    return RolloutRequest(slot=slot, prompt_ids=prompt, max_new_tokens=new, temperature=0.0)


def test_distinct_prompts_keys_on_adapter_and_prompt() -> None:
    rows = [_request(1, [5, 6]), _request(1, [5, 6]), _request(2, [5, 6]), _request(1, [7])]
    rows.append(_request(1, [5, 6]))
    firsts, inverse = distinct_prompts(rows)
    assert firsts == [0, 2, 3]
    assert inverse.tolist() == [0, 0, 1, 2, 0]


@pytest.fixture(scope="module")
def trained(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """An engine with two adapters whose B matrices are random (fresh ones are zero, so
    every slot would decode like the base)."""
    eng = engine(tiny_model_dir, tmp_path_factory.mktemp("ckpt"))
    gen = torch.Generator().manual_seed(0)
    for target in ("yes", "no"):
        task = {"name": "target-token", "params": {"target": target}}
        eng.put_experiment(f"t.{target}", spec(task), "t")
        slot = eng.model.slot_of(f"t.{target}")
        with torch.no_grad():
            for layer in eng.model.lora_layers.values():
                b = layer.lora_B[slot]
                b.copy_(torch.randn(b.shape, generator=gen) * 0.5)
    yield eng
    eng.close()


def _forward(eng: Any, calls: list[int]):
    def forward(ids, mask, positions, past):
        calls.append(ids.shape[0])
        out = eng.model.base_model(
            input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=past
        )
        return out.logits[:, -1].float(), out.past_key_values

    return forward


def test_group_rows_decode_as_if_prefilled_alone(trained) -> None:
    eng = trained
    yes, no = eng.model.slot_of("t.yes"), eng.model.slot_of("t.no")
    short, long = eng.codec.encode("say"), eng.codec.encode("the answer say yes:")
    # Groups of 3 and 2 per (slot, prompt), one base row, prompts of different lengths.
    rows = [_request(s, p) for s, p in [(yes, long)] * 3 + [(no, long)] * 2]
    rows += [_request(yes, short), _request(0, long), _request(no, short)]
    calls: list[int] = []
    batched = generate(eng.model.route, _forward(eng, calls), rows, eng.codec.pad_id)
    assert calls[0] == 5  # the prefill ran once per distinct (slot, prompt), not 8 times

    for row, got in zip(rows, batched, strict=True):
        alone = generate(eng.model.route, _forward(eng, []), [row], eng.codec.pad_id)[0]
        assert got.token_ids == alone.token_ids
        torch.testing.assert_close(got.logprobs, alone.logprobs, rtol=1e-4, atol=1e-5)
    # The adapters matter: the same prompt decodes differently under each slot.
    assert len({tuple(batched[i].logprobs) for i in (0, 3, 6)}) == 3
