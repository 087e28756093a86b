"""Publishes adapter versions in a loop, to be killed (SIGKILL) at any point.

Used by test_versions_store.py: ``python version_writer.py ROOT COUNT [--pause-in-write]``
publishes COUNT versions of ``ns/exp`` under ROOT through the real VersionStore, each a
PEFT directory of random weights (a few MB, so a kill often lands inside a write), and
prints ``published vN`` after each. ``--pause-in-write`` prints ``writing vN`` half-way
through the first version's files and then sleeps: the test kills it there.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
from loraplex_engine.store.versions import Manifest, VersionStore
from safetensors.numpy import save_file

NS, NAME = "ns", "exp"


def main() -> None:
    root, count = Path(sys.argv[1]), int(sys.argv[2])
    pause = "--pause-in-write" in sys.argv
    store = VersionStore(root)
    rng = np.random.default_rng()
    for _ in range(count):

        def write(tmp: Path) -> None:
            config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
            (tmp / "adapter_config.json").write_text(json.dumps(config))
            if pause:
                print(f"writing {tmp.name}", flush=True)
                time.sleep(3600)
            weights = {f"layer{i}.lora_A.weight": rng.standard_normal((8, 4096), np.float32)
                       for i in range(32)}  # fmt: skip
            save_file(weights, tmp / "adapter_model.safetensors")

        def manifest(n: int, parent: int | None, digest: str) -> Manifest:
            return Manifest(version=n, experiment=f"{NS}.{NAME}", run_id="run1", parent=parent,
                            base_model="tiny", base_model_hash="sha256:0", step=10 * n,
                            scores={"meanReward": 0.5}, content_hash=digest,
                            created_at="2026-01-01T00:00:00Z")  # fmt: skip

        made = store.publish(NS, NAME, write, manifest, keep=1000)
        print(f"published v{made.version}", flush=True)


if __name__ == "__main__":
    main()
