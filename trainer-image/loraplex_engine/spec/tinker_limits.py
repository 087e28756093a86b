"""Defaults of the Tinker door's per-namespace bounds (``serve --tinker-*`` flags): here,
in the contract, so both the flags (settings/commands.py) and the protocol that applies
them (server/tinker/) read one value."""

from __future__ import annotations

DEFAULT_MAX_SESSIONS = 128  # open sessions per namespace
FUTURES_PER_NAMESPACE = 1_000
FUTURE_TTL_S = 900.0  # a finished future nobody retrieved is kept this long
RETRIEVED_GRACE_S = 120.0  # a retrieved one this long, for a poll whose answer was lost:
# the SDK waits 45 s for an answer before it asks again (its retrieve timeout), then backs
# off 1, 2, 4, 8 s; 30 s dropped a future an SDK under load asked for a second time
