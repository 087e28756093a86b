"""``loraplex-engine`` command line: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import sys


def _cmd_tiny_model(args: argparse.Namespace) -> int:
    from loraplex_engine.tiny_model import build_model

    out = build_model(args.out, preset=args.preset, arch=args.arch, seed=args.seed)
    n_files = sum(1 for _ in out.iterdir())
    print(f"wrote {args.preset} {args.arch} model to {out} ({n_files} files)")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from loraplex_engine.serve import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loraplex-engine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    tiny = sub.add_parser("tiny-model", help="build a small random-weight model directory")
    tiny.add_argument("--out", required=True, help="output model directory")
    tiny.add_argument("--preset", default="tiny", help="tiny (tests, demo) or bench (~20M)")
    tiny.add_argument("--arch", default="llama", choices=["llama", "qwen2"])
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_cmd_tiny_model)

    from loraplex_engine.serve import add_arguments as add_serve_arguments

    serve = sub.add_parser("serve", help="run the engine's HTTP server (one per pod)")
    add_serve_arguments(serve)
    serve.set_defaults(func=_cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
