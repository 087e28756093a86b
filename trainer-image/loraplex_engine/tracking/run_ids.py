"""Run ids: readable, ``<UTC time>-<4 hex>`` (``20261206-184233-7331``). A run id names an
experiment run's checkpoint directory and its run in every tracker (TensorBoard's
``DIR/<namespace>/<name>/<run id>/``, MLflow's ``loraplex.runId`` tag), so one made by the
engine, for `serve` and `run` alike, reads as when the run started, not as 32 hex digits.
The operator gives its own (the object's uid)."""

from __future__ import annotations

import secrets
import time


def new_run_id() -> str:
    """A fresh run id: the UTC second it was made, then 4 random hex digits (two runs of
    one experiment started in the same second differ but for 1 in 65536)."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(2)
