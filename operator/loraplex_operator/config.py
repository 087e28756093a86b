"""The operator's settings, from `LORAPLEX_*` environment variables (the chart sets them)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from loraplex_operator.aibrix import AibrixConfig

DEFAULT_MAX_RESTARTS = 3
ENGINE_LOG_FORMAT = "LORAPLEX_ENGINE_LOG_FORMAT"
ENGINE_LOG_FORMATS = ("text", "json")  # the engine's `serve --log-format` choices


@dataclass(frozen=True)
class Config:
    interval: float = 5.0  # seconds between rounds of a pool whose engines run work
    # Seconds between rounds of a pool with nothing to poll: its rounds follow watch
    # events (experiments, engine Pods), this is only the safety net.
    resync: float = 60.0
    status_interval: float = 10.0  # min seconds between progress-only status writes
    scale_down_delay: float = 60.0  # an engine idle this long (above min) is removed
    max_restarts: int = DEFAULT_MAX_RESTARTS
    engine_timeout: float = 30.0
    # An engine pod started but not Ready, or without a node, this long is failing
    # (engine_failures: ReadinessProbeFailing, Unschedulable): the pool is Stalled.
    stall_after: float = 600.0
    # Namespaces whose experiments this operator may read (namespaced RBAC); () = all.
    namespaces: tuple[str, ...] = ()
    # The engine token Secret this operator creates when a pool names it and it is absent
    # ("namespace/name", the chart's engine token; "" = create none: an existingSecret),
    # and the length of the token it generates.
    managed_token: str = ""
    token_length: int = 48
    # The engines' `serve --log-format` where a pool's template names none.
    engine_log_format: str = "text"
    # AIBrix ModelAdapters for published aliases (aibrix.py); None = off (the default).
    aibrix: AibrixConfig | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Config:
        def num(name: str, default: float) -> float:
            return float(env.get(f"LORAPLEX_{name}", default))

        return cls(
            interval=num("RECONCILE_INTERVAL", cls.interval),
            resync=num("RESYNC_INTERVAL", cls.resync),
            status_interval=num("STATUS_INTERVAL", cls.status_interval),
            scale_down_delay=num("SCALE_DOWN_DELAY", cls.scale_down_delay),
            max_restarts=int(num("MAX_RESTARTS", cls.max_restarts)),
            engine_timeout=num("ENGINE_TIMEOUT", cls.engine_timeout),
            stall_after=num("STALL_AFTER", cls.stall_after),
            managed_token=env.get("LORAPLEX_MANAGED_TOKEN_SECRET", "").strip(),
            token_length=int(num("TOKEN_LENGTH", cls.token_length)),
            engine_log_format=_log_format(env.get(ENGINE_LOG_FORMAT, cls.engine_log_format)),
            aibrix=AibrixConfig.from_env(env),
            namespaces=tuple(
                n.strip()
                for n in env.get("LORAPLEX_WATCH_NAMESPACES", "").replace(" ", ",").split(",")
                if n.strip()
            ),
        )


def _log_format(value: str) -> str:
    """A bad value stops the operator at start naming it, rather than every engine pod
    it creates failing on `--log-format`."""
    fmt = value.strip().lower() or Config.engine_log_format
    if fmt not in ENGINE_LOG_FORMATS:
        raise ValueError(f"{ENGINE_LOG_FORMAT} must be one of text, json; not {value!r}")
    return fmt
