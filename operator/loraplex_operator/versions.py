"""Published versions and aliases of continual experiments, on the operator's side
(docs/versions.md): the status fields and the `Published` condition from the engine's
report, an Event and a metric for every alias move, and `spec.publish` edits (a
`kubectl patch` of the aliases: promotion, rollback) pushed to the engine in place.

Pure but for `push_publish`. The engine owns the versions and moves the aliases (its
gate, `latest`); the operator reports what it says and forwards the spec.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from loraplex_operator.api.status import (
    ALIASES_MAX,
    GATE_NOTE_MAX,
    SCORES_MAX,
    TOKEN_PATTERN,
    VersionStatus,
)

log = logging.getLogger("loraplex_operator.versions")

STABLE, LATEST = "stable", "latest"
COND_PUBLISHED = "Published"
# loraplex_alias_moves{kind}: a bounded label (alias names are the tenant's to choose).
MOVE_KINDS = ("publish", "promotion", "rollback", "alias")
_VERSION = re.compile(r"v([1-9][0-9]{0,8})")
_TOKEN = re.compile(TOKEN_PATTERN)
_ALIAS = re.compile(r"[a-z]([-a-z0-9]{0,30}[a-z0-9])?")  # spec/publish.py's alias names
_SCORE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9]{0,62}")
_INT64_MAX = 2**63 - 1
_RFC3339 = re.compile(
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,9})?(Z|[+-][0-9]{2}:[0-9]{2})"
)


def _normal(publish: Any) -> Any:
    """A publish block without its empty entries: the engine reports every field (lists
    empty, no null); the API server's copy leaves out what was never set."""
    if not isinstance(publish, Mapping):
        return publish
    return {k: _normal(v) for k, v in sorted(publish.items()) if v not in (None, [], {})}


def publish_differs(raw_spec: Mapping[str, Any], engine_status: Mapping[str, Any]) -> bool:
    """The engine applies another `spec.publish` than the object's: an edit to push. An
    engine that does not report one (older) is never pushed to."""
    if "publish" not in engine_status:
        return False
    return _normal(raw_spec.get("publish")) != _normal(engine_status.get("publish"))


def status_fields(engine: Mapping[str, Any]) -> dict[str, Any]:
    """`status.versions`, `status.aliases` and `status.publishRequestToken` from the
    engine's report (when it made one). The engine is trusted less than the API server:
    an entry that does not read as a version is left out, a field that does not read as
    its kind is dropped, and notes are cut to what the schema allows."""
    out: dict[str, Any] = {}
    if isinstance(engine.get("versions"), list):
        found = (_version(v) for v in engine["versions"] if isinstance(v, Mapping))
        out["versions"] = tuple(v for v in found if v is not None)[-10:]
    if isinstance(engine.get("aliases"), Mapping):
        out["aliases"] = _aliases(engine["aliases"])
    if token := _token(engine.get("publishRequestToken")):
        out["publish_request_token"] = token  # none yet (or not a token): the old one stays
    return out


def _version(v: Mapping[str, Any]) -> VersionStatus | None:
    if not _VERSION.fullmatch(str(v.get("version"))):
        return None
    note = v.get("gateNote")
    return VersionStatus(
        version=v["version"],
        step=_count(v.get("step")),
        scores=_scores(v.get("scores")),
        eval_step=_count(v.get("evalStep")),
        gate_passed=v["gatePassed"] if isinstance(v.get("gatePassed"), bool) else None,
        gate_note=note[:GATE_NOTE_MAX] if isinstance(note, str) and note else None,
        request_token=_token(v.get("requestToken")),
        created_at=_datetime(v.get("createdAt")),
    )


def _aliases(x: Mapping[Any, Any]) -> dict[str, str]:
    """Alias -> version where both read as such (the spec's alias pattern, v<N>), at most
    the schema's count: ``latest`` and ``stable`` first, then by name."""
    good = {
        a: v
        for a, v in x.items()
        if isinstance(a, str)
        and _ALIAS.fullmatch(a)
        and isinstance(v, str)
        and _VERSION.fullmatch(v)
    }
    first = [a for a in (LATEST, STABLE) if a in good]
    names = first + sorted(a for a in good if a not in first)
    return {a: good[a] for a in sorted(names[:ALIASES_MAX])}


def _count(x: Any) -> int | None:
    ok = isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= _INT64_MAX
    return x if ok else None


def _scores(x: Any) -> dict[str, float] | None:
    if not isinstance(x, Mapping):
        return None
    good = {
        k: float(v)
        for k, v in sorted(x.items())
        if isinstance(k, str)
        and _SCORE_NAME.fullmatch(k)
        and isinstance(v, (int, float))
        and not isinstance(v, bool)
        and math.isfinite(v)
    }
    return dict(list(good.items())[:SCORES_MAX]) or None


def _token(x: Any) -> str | None:
    return x if isinstance(x, str) and _TOKEN.fullmatch(x) else None


def _datetime(x: Any) -> str | None:
    """An RFC 3339 time as the engine writes it (the schema's date-time), else none."""
    if not isinstance(x, str) or not _RFC3339.fullmatch(x):
        return None
    try:
        datetime.fromisoformat(x.replace("Z", "+00:00"))  # a real date and time
    except ValueError:
        return None
    return x


def published_condition(
    raw_spec: Mapping[str, Any],
    aliases: Mapping[str, str] | None,
    error: str | None,
    recent: Iterable[VersionStatus] = (),
) -> dict[str, Any] | None:
    """`Published`: True while versions publish and the aliases apply (the message says
    where stable and latest point, so every move shows here too, and names the newest
    version when it failed its gate, with why); False with why the last publish or alias
    edit did not apply. None without a publish block."""
    if raw_spec.get("publish") is None:
        return None
    if error:
        return _condition(False, "PublishFailed", error)
    if not aliases:
        return _condition(False, "NoVersionYet", "no version is published yet")
    where = ", ".join(f"{a} {v}" for a, v in sorted(aliases.items()))
    newest = list(recent)[-1:]
    if newest and newest[0].gate_passed is False:
        where += f"; {gate_failure(newest[0])}"
    return _condition(True, "Published", where)


def gate_failure(v: VersionStatus) -> str:
    """What a version that failed its gate says (the Event's and the condition's text)."""
    return f"{v.version} failed its gate: {v.gate_note or 'spec.publish.promoteWhen'}"


def new_gate_failures(
    before: Any, after: Iterable[VersionStatus], evented: int = 0
) -> list[VersionStatus]:
    """The versions in `after` that failed their gate and are news: not listed as failed
    in the status written last (`before`, its raw `versions`), and numbered above
    `evented`, the newest one already told of (a cache that has not seen the last write
    yet would show it again)."""
    told = {
        str(v.get("version"))
        for v in (before if isinstance(before, list) else [])
        if isinstance(v, Mapping) and v.get("gatePassed") is False
    }
    return [
        v
        for v in after
        if v.gate_passed is False and v.version not in told and number(v.version) > evented
    ]


def _condition(status: bool, reason: str, message: str) -> dict[str, Any]:
    return {
        "type": COND_PUBLISHED,
        "status": "True" if status else "False",
        "reason": reason,
        "message": message[:32768],
    }


@dataclass(frozen=True)
class Move:
    alias: str
    before: str | None
    after: str | None

    @property
    def kind(self) -> str:
        """One of MOVE_KINDS: latest moves on a publish; stable set or moved forward is a
        promotion, back a rollback; any other alias set, moved or removed (stable removed
        too) is `alias`."""
        if self.alias == LATEST:
            return "publish"
        if self.alias != STABLE or self.after is None:
            return "alias"
        if self.before is None or number(self.after) > number(self.before):
            return "promotion"
        return "rollback"

    def event(self) -> tuple[str, str, str]:
        """(type, reason, message) of its Event."""
        reason = {"publish": "Published", "promotion": "Promoted", "rollback": "RolledBack"}
        text = f"alias {self.alias}: {self.before or '-'} -> {self.after or '-'}"
        return "Normal", reason.get(self.kind, "AliasMoved"), text


def moves(before: Mapping[str, str] | None, after: Mapping[str, str] | None) -> list[Move]:
    """Each alias whose target changed between two statuses, by name."""
    b, a = dict(before or {}), dict(after or {})
    return [Move(n, b.get(n), a.get(n)) for n in sorted(set(b) | set(a)) if b.get(n) != a.get(n)]


def stable_number(aliases: Mapping[str, str] | None) -> int | None:
    """The version `stable` points at, as a number (the metric's value)."""
    v = (aliases or {}).get(STABLE)
    return number(v) if v and _VERSION.fullmatch(v) else None


def number(version: str) -> int:
    m = _VERSION.fullmatch(version)
    return int(m.group(1)) if m else 0


# ---- pushing spec.publish edits --------------------------------------------------------


class _Engines(Protocol):
    async def put_publish(
        self, base: str, token: str, exp_id: str, publish: Mapping[str, Any] | None
    ) -> dict[str, Any]: ...


class _Work(Protocol):
    republish: str | None
    engine_status: dict[str, Any] | None

    @property
    def id(self) -> str: ...

    @property
    def key(self) -> str: ...

    @property
    def exp(self) -> Any: ...

    def event(self, type_: str, reason: str, message: str) -> None: ...


async def push_publish(engines: _Engines, works: Iterable[_Work], token: str) -> None:
    """`spec.publish` to the engine of each experiment whose engine applies another one
    (planning marked it `republish`); its fresh status replaces the round's report, so
    the aliases it moved show (and are evented) this round. A failure is retried next
    round: the spec still differs."""
    for w in works:
        if not w.republish:
            continue
        publish = w.exp.raw_spec.get("publish")
        try:
            w.engine_status = await engines.put_publish(w.republish, token, w.id, publish)
        except Exception as e:  # the engine's answer or its absence: next round tries again
            log.warning("%s: spec.publish not applied on its engine: %s", w.key, e)
            w.event("Warning", "PublishNotApplied", f"spec.publish not applied: {e}")
