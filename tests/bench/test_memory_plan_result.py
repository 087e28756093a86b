"""The committed ``bench/results/memory-plan.json`` (``make memory-plan``) has every field
issues 12 and 17 name, and its verdicts follow from its own numbers."""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

from memory_plan import H100, H200, targets  # noqa: E402

FIELDS = {"model", "dtype", "adapters", "rank", "targets", "rows_per_tenant", "prompt_tokens",
          "completion_tokens", "checkpointing", "peak_bytes", "train_flops", "floor_flops",
          "world_size"}  # fmt: skip
PEAKS = {"total", "base", "adapters", "activations", "logits", "kv_cache"}


def test_every_row_has_the_issues_fields_and_the_targets_follow_from_them() -> None:
    result = json.loads((REPO / "bench/results/memory-plan.json").read_text())
    rows = result["rows"]
    for row in rows:
        assert set(row) >= FIELDS, row["model"]
        assert set(row["peak_bytes"]) >= PEAKS, row["model"]
        parts = sum(row["peak_bytes"][k] for k in ("base", "adapters", "activations", "logits"))
        assert parts + row["peak_bytes"].get("all_gather", 0) <= row["peak_bytes"]["total"]
    cells = {(r["model"], r["adapters"], r["checkpointing"], r["world_size"]) for r in rows}
    for model in ("Qwen3-4B", "Llama-3.1-8B"):
        for n in (8, 32):
            assert {(model, n, False, 1), (model, n, True, 1)} <= cells
    sharded = [r for r in rows if r["model"] == "Llama-3.1-70B"]
    assert {(r["adapters"], r["world_size"], r["detail"]["device_bytes"]) for r in sharded} == {
        (n, 8, device) for n in (8, 32) for device in (H100, H200)
    }
    assert result["targets"] == targets(rows)  # the verdicts are the numbers' own
