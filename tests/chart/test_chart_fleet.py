"""The chart's vLLM serving fleet (`fleet.enabled`, templates/fleet.yaml) runs what
docs/versions.md's "Serving from a vLLM fleet" says: vLLM with runtime LoRA updating and
the docs' flags, the pools' checkpoint volume read-only at the checkpoint root, the fleet
sync beside it with the docs' flags, and a Service. The sync's rendered arguments are
parsed by the sync's own parser; vLLM's by vLLM's own (skipped without the vLLM
environment)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
from loraplex_engine.versions.fleet import Watch, parser

from tests.support.chart_helpers import REPO, SCENARIOS, component, render, render_error

VLLM_PYTHON = Path(os.environ.get("LORAPLEX_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
VERSIONS_DOC = REPO / "docs" / "versions.md"
FLEET = SCENARIOS["fleet"]["fleet"]


def _doc_commands() -> list[list[str]]:
    """The shell commands of the docs' fleet section (continuation lines joined, comments
    dropped), as argument lists."""
    section = VERSIONS_DOC.read_text().split("## Serving from a vLLM fleet", 1)[1]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block, "docs/versions.md: the fleet section lost its sh block"
    text = block.group(1).replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in text.splitlines() if line.strip()]


def _doc_command(module: str) -> tuple[dict[str, str], list[str]]:
    """(env assignments, flags) of the docs' command that runs `python -m <module>`."""
    for argv in _doc_commands():
        env = dict(a.split("=", 1) for a in argv if re.fullmatch(r"[A-Z_]+=.*", a))
        rest = argv[len(env) :]
        if rest[:3] == ["python", "-m", module]:
            return env, [a for a in rest[3:] if a.startswith("--")]
    raise AssertionError(f"docs/versions.md runs no `python -m {module}`")


def _fleet(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    docs = render(values)
    (deploy,) = component(docs, "Deployment", "fleet")
    (service,) = component(docs, "Service", "fleet")
    return deploy, service


def _container(deploy: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in deploy["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def _flag_names(args: list[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in args if a.startswith("--")}


def test_off_by_default() -> None:
    docs = render({})
    assert component(docs, "Deployment", "fleet") == []
    assert component(docs, "Service", "fleet") == []


def test_vllm_runs_as_the_docs_say() -> None:
    deploy, _ = _fleet(SCENARIOS["fleet"])
    vllm = _container(deploy, "vllm")
    env, flags = _doc_command("vllm.entrypoints.openai.api_server")
    assert vllm["command"][-2:] == ["-m", "vllm.entrypoints.openai.api_server"]
    rendered_env = {e["name"]: e.get("value") for e in vllm["env"]}
    for name, value in env.items():  # VLLM_ALLOW_RUNTIME_LORA_UPDATING=True
        assert rendered_env.get(name) == value, name
    assert set(flags) <= _flag_names(vllm["args"]), set(flags) - _flag_names(vllm["args"])
    assert f"--max-lora-rank={FLEET['maxLoraRank']}" in vllm["args"]
    assert f"--max-loras={FLEET['maxLoras']}" in vllm["args"]
    assert f"--model={FLEET['model']}" in vllm["args"]
    assert f"--port={FLEET['port']}" in vllm["args"]
    assert vllm["ports"] == [{"name": "http", "containerPort": FLEET["port"]}]


def test_the_checkpoint_volume_is_read_only_at_the_root_in_both_containers() -> None:
    deploy, _ = _fleet(SCENARIOS["fleet"])
    pod = deploy["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "loraplex-checkpoints"]
    assert {k: v for k, v in volume.items() if k != "name"} == FLEET["checkpoint"]["volume"]
    for name in ("vllm", "fleet-sync"):
        mounts = _container(deploy, name)["volumeMounts"]
        mounts = [m for m in mounts if m["name"] == volume["name"]]
        assert mounts == [
            {"name": volume["name"], "mountPath": FLEET["checkpoint"]["root"], "readOnly": True}
        ], name


def test_the_sync_runs_as_the_docs_say_and_its_parser_takes_the_args() -> None:
    deploy, _ = _fleet(SCENARIOS["fleet"])
    sync = _container(deploy, "fleet-sync")
    _, flags = _doc_command("loraplex_engine.versions.fleet")
    assert sync["command"] == ["python", "-m", "loraplex_engine.versions.fleet"]
    assert set(flags) <= _flag_names(sync["args"])
    args = parser().parse_args(sync["args"])
    assert str(args.checkpoint_root) == FLEET["checkpoint"]["root"]
    assert args.vllm_url == f"http://localhost:{FLEET['port']}"  # the vLLM beside it
    assert args.experiment == [Watch(*e.split("/")) for e in FLEET["experiments"]]
    assert args.poll_seconds == FLEET["pollSeconds"]
    assert sync["image"] == _container(deploy, "vllm")["image"]  # the engine image: one pull
    assert sync["image"].startswith("ghcr.io/loraplex/engine:")


def test_the_service_reaches_vllm() -> None:
    deploy, service = _fleet(SCENARIOS["fleet"])
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert deploy["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    assert service["spec"]["ports"] == [
        {"name": "http", "port": FLEET["port"], "targetPort": "http"}
    ]
    # The engines' selector never picks the fleet (the operator would count it as an engine).
    assert labels["app.kubernetes.io/component"] == "fleet"


def test_an_api_key_reaches_vllm_and_the_sync() -> None:
    values = {"fleet": {**FLEET, "apiKeySecret": {"name": "fleet-key", "key": "k"}}}
    deploy, _ = _fleet(values)
    for name in ("vllm", "fleet-sync"):
        env = {e["name"]: e for e in _container(deploy, name)["env"]}
        ref = env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "fleet-key", "key": "k"}, name


def test_another_vllm_image_and_args() -> None:
    vllm = {
        "image": "vllm/vllm-openai:v0.11.0",
        "command": ["python3", "-m", "vllm.entrypoints.openai.api_server"],
        "extraArgs": ["--dtype=bfloat16"],
    }
    deploy, _ = _fleet({"fleet": {**FLEET, "vllm": vllm}})
    c = _container(deploy, "vllm")
    assert (c["image"], c["command"]) == (vllm["image"], vllm["command"])
    assert c["args"][-1] == "--dtype=bfloat16" and "--enable-lora" in c["args"]
    assert _container(deploy, "fleet-sync")["image"].startswith("ghcr.io/loraplex/engine:")


@pytest.mark.parametrize(
    ("fleet", "message"),
    [
        ({"enabled": True, "checkpoint": {"volume": {"emptyDir": {}}}}, "fleet.experiments"),
        ({"enabled": True, "experiments": ["team-a/x"]}, "fleet.checkpoint.volume"),
        ({**FLEET, "experiments": ["team-a"]}, "fleet.experiments"),
        ({**FLEET, "maxLoraRank": 24}, "fleet.maxLoraRank"),
    ],
)
def test_values_that_cannot_serve_are_refused(fleet: dict[str, Any], message: str) -> None:
    assert message in render_error({"fleet": fleet})


@pytest.mark.slow
def test_vllm_parses_the_rendered_args() -> None:
    """vLLM's own argument parser (the one its OpenAI server runs) takes the rendered args."""
    if not VLLM_PYTHON.exists():
        pytest.skip(f"no vLLM environment at {VLLM_PYTHON} (make vllm-venv)")
    deploy, _ = _fleet(SCENARIOS["fleet"])
    code = (
        "import json, sys\n"
        "from vllm.entrypoints.launchers.cli_args import make_arg_parser,"
        " validate_parsed_serve_args\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "a = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])\n"
        "validate_parsed_serve_args(a)\n"
        "print(json.dumps({k: getattr(a, k) for k in"
        " ('model', 'port', 'enable_lora', 'max_lora_rank', 'max_loras')}))\n"
    )
    argv = [str(VLLM_PYTHON), "-c", code, *_container(deploy, "vllm")["args"]]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    parsed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert parsed == {
        "model": FLEET["model"],
        "port": FLEET["port"],
        "enable_lora": True,
        "max_lora_rank": FLEET["maxLoraRank"],
        "max_loras": FLEET["maxLoras"],
    }
