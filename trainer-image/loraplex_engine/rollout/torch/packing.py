"""Split a rollout's rows into micro-batches that fit a KV-cache token budget (pure).

The torch rollout decodes one micro-batch at a time, so its KV cache never holds more
than one micro-batch: its size is set by the budget, not by how many tenants share the
engine. A micro-batch's cost is what its cache really holds once its rows are decoded:
every row padded to the longest prompt plus the largest ``max_new_tokens`` in it
(``rows x (max prompt + max new)``; the prompts are left-padded to one width), which is
never less than the sum over rows of ``prompt_len + max_new_tokens``.

What stays together, so that an experiment's samples do not depend on who else is
batched (each sampling group draws one seed per micro-batch, rollout/torch/backend.py):

- an experiment (the ``group`` field) that fits the budget is never split: it joins the
  current micro-batch if it fits there, else starts the next one;
- an experiment larger than the budget starts a micro-batch of its own and is split
  between its prompt groups (rows with one slot and prompt: a GRPO group, which shares
  one prefill), so how it is split depends on it and the budget alone;
- a prompt group larger than the budget is split by rows, as many per micro-batch as
  fit; a single row larger than the budget goes alone (the budget cannot go below one
  row: the cache then holds that one row).

The order is deterministic: experiments in order of their first request, then their
prompt groups in order of first request, then rows in request order.
"""

from __future__ import annotations

from collections.abc import Sequence

from loraplex_engine.rollout.base import RolloutRequest
from loraplex_engine.spec.api_types import DEFAULT_ROLLOUT_KV_TOKENS

__all__ = ["DEFAULT_ROLLOUT_KV_TOKENS", "kv_tokens", "pack_rollout", "prompt_groups"]


def kv_tokens(requests: Sequence[RolloutRequest], rows: Sequence[int]) -> int:
    """KV-cache tokens of ``rows`` decoded together: each padded to the longest prompt
    plus the largest token limit among them."""
    if not rows:
        return 0
    prompt = max(len(requests[i].prompt_ids) for i in rows)
    new = max(requests[i].max_new_tokens for i in rows)
    return len(rows) * (prompt + new)


def prompt_groups(requests: Sequence[RolloutRequest]) -> list[list[list[int]]]:
    """Row indices per experiment, per prompt group (same slot and prompt): experiments
    and their groups in order of first request, rows in request order."""
    experiments: dict[str, dict[tuple[int, tuple[int, ...]], list[int]]] = {}
    for row, req in enumerate(requests):
        units = experiments.setdefault(req.group, {})
        units.setdefault((req.slot, tuple(req.prompt_ids)), []).append(row)
    return [list(units.values()) for units in experiments.values()]


def pack_rollout(requests: Sequence[RolloutRequest], kv_token_budget: int) -> list[list[int]]:
    """Row indices of each micro-batch, in decoding order (see the module doc); every
    row is in exactly one."""
    if kv_token_budget < 1:
        raise ValueError(f"rollout_kv_tokens must be at least 1, got {kv_token_budget}")
    batches: list[list[int]] = []
    current: list[int] = []

    def fits(rows: list[int]) -> bool:
        return kv_tokens(requests, rows) <= kv_token_budget

    def flush() -> None:
        nonlocal current
        if current:
            batches.append(current)
        current = []

    for units in prompt_groups(requests):
        rows = [row for unit in units for row in unit]
        if fits(current + rows):
            current += rows
            continue
        flush()
        if fits(rows):
            current = rows
            continue
        for unit in units:  # an experiment over the budget: split between its groups
            if fits(current + unit):
                current += unit
                continue
            flush()
            if fits(unit):
                current = unit
                continue
            width = kv_tokens(requests, unit) // len(unit)  # one row: its prompt + limit
            per = max(1, kv_token_budget // width)
            for start in range(0, len(unit), per):  # one group over the budget: by rows
                current = unit[start : start + per]
                if start + per < len(unit):
                    flush()
    flush()
    return batches
