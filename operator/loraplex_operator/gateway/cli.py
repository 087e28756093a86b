"""``python -m loraplex_operator.gateway``: the gateway's command line (the chart's
Deployment runs it; tests/chart checks the rendered args parse here)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys

from loraplex_operator.gateway.app import MAX_BODY_BYTES, STREAM_IDLE_S, create_app
from loraplex_operator.gateway.directory import REFRESH_S, Directory, FileDirectory
from loraplex_operator.logs import quiet_libraries

log = logging.getLogger("loraplex_operator.gateway")
GATEWAY_AGENT = "loraplex-gateway/0.1.0"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loraplex-gateway",
        description="Tenants' way in: the OpenAI and Tinker APIs for every pool.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--host", default="0.0.0.0", help="address to listen on")
    p.add_argument("--port", type=int, default=8080, help="port (0: any free port)")
    p.add_argument(
        "--engines-file",
        help="read engines and keys from this JSON file (development and tests) "
        "instead of the Kubernetes API",
    )
    p.add_argument(
        "--key-namespaces",
        default="",
        help="comma-separated namespaces to read API key Secrets from (empty: every "
        "namespace, which needs a ClusterRole to list Secrets)",
    )
    p.add_argument(
        "--refresh-seconds",
        type=float,
        default=REFRESH_S,
        help="how often engines and keys are read again (rotation and revocation delay)",
    )
    p.add_argument(
        "--stream-idle-seconds",
        type=float,
        default=STREAM_IDLE_S,
        help="a stream whose engine is silent this long ends with an error event",
    )
    p.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def directory(args: argparse.Namespace) -> Directory:
    if args.engines_file:
        return FileDirectory(args.engines_file, refresh_s=min(args.refresh_seconds, 1.0))
    from loraplex_operator.gateway.directory import KubeDirectory
    from loraplex_operator.kube import Kube

    namespaces = tuple(n for n in args.key_namespaces.split(",") if n)
    # Its own user agent: audit logs (and the tests' RBAC check) tell it from the operator.
    kube = Kube.from_environment(user_agent=GATEWAY_AGENT)
    return KubeDirectory(kube, namespaces, args.refresh_seconds)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    quiet_libraries()  # no httpx INFO line per proxied request
    import uvicorn

    app = create_app(
        directory(args),
        stream_idle_s=args.stream_idle_seconds,
        max_body_bytes=args.max_body_bytes,
    )
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(2048)
    host, port = sock.getsockname()[:2]
    print(f"loraplex-gateway listening: url=http://{host}:{port}", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, log_level=args.log_level, access_log=False, lifespan="on")
    asyncio.run(uvicorn.Server(config).serve(sockets=[sock]))
    return 0
