"""The small stand-ins of the datasets tinker-cookbook's recipes load by name, written
into a hub cache's datasets folder (``cache_stand_ins``), and the conversations file of
the supervised recipe: shared by the recipes' e2e tests and ``make cookbook-smollm2``."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.cookbook import HubCache, cache_dataset

CONVERSATIONS = [
    {"messages": [{"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": w}]}
    for w in ["yes", "no", "copy", "the", "answer", "sum", "plus", "token"] * 2
]

# hh-rlhf's shape: the chosen and rejected transcripts share the human turn.
PAIRS = [
    {"chosen": f"\n\nHuman: say {w}\n\nAssistant: {w}",
     "rejected": f"\n\nHuman: say {w}\n\nAssistant: no way"}
    for w in ["yes", "copy", "the", "answer", "sum", "plus", "token", "four"] * 2
]  # fmt: skip


def cache_stand_ins(cache: HubCache) -> None:
    """no_robots, gsm8k, hh-rlhf and DeepMath-103K, each a few rows of its own shape."""
    no_robots = [{**row, "prompt": "", "prompt_id": str(i), "category": "Chat"} for i, row in (
        enumerate(CONVERSATIONS)
    )]  # fmt: skip
    splits = {"train": no_robots, "test": no_robots}
    cache_dataset(cache, "HuggingFaceH4/no_robots", "default", splits)
    sums = [{"question": f"What is {a} + {a}?", "answer": f"#### {2 * a}"} for a in range(8)]
    cache_dataset(cache, "openai/gsm8k", "main", {"train": sums, "test": sums[:2]})
    cache_dataset(cache, "Anthropic/hh-rlhf", "default", {"train": PAIRS, "test": PAIRS[:4]})
    prompts = [{"question": row["question"]} for row in sums]
    cache_dataset(cache, "zwhe99/DeepMath-103K", "default", {"train": prompts})


def write_conversations(path: Path) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in CONVERSATIONS))
    return path
