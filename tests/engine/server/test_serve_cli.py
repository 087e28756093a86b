"""`loraplex-engine serve` flags and their LORAPLEX_<FLAG> environment variables.

The engine pod is configured mostly through the environment (the images set
LORAPLEX_PORT, LORAPLEX_ROLLOUT_BACKEND, ...), so a bad value there must be reported
like a bad flag, naming the variable, and must not break the other subcommands.
"""

from __future__ import annotations

import pytest
from loraplex_engine.cli import build_parser, main


def test_a_bad_integer_in_the_environment_is_a_usage_error_naming_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LORAPLEX_MAX_RANK", "abc")
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--model", "/nowhere", "--insecure-no-auth"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: loraplex-engine serve" in err
    assert "argument --max-rank: invalid int value: 'abc' (from LORAPLEX_MAX_RANK)" in err


def test_a_bad_log_level_in_the_environment_is_a_usage_error_naming_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LORAPLEX_LOG_LEVEL", "loud")
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--model", "/nowhere", "--insecure-no-auth"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --log-level: invalid log level: 'loud' (from LORAPLEX_LOG_LEVEL)" in err
    monkeypatch.setenv("LORAPLEX_LOG_LEVEL", "WARNING")  # any case, as logging takes it
    assert build_parser().parse_args(["serve"]).log_level == "warning"


def test_a_bad_variable_does_not_break_other_subcommands_or_a_given_flag(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LORAPLEX_PORT", "eighty")
    args = build_parser().parse_args(["tiny-model", "--out", "x"])
    assert args.command == "tiny-model"
    # The flag on the command line wins, so the variable is never read.
    args = build_parser().parse_args(["serve", "--port", "8001"])
    assert args.port == 8001


def test_integer_variables_are_parsed_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_MAX_RANK", "16")
    monkeypatch.setenv("LORAPLEX_MAX_ADAPTERS", "3")
    args = build_parser().parse_args(["serve", "--max-adapters", "5"])
    assert (args.max_rank, args.max_adapters) == (16, 5)
    assert type(args.max_rank) is int  # not the remembered-variable str subclass
    args = build_parser().parse_args(["serve"])
    assert (args.port, args.threads) == (8000, 0)  # unset: the plain defaults


def test_precision_flags_from_the_environment_and_flags_win(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    args = build_parser().parse_args(["serve"])
    assert (args.dtype, args.gradient_checkpointing) == (None, None)  # the engine decides
    monkeypatch.setenv("LORAPLEX_DTYPE", "bfloat16")
    monkeypatch.setenv("LORAPLEX_GRADIENT_CHECKPOINTING", "false")
    args = build_parser().parse_args(["serve"])
    assert (args.dtype, args.gradient_checkpointing) == ("bfloat16", False)
    assert type(args.dtype) is str
    args = build_parser().parse_args(["serve", "--dtype", "float32", "--gradient-checkpointing"])
    assert (args.dtype, args.gradient_checkpointing) == ("float32", True)
    for var, value, message in (
        ("LORAPLEX_DTYPE", "fp8", "argument --dtype: invalid dtype: 'fp8' (from LORAPLEX_DTYPE)"),
        ("LORAPLEX_GRADIENT_CHECKPOINTING", "maybe", "invalid boolean: 'maybe'"),
    ):
        monkeypatch.setenv(var, value)
        with pytest.raises(SystemExit) as exit_info:
            main(["serve", "--model", "/nowhere", "--insecure-no-auth"])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
        monkeypatch.delenv(var)


def test_lora_kernel_flag_from_the_environment_and_flags_win(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from loraplex_engine.lora.grouped import KERNEL_MODES
    from loraplex_engine.spec.api_types import LORA_KERNELS

    assert tuple(KERNEL_MODES) == LORA_KERNELS  # every flag value has a layer mode
    assert build_parser().parse_args(["serve"]).lora_kernel == "auto"
    monkeypatch.setenv("LORAPLEX_LORA_KERNEL", "bmm")
    assert build_parser().parse_args(["serve"]).lora_kernel == "bmm"
    args = build_parser().parse_args(["serve", "--lora-kernel", "grouped"])
    assert args.lora_kernel == "grouped"
    monkeypatch.setenv("LORAPLEX_LORA_KERNEL", "cutlass")
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--model", "/nowhere", "--insecure-no-auth"])
    message = "argument --lora-kernel: invalid LoRA kernel: 'cutlass' (from LORAPLEX_LORA_KERNEL)"
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_batch_budgets_from_the_environment_and_flags_win(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    args = build_parser().parse_args(["serve"])
    assert (args.micro_batch_tokens, args.rollout_kv_tokens) == (None, None)  # engine's
    monkeypatch.setenv("LORAPLEX_ROLLOUT_KV_TOKENS", "4096")
    monkeypatch.setenv("LORAPLEX_MICRO_BATCH_TOKENS", "2048")
    args = build_parser().parse_args(["serve", "--rollout-kv-tokens", "512"])
    assert (args.micro_batch_tokens, args.rollout_kv_tokens) == (2048, 512)
    monkeypatch.setenv("LORAPLEX_ROLLOUT_KV_TOKENS", "-5")
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--model", "/nowhere", "--insecure-no-auth"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--rollout-kv-tokens: invalid token count: '-5' (from LORAPLEX_ROLLOUT_KV_TOKENS)" in err


def test_help_lists_every_variable(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    epilog = out.split("environment (a flag given on the command line wins):")[1]
    for var in (
        "LORAPLEX_MODEL",
        "LORAPLEX_PORT",
        "LORAPLEX_TOKEN_FILE",
        "LORAPLEX_CHECKPOINT_ROOT",
        "LORAPLEX_MAX_ADAPTERS",
        "LORAPLEX_MAX_RANK",
        "LORAPLEX_ROLLOUT_BACKEND",
        "LORAPLEX_DTYPE",
        "LORAPLEX_GRADIENT_CHECKPOINTING",
        "LORAPLEX_LORA_KERNEL",
        "LORAPLEX_VLLM_OPTIONS",
        "LORAPLEX_TOKEN ",  # the token itself, not only its file
    ):
        assert var in epilog, var
    # Derived from the flags: each long flag appears with its variable on one row.
    assert any(
        row.split() == ["LORAPLEX_MAX_STEP_TOKENS", "--max-step-tokens"]
        for row in epilog.splitlines()
    )


def test_data_roots_and_reward_hosts_from_flags_or_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tiny_model_dir
) -> None:
    from loraplex_engine.server.flags import data_roots, reward_hosts

    monkeypatch.setenv("LORAPLEX_DATA_ROOT", "/data:/more")
    monkeypatch.setenv("LORAPLEX_ALLOW_REWARD_HOST", "127.0.0.1, rewards.test")
    args = build_parser().parse_args(["serve"])
    assert [str(p) for p in data_roots(args)] == ["/data", "/more"]
    assert reward_hosts(args) == ["127.0.0.1", "rewards.test"]
    args = build_parser().parse_args(["serve", "--data-root", "/x", "--allow-reward-host", "h"])
    assert ([str(p) for p in data_roots(args)], reward_hosts(args)) == (["/x"], ["h"])
    monkeypatch.delenv("LORAPLEX_DATA_ROOT")
    assert data_roots(build_parser().parse_args(["serve"])) == ()  # jsonl refused
    model = str(tiny_model_dir)
    code = main(["serve", "--model", model, "--insecure-no-auth", "--data-root", "rel"])
    assert code == 2  # before the port is bound or the model loaded
    assert "--data-root must be an absolute path, not 'rel'" in capsys.readouterr().err


def test_memory_flags_from_the_environment_auto_and_bad_values(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    args = build_parser().parse_args(["serve"])
    assert (args.micro_batch_tokens, args.device_memory, args.memory_headroom) == (
        None, None, 0.15
    )  # fmt: skip
    monkeypatch.setenv("LORAPLEX_DEVICE_MEMORY", "80GiB")
    monkeypatch.setenv("LORAPLEX_MICRO_BATCH_TOKENS", "auto")
    args = build_parser().parse_args(["serve", "--memory-headroom", "0.2"])
    assert (args.micro_batch_tokens, args.device_memory, args.memory_headroom) == (
        None, 80 * 2**30, 0.2
    )  # fmt: skip
    assert (
        build_parser().parse_args(["serve", "--micro-batch-tokens", "8192"]).micro_batch_tokens
        == 8192
    )
    monkeypatch.setenv("LORAPLEX_MICRO_BATCH_TOKENS", "0")
    with pytest.raises(SystemExit):
        main(["serve", "--model", "/nowhere", "--insecure-no-auth"])
    err = capsys.readouterr().err
    assert (
        "argument --micro-batch-tokens: invalid token count: '0' (from LORAPLEX_MICRO_BATCH_TOKENS)"
        in err
    )


def test_allow_dataset_hard_links_from_the_flag_or_the_environment_into_the_trust_policy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from loraplex_engine.server.flags import serve_settings
    from loraplex_engine.server.serve import trust_policy

    def policy(*argv: str):
        return trust_policy(serve_settings(build_parser().parse_args(["serve", *argv])), 8000)

    default = policy("--data-root", "/data")
    assert default.data.allow_hard_links is False  # a hard link may name another's file
    assert [str(r) for r in default.data.roots] == ["/data"]
    assert policy("--data-root", "/data", "--allow-dataset-hard-links").data.allow_hard_links
    monkeypatch.setenv("LORAPLEX_ALLOW_DATASET_HARD_LINKS", "true")
    assert policy().data.allow_hard_links


def test_plugin_grants_from_flags_or_the_environment_and_a_bad_one_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tiny_model_dir
) -> None:
    from loraplex_engine.server.flags import plugin_access

    assert plugin_access(build_parser().parse_args(["serve"])).grants is None  # all allowed
    monkeypatch.setenv("LORAPLEX_ALLOW_PLUGINS", "team-b=reward:acme; *=environment:verifiers:g")
    access = plugin_access(build_parser().parse_args(["serve"]))
    assert access.allows("team-b", "reward", "acme")
    assert not access.allows("team-a", "reward", "acme")
    assert access.allows("team-a", "environment", "verifiers:g")
    assert not access.allows("team-b", "environment", "acme")  # a kind is part of the name
    nothing = plugin_access(build_parser().parse_args(["serve", "--allow-plugins=*="]))
    assert nothing.grants is not None and not nothing.allows("team-a", "reward", "acme")
    monkeypatch.delenv("LORAPLEX_ALLOW_PLUGINS")
    model = str(tiny_model_dir)
    for bad, why in [
        ("team-a", "use NAMESPACES=KIND:NAME"),
        ("Team_A=reward:x", "namespace 'Team_A' is not a namespace name"),
        ("team-a=tool:x", "'tool:x' is not KIND:NAME"),
    ]:
        code = main(["serve", "--model", model, "--insecure-no-auth", f"--allow-plugins={bad}"])
        assert code == 2 and why in capsys.readouterr().err, bad
