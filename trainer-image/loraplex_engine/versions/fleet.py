"""Serve published versions from a vLLM fleet, with no loraplex code inside vLLM: a
sidecar beside each vLLM server that keeps every alias of the watched experiments loaded
through vLLM's runtime LoRA API (``POST /v1/load_lora_adapter``, vLLM started with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``).

Names, as on the engine: ``<ns>.<name>:<alias>`` (reloaded in place, ``load_inplace``,
when its alias moves) and ``<ns>.<name>@v<N>`` (each version an alias points at, loaded
once: a version never changes). An alias is reloaded from the new version's own
directory: vLLM keys nothing of it to the old path, so the old weights are never served
under the name once the reload has answered. Until then the name serves the version it
pointed at before; the lag is one poll plus one load (docs/versions.md gives the
measured numbers). Each version's content hash is checked before it is loaded: a
directory that does not match its manifest is skipped and reported.

    python -m loraplex_engine.versions.fleet --checkpoint-root /ckpt \\
        --vllm-url http://localhost:8000 --experiment team-a/support-bot
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from loraplex_engine.spec.errors import CheckpointError
from loraplex_engine.store.versions import VersionStore
from loraplex_engine.versions import names

log = logging.getLogger("loraplex_engine.versions.fleet")

POLL_S = 1.0  # how often the aliases are read


@dataclass(frozen=True)
class Watch:
    namespace: str
    name: str


def wanted(store: VersionStore, watches: Sequence[Watch]) -> dict[str, Path]:
    """Adapter name -> version directory, for every alias of the watched experiments and
    the versions they point at. A version whose files do not match its manifest's hash
    is left out (and logged): nothing half-written or tampered with is served."""
    out: dict[str, Path] = {}
    for w in watches:
        for alias, version in sorted(store.read_aliases(w.namespace, w.name).items()):
            try:
                store.read(w.namespace, w.name, version, verify=True)
            except (CheckpointError, OSError) as e:
                log.warning("%s.%s:%s -> v%d not served: %s", w.namespace, w.name, alias,
                            version, e)  # fmt: skip
                continue
            path = store.path(w.namespace, w.name, version)
            out[f"{w.namespace}.{w.name}:{alias}"] = path
            out[names.served_name(w.namespace, w.name, version)] = path
    return out


@dataclass
class FleetSync:
    """Keeps one vLLM server's adapters equal to :func:`wanted`."""

    store: VersionStore
    vllm_url: str
    watches: Sequence[Watch]
    api_key: str | None = None
    loaded: dict[str, Path] = field(default_factory=dict)  # what this sync loaded

    def sync_once(self, client: httpx.Client) -> list[str]:
        """Load what moved, unload what no alias names any more; the names loaded."""
        want = wanted(self.store, self.watches)
        done = []
        for name, path in want.items():
            if self.loaded.get(name) == path:
                continue
            body = {"lora_name": name, "lora_path": str(path), "load_inplace": True}
            r = client.post(f"{self.vllm_url}/v1/load_lora_adapter", json=body)
            if r.status_code != 200:
                log.warning("vLLM refused %s from %s: %s %s", name, path, r.status_code, r.text)
                continue
            log.info("%s -> %s", name, path)
            self.loaded[name] = path
            done.append(name)
        for name in sorted(set(self.loaded) - set(want)):
            r = client.post(f"{self.vllm_url}/v1/unload_lora_adapter", json={"lora_name": name})
            if r.status_code in (200, 404):
                del self.loaded[name]
        return done

    def run(self, stop: threading.Event, poll_s: float = POLL_S) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        with httpx.Client(timeout=120, headers=headers) as client:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    self.sync_once(client)
                except httpx.HTTPError as e:  # vLLM restarting: it reloads on the next poll
                    log.warning("vLLM at %s: %s", self.vllm_url, e)
                    self.loaded.clear()
                stop.wait(max(0.0, poll_s - (time.monotonic() - started)))


def _watch(text: str) -> Watch:
    namespace, _, name = text.partition("/")
    if not namespace or not name:
        raise argparse.ArgumentTypeError(f"{text!r}: expected <namespace>/<name>")
    return Watch(namespace, name)


def parser() -> argparse.ArgumentParser:
    """The sync's command line (the chart's fleet sidecar passes these; a test parses
    the rendered args with it)."""
    p = argparse.ArgumentParser(prog="python -m loraplex_engine.versions.fleet")
    p.add_argument("--checkpoint-root", type=Path, required=True)
    p.add_argument("--vllm-url", required=True, help="e.g. http://localhost:8000")
    p.add_argument("--experiment", type=_watch, action="append", required=True,
                   help="<namespace>/<name>, repeatable")  # fmt: skip
    p.add_argument("--poll-seconds", type=float, default=POLL_S)
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    sync = FleetSync(VersionStore(args.checkpoint_root), args.vllm_url.rstrip("/"),
                     args.experiment, os.environ.get("VLLM_API_KEY"))  # fmt: skip
    sync.run(threading.Event(), args.poll_seconds)


if __name__ == "__main__":
    main()
