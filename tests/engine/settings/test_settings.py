"""The engine's settings: one typed definition (settings/engine.py, settings/commands.py)
from which the `serve`/`run` flags, the LORAPLEX_* variables, their help and the worker
ranks' argv are all generated, so none of them can drift from the others.

The round trips run with every LORAPLEX_* variable removed (the test's own environment
must not leak into what is parsed) unless a test sets them.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from loraplex_engine.cli import build_parser
from loraplex_engine.settings.commands import COMMANDS, RunSettings, ServeSettings
from loraplex_engine.settings.engine import EngineSettings, ProcessSettings
from loraplex_engine.settings.generate import flags_of, from_namespace, to_argv
from loraplex_engine.spec.errors import UsageError


@pytest.fixture(autouse=True)
def _no_loraplex_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("LORAPLEX_"):
            monkeypatch.delenv(name)


# Every setting at a value other than its default (and other than None where it may be).
CHANGED: dict[str, Any] = {
    "max_adapters": 3,
    "max_rank": 16,
    "checkpoint_root": "/elsewhere",
    "rollout_backend": "vllm",
    "train_mode": "timesliced",
    "schedule": "pipelined",
    "dtype": "float16",
    "gradient_checkpointing": False,
    "lora_kernel": "grouped",
    "micro_batch_tokens": 2048,
    "rollout_kv_tokens": 512,
    "device_memory": 80 * 2**30,
    "checkpoint_quota_bytes": 50 * 2**30,
    "checkpoint_keep_runs": 5,
    "memory_headroom": 0.2,
    "max_step_tokens": 4096,
    "max_prompt_tokens": 256,
    "reward_deadline": 2.5,
    "plugin_timeout": 5.0,
    "serving_share": 0.4,
    "client_models_per_tick": 1,
    "client_tick_gather": 0.05,
    "client_models_per_namespace": 2,
    "max_registered": 100,
    "host_adapter_memory": 8 << 30,
    "vllm_options": {"max_model_len": 4096, "dtype": "bfloat16", "sleep_mode": True},
    "shard_base": True,
    "model": "/models/m with space",
    "device": "cuda:1",
    "world_size": 2,
    "dist_timeout": 30.0,
    "host": "127.0.0.1",
    "port": 0,
    "token_file": "/var/run/token",
    "tinker_keys": "/var/run/tinker-keys",
    "tinker_max_sessions": 16,
    "served_model_name": ("Qwen/Qwen3-8B", "base"),
    "tinker_futures_per_namespace": 50,
    "tinker_future_ttl": 60.0,
    "tinker_retrieved_grace": 5.0,
    "tinker_recorded_tokens": 1000,
    "tinker_recorded_ttl": 30.0,
    "insecure_no_auth": True,
    "threads": 2,
    "max_completion_tokens": 64,
    "no_checkpoint_on_shutdown": True,
    "log_level": "debug",
    "log_format": "json",
    "data_root": ("/data", "/more"),
    "allow_reward_host": ("rewards.test", "::1"),
    "allow_plugins": ("team-a,team-b=reward:acme,environment:verifiers:guess", "*="),
    "allow_dataset_hard_links": True,
    "object_store_prefix": ("s3://datasets/{namespace}/", "gs://more/{namespace}/"),
    "object_store_endpoint": "http://minio.storage:9000",
    "object_store_region": "eu-west-1",
    "tracking_mlflow_uri": "http://mlflow.test:5000",
    "tracking_mlflow_experiment": "team",
    "tracking_wandb": "offline",
    "tracking_wandb_project": "proj",
    "tracking_wandb_entity": "ent",
    "tracking_wandb_dir": "/wandb dir",
    "tracking_tensorboard_dir": "/tb",
    "tracking_queue": 50,
    "manifests": "experiments.yaml",
    "out": "out/x",
    "only": ("say-yes", "copy-abc"),
    "overrides": ("algorithm.maxSteps=4", "say-yes:rollout.temperature=0.7"),
    "resume": "out/y",
}


def changed(cls: type[ProcessSettings]) -> ProcessSettings:
    """``cls`` with every setting it offers as a flag changed from its default."""
    offered = {name for name, _, _ in flags_of(cls)}
    values = {k: v for k, v in CHANGED.items() if k in offered}
    if cls is RunSettings:  # the timesliced baseline is one rank's (ProcessSettings.check)
        values["world_size"] = 1
    return cls(**values)


def parse(argv: list[str]) -> ProcessSettings:
    args = build_parser().parse_args(argv)
    cls = {c.COMMAND: c for c in COMMANDS}[args.command]
    return from_namespace(cls, args)


def test_the_changed_values_cover_every_setting() -> None:
    for cls in COMMANDS:
        for name, info, _ in flags_of(cls):
            value = changed(cls).model_dump()[name]
            if name != "world_size" or cls is ServeSettings:
                assert value != info.get_default(call_default_factory=True), (cls, name)


@pytest.mark.parametrize("cls", COMMANDS, ids=lambda c: c.COMMAND)
def test_settings_to_argv_and_back_are_equal(cls: type[ProcessSettings]) -> None:
    """What a worker rank is started with parses to rank 0's settings exactly."""
    settings = changed(cls)
    argv = to_argv(settings)
    assert argv[0] == cls.COMMAND
    assert parse(argv) == settings
    required = {"manifests": "m.yaml", "model": "/m"} if cls is RunSettings else {}
    defaults = cls(**required)
    assert parse(to_argv(defaults)) == defaults


def test_a_worker_does_not_depend_on_the_variables_it_inherits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every setting is spelled out: variables that say otherwise lose to the argv (the
    vLLM options, which merge over their variable, end equal too)."""
    settings = changed(ServeSettings)
    argv = to_argv(settings)
    for var, value in as_variables(ServeSettings(model="/other", insecure_no_auth=False)).items():
        monkeypatch.setenv(var, value)
    monkeypatch.setenv("LORAPLEX_VLLM_OPTIONS", json.dumps({"max_model_len": 1}))
    assert parse(argv) == settings


def as_variables(settings: ProcessSettings) -> dict[str, str]:
    """The settings as LORAPLEX_* variables, each as its flag's value is written."""
    out = {}
    for name, _, flag in flags_of(type(settings)):
        value = getattr(settings, name)
        if value is None:
            continue
        if flag.action in ("switch", "toggle"):
            text = "true" if value else "false"
        elif flag.action == "append":
            text = {"data_root": ":", "allow_plugins": ";"}.get(name, ",").join(value)
        elif flag.action == "merge":
            text = json.dumps(value)
        else:
            text = str(value)
        out[flag.variable(name)] = text
    return out


def test_every_serve_setting_reads_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = changed(ServeSettings)
    for var, value in as_variables(settings).items():
        monkeypatch.setenv(var, value)
    assert parse(["serve"]) == settings


def test_run_reads_no_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_MAX_RANK", "4")
    assert parse(["run", "m.yaml", "--model", "/m"]).max_rank == 64


@pytest.mark.parametrize("cls", COMMANDS, ids=lambda c: c.COMMAND)
def test_every_setting_has_a_flag_and_a_help_showing_its_default(
    cls: type[ProcessSettings], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args([cls.COMMAND, "--help"])
    text = "".join(capsys.readouterr().out.split())  # argparse wraps lines, even at "-"
    for name, info, flag in flags_of(cls):
        assert flag.help, name
        shown = name if flag.positional else flag.option(name)
        assert shown in text, name
        if not info.is_required():
            assert "".join(f"{flag.help} (default: ".split()) in text, name
    assert set(cls.model_fields) - {n for n, _, _ in flags_of(cls)} == cls.NOT_FLAGS


def test_every_serve_flag_has_its_variable_in_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    epilog = capsys.readouterr().out.split("environment (a flag given on the command line")[1]
    listed = {line.split()[0] for line in epilog.splitlines()[1:] if line.strip()}
    wanted = {flag.variable(name) for name, _, flag in flags_of(ServeSettings)}
    assert listed == wanted | {var for var, _ in ServeSettings.ENV_EXTRA}
    # The names the images, the operator and docs/engine-api.md use.
    assert {"LORAPLEX_MAX_RANK", "LORAPLEX_VLLM_OPTIONS", "LORAPLEX_DATA_ROOT"} <= listed


@pytest.mark.parametrize("command", ["tiny-model", "import-gguf", "plan"])
def test_the_other_subcommands_help_shows_defaults(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    out = capsys.readouterr().out
    assert "(default: " in out or "default:" in out


def test_the_engine_gets_its_own_settings_whole() -> None:
    settings = changed(ServeSettings)
    engine = settings.engine()
    assert type(engine) is EngineSettings
    assert engine.model_dump() == settings.model_dump(include=set(EngineSettings.model_fields))


def test_a_settings_value_the_type_refuses_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LORAPLEX_VLLM_OPTIONS", "[1, 2]")
    with pytest.raises(UsageError, match="LORAPLEX_VLLM_OPTIONS must be a JSON object"):
        parse(["serve"])
    with pytest.raises(ValueError):  # pydantic's, for code that builds settings itself
        EngineSettings(rollout_backend="jax")  # type: ignore[arg-type]
