"""The cookbook's gsm8k benchmark (``eval.benchmarks.run_benchmark``, which tinker-cookbook
0.6.1 gives no command line) on an engine's base model, as its own process so the offline
Hugging Face settings apply from the start:
``python cookbook_benchmark.py BASE_URL MODEL SAVE_DIR [EXAMPLES [MAX_TOKENS]]`` (2 and 16
unless given); prints the result as JSON."""

from __future__ import annotations

import asyncio
import json
import sys
import time


async def main(
    base_url: str, model: str, save_dir: str, examples: str = "2", tokens: str = "16"
) -> None:
    import tinker
    from tinker_cookbook import renderers
    from tinker_cookbook.eval.benchmarks import run_benchmark
    from tinker_cookbook.eval.benchmarks._types import BenchmarkConfig
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    client = await tinker.ServiceClient(base_url=base_url).create_sampling_client(base_model=model)
    renderer = renderers.get_renderer("qwen3_instruct", get_tokenizer(model))
    config = BenchmarkConfig(max_examples=int(examples), max_tokens=int(tokens), save_dir=save_dir)
    t0 = time.monotonic()
    result = await run_benchmark("gsm8k", client, renderer, config)
    fields = ("score", "num_examples", "num_correct", "num_errors", "num_truncated")
    print(json.dumps({k: getattr(result, k) for k in fields} | {"s": time.monotonic() - t0}))


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:6]))
