"""Static checks of the engine images (no Docker engine here to build them).

They pin what the operator and Kubernetes rely on: the entry point the engine pod runs
(`loraplex-engine serve`, operator/loraplex_operator/manifests.py), port 8000, a non-root
user, a HEALTHCHECK on /healthz, and installs through requirements/engine.txt plus the
package itself; and that every path the Dockerfiles COPY exists in the repository.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
IMAGES = {"Dockerfile": "vllm", "Dockerfile.cpu": "torch"}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_engine_image(name: str) -> None:
    ins = instructions(REPO / "trainer-image" / name)
    by = {}
    for word, rest in ins:
        by.setdefault(word, []).append(rest)

    assert by["FROM"], name
    runs = " && ".join(by["RUN"])
    assert "pip install -r requirements/engine.txt" in runs
    assert "pip install ./trainer-image" in runs
    assert "loraplex-engine serve --help" in runs  # the entry point is installed and imports
    if IMAGES[name] == "vllm":
        assert "vllm==" in runs

    for rest in by["COPY"]:
        src = rest.split()[0]
        assert (REPO / src).exists(), f"{name}: COPY {src} does not exist"

    user = by["USER"][-1]
    assert user.split(":")[0] not in ("root", "0"), user
    assert [w for w, _ in ins].index("USER") > max(i for i, (w, _) in enumerate(ins) if w == "RUN")

    env = " ".join(by["ENV"])
    assert "LORAPLEX_PORT=8000" in env and f"LORAPLEX_ROLLOUT_BACKEND={IMAGES[name]}" in env
    assert by["EXPOSE"] == ["8000"]
    health = by["HEALTHCHECK"][0]
    assert "/healthz" in health and "CMD" in health
    assert json.loads(by["ENTRYPOINT"][0]) == ["loraplex-engine"]
    assert json.loads(by["CMD"][0]) == ["serve"]


def test_operator_runs_what_the_image_serves() -> None:
    """The arguments the operator gives an engine pod parse as `serve` flags."""
    from loraplex_engine.cli import build_parser
    from loraplex_operator.manifests import ENGINE_PORT, TOKEN_FILE, engine_args

    pool_spec = {
        "baseModel": "/models/qwen",
        "rolloutBackend": "vllm",
        "capacity": {"maxAdapters": 6, "maxRank": 32},
        "checkpoint": {"root": "/ckpt"},
        "template": {"image": "x", "extraArgs": ["--max-completion-tokens", "256"]},
    }
    args = build_parser().parse_args(engine_args(pool_spec))
    assert args.command == "serve" and args.port == ENGINE_PORT == 8000
    assert (args.model, args.token_file, args.checkpoint_root) == (
        "/models/qwen",
        TOKEN_FILE,
        "/ckpt",
    )
    assert (args.max_adapters, args.max_rank, args.rollout_backend) == (6, 32, "vllm")
    assert args.max_completion_tokens == 256
