"""Defaults of the Tinker door's per-namespace bounds (``serve --tinker-*`` flags): here,
in the contract, so both the flags (settings/commands.py) and the protocol that applies
them (server/tinker/) read one value."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_SESSIONS = 128  # open sessions per namespace
FUTURES_PER_NAMESPACE = 1_000
FUTURE_TTL_S = 900.0  # a finished future nobody retrieved is kept this long
RETRIEVED_GRACE_S = 120.0  # a retrieved one this long, for a poll whose answer was lost:
# the SDK waits 45 s for an answer before it asks again (its retrieve timeout), then backs
# off 1, 2, 4, 8 s; 30 s dropped a future an SDK under load asked for a second time
# Sequences sampled with record_stability_info (what stable_reinforce trains on): the
# tokens a namespace's recordings may hold (its prompts' and sampled tokens; 4 bytes a
# prompt token, 8 a sampled one with its log-prob, so 64 MiB at most), the least recently
# used pushed out first; and how long one unused is kept (Tinker's docs: a day after
# sampling, each training request that uses it restarting that day).
RECORDED_TOKENS_PER_NAMESPACE = 8_000_000
RECORDED_TTL_S = 86_400.0


@dataclass(frozen=True)
class RecordLimits:
    """The bounds of a namespace's recorded samples (server/tinker/recorded.py)."""

    tokens_per_namespace: int = RECORDED_TOKENS_PER_NAMESPACE
    ttl_s: float = RECORDED_TTL_S
