"""Subprocess for crash tests: trains one experiment and prints its step after each tick.

Usage: python -m tests.support.train_worker MODEL_DIR CHECKPOINT_ROOT SPEC_JSON
"""

from __future__ import annotations

import json
import sys

import torch
from loraplex_engine.engine import Engine
from loraplex_engine.settings.engine import EngineSettings
from loraplex_engine.spec.experiment import parse_spec


def main() -> None:
    torch.set_num_threads(1)
    model_dir, root, spec_json = sys.argv[1:4]
    eng = Engine(model_dir, EngineSettings(max_adapters=2, max_rank=16, checkpoint_root=root))
    eng.put_experiment("default.crash", parse_spec(json.loads(spec_json)), "default", "crash")
    while eng.tick() is not None:
        print(eng.get_experiment("default.crash").step, flush=True)


if __name__ == "__main__":
    main()
