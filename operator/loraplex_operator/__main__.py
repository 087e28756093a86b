"""`python -m loraplex_operator`: run the operator (kopf) locally with sane defaults.

The chart runs `kopf run --standalone -m loraplex_operator.handlers` instead (see
charts/loraplex/templates/deployment.yaml); both run the handlers of that module.

One replica only (kopf has no leader election; deploy with strategy Recreate). By
default the operator runs standalone (no kopf peering objects); `--peering NAME` uses
kopf peering instead, so a second instance started by mistake pauses rather than
fighting. Metrics and `/healthz` on `--metrics-port` (8080); kopf's own liveness probe
listens on loopback `--liveness-port` and is forwarded by `/healthz`.

Tuning through the environment: LORAPLEX_RECONCILE_INTERVAL (5 s, a pool whose engines
are polled), LORAPLEX_RESYNC_INTERVAL (60 s, a pool with nothing to poll),
LORAPLEX_STATUS_INTERVAL (10 s), LORAPLEX_SCALE_DOWN_DELAY (60 s),
LORAPLEX_MAX_RESTARTS (3), LORAPLEX_ENGINE_TIMEOUT (30 s), LORAPLEX_STALL_AFTER (600 s),
LORAPLEX_LOG_FORMAT (text; json: one JSON object per line, loraplex_operator/logs.py),
LORAPLEX_ENGINE_LOG_FORMAT (text; the engines' `serve --log-format` where a pool's
template names none).
"""

from __future__ import annotations

import argparse
import os
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loraplex_operator", description=__doc__)
    p.add_argument("--metrics-port", type=int, default=int(os.environ.get("METRICS_PORT", 8080)))
    p.add_argument("--liveness-port", type=int, default=None, help="default: metrics port + 1")
    p.add_argument("--peering", default=None, help="kopf peering name (default: standalone)")
    p.add_argument(
        "--namespace",
        action="append",
        default=[],
        help="watch LoRAExperiments only here (repeatable; default: all namespaces)",
    )
    p.add_argument(
        "--log-format",
        choices=("text", "json"),
        default=os.environ.get("LORAPLEX_LOG_FORMAT", "text"),
        help="json: one JSON object per line (time, level, logger, message, object, "
        "exception); default LORAPLEX_LOG_FORMAT or text",
    )
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--debug", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import kopf

    import loraplex_operator.handlers  # noqa: F401  (registers the handlers)
    from loraplex_operator import logs

    liveness_port = args.liveness_port or (args.metrics_port + 1 if args.metrics_port else 0)
    liveness = f"http://127.0.0.1:{liveness_port}/healthz" if liveness_port else None
    os.environ["LORAPLEX_METRICS_PORT"] = str(args.metrics_port)
    os.environ["LORAPLEX_LOG_FORMAT"] = args.log_format
    if liveness:
        os.environ["LORAPLEX_KOPF_LIVENESS"] = liveness
    kopf.configure(verbose=args.verbose, debug=args.debug)
    logs.configure(args.log_format)
    kopf.run(
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        standalone=args.peering is None,
        peering_name=args.peering,
        liveness_endpoint=liveness,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
