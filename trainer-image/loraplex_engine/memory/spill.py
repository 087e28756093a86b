"""The third tier of adapter paging (memory/paging.py): past ``--host-adapter-memory``, the
coldest paged-out adapters go from host memory to files on the checkpoint volume, and
come back from there when a tick needs them. One safetensors file per adapter, its
tensors exactly as paged (so a spilled adapter is still bit for bit itself) and its
config, optimiser settings and step as JSON metadata; written atomically (a temporary
file renamed), removed once read back or forgotten. Names are hashed into file names: an
adapter's name carries a tenant's ids. Which directory is whose, and the sweep of a dead
process's: memory/spill_owner.py."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from safetensors.torch import load_file, save_file

from loraplex_engine.lora.config import LoRAConfig
from loraplex_engine.memory import pages as records
from loraplex_engine.train.optim import AdamWSettings


@dataclass(frozen=True)
class SpilledPage:
    """A paged-out adapter whose page is a file, not host memory."""

    name: str
    path: Path
    nbytes: int  # what its page takes in host memory once read back
    disk_bytes: int = 0  # what its file takes on the volume


def write(page: records.AdapterPage, directory: Path) -> SpilledPage:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{hashlib.sha256(page.name.encode()).hexdigest()}.safetensors"
    tensors = {f"w/{k}": v for k, v in page.weights.items()}
    tensors |= {f"m/{k}": v for k, v in page.exp_avg.items()}
    tensors |= {f"v/{k}": v for k, v in page.exp_avg_sq.items()}
    grads = page.grads
    if grads is not None:
        tensors |= {f"g/{i}": t for i, t in enumerate(grads.blocks) if t is not None}
    meta = {
        "name": page.name,
        "config": asdict(page.config),
        "settings": asdict(page.settings),
        "step": page.step,
        "grads": None if grads is None else {"n": len(grads.blocks), "full": grads.full},
    }
    tmp = path.with_suffix(".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, {"page": json.dumps(meta)})
    os.replace(tmp, path)
    return SpilledPage(page.name, path, page.nbytes(), path.stat().st_size)


def read(spilled: SpilledPage) -> records.AdapterPage:
    from safetensors import safe_open

    with safe_open(spilled.path, "pt") as f:
        meta = json.loads(f.metadata()["page"])
    tensors = load_file(spilled.path)

    def part(prefix: str) -> dict:
        return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}

    grads = None
    if meta["grads"] is not None:
        blocks = part("g/")
        grads = records.CompactGrads(
            [blocks.get(str(i)) for i in range(meta["grads"]["n"])], meta["grads"]["full"]
        )
    return records.AdapterPage(
        name=meta["name"],
        config=LoRAConfig(**meta["config"]),
        weights=part("w/"),
        settings=AdamWSettings(**meta["settings"]),
        step=int(meta["step"]),
        exp_avg=part("m/"),
        exp_avg_sq=part("v/"),
        grads=grads,
    )


def remove(spilled: SpilledPage) -> None:
    spilled.path.unlink(missing_ok=True)
