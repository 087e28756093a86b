"""A live engine's plug-in worker processes (environments and plug-in rewards run in
them), found among its children by their command line."""

from __future__ import annotations

import psutil

from tests.support.server_process import EngineServer


def workers(srv: EngineServer) -> list[psutil.Process]:
    """The engine's plug-in worker processes."""
    assert srv.proc is not None
    kids = psutil.Process(srv.proc.pid).children(recursive=True)
    return [p for p in kids if "loraplex_engine.environments.worker" in " ".join(_cmdline(p))]


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:  # it ended while we looked
        return []
