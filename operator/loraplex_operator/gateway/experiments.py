"""Tinker models as experiments (issue 29 item 3): pure decisions, no I/O.

A model a client creates through the gateway is a ``LoRAExperiment`` with ``spec.client``
in the key's namespace (docs/design/gateway.md, "Tinker models as experiments"):

- its name comes from the model id the SDK itself spells, ``<session>:train:<n>`` ->
  ``tinker-<session>-<n>``, so the gateway needs no table to find it, and a name in the
  key's namespace is all a key can reach;
- the SDK's ``create_model`` request becomes its manifest (``manifest``);
- where a call goes is read from the experiment's status (``binding``): phase Running on
  ``status.engine`` = that engine pod; Failed = the model failed; anything else = paused,
  answered with the SDK's paused queue state (``paused_future``, ``paused_error``);
- futures: ``create_model``'s is ``lx~<name>`` (answered from the experiment), a model
  operation's is ``m~<name>~<engine request id>`` (sent to whichever engine holds the
  experiment when it is asked).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from loraplex_operator import idle

API_VERSION = "loraplex.dev/v1alpha1"
KIND = "LoRAExperiment"
PREFIX = "tinker-"
SESSION_LABEL = "loraplex.dev/tinker-session"
MANAGED_BY = {"app.kubernetes.io/managed-by": "loraplex-gateway"}
# Sessions the gateway mints (and the engine's own): "s" + 20 lowercase hex digits, so a
# model's experiment name is a DNS label.
SESSION = re.compile(r"^s[0-9a-f]{20}$")
MODEL_ID = re.compile(r"^(s[0-9a-f]{20}):train:([0-9]{1,10})$")
NAME = re.compile(r"^tinker-(s[0-9a-f]{20})-([0-9]{1,10})$")
CREATE_FUTURE = "lx~"
MODEL_FUTURE = "m~"
UNLOADED_FUTURE = "ux~"
MAX_RANK = 1024  # the CRD's own bound is the pool's max rank; this only keeps ints sane
PAUSED = "paused_capacity"
IDLE_RESUMING = "the model was idle past spec.client.idleSeconds (suspended): resuming"


# A base-model sampler of a gateway session (no engine holds the session, so the
# gateway answers create_sampling_session itself): its id carries the base model, and
# its samples go to any admitting engine that serves that model.
BASE_SAMPLER = re.compile(r"^(s[0-9a-f]{20}):sample:b([0-9a-f]{1,12}):([A-Za-z0-9._-]{1,200})$")


class BadRequest(ValueError):
    """A ``create_model`` body the gateway cannot turn into a spec: 422 naming ``field``."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


def experiment_name(model_id: str | None) -> str | None:
    """``tinker-<session>-<n>`` for a model id the gateway's sessions hand out, else None."""
    m = MODEL_ID.fullmatch(model_id or "")
    return f"{PREFIX}{m.group(1)}-{int(m.group(2))}" if m else None


def model_id_of(name: str) -> str | None:
    m = NAME.fullmatch(name)
    return f"{m.group(1)}:train:{m.group(2)}" if m else None


def manifest(namespace: str, pool: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """The ``LoRAExperiment`` for a ``create_model`` request (BadRequest if it has none)."""
    session, seq = body.get("session_id"), body.get("model_seq_id")
    if not isinstance(session, str) or not SESSION.fullmatch(session):
        raise BadRequest("session_id", "not a session of this gateway")
    if not isinstance(seq, int) or isinstance(seq, bool) or not 0 <= seq < 10**10:
        raise BadRequest("model_seq_id", "an integer in [0, 10^10)")
    lora = body.get("lora_config")
    if not isinstance(lora, Mapping):
        raise BadRequest("lora_config", "required, with its rank")
    rank = lora.get("rank")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= MAX_RANK:
        raise BadRequest("lora_config.rank", f"an integer in [1, {MAX_RANK}]")
    client: dict[str, Any] = {"modelId": f"{session}:train:{seq}"}
    seed = lora.get("seed")
    if seed is not None:
        if not isinstance(seed, int) or isinstance(seed, bool) or abs(seed) >= 2**63:
            raise BadRequest("lora_config.seed", "an int64 or absent")
        client["seed"] = seed
    for wire, field in (
        ("train_attn", "trainAttn"),
        ("train_mlp", "trainMlp"),
        ("train_unembed", "trainUnembed"),
    ):
        value = lora.get(wire, True)
        if not isinstance(value, bool):
            raise BadRequest(f"lora_config.{wire}", "true or false")
        client[field] = value
    name = f"{PREFIX}{session}-{seq}"
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {SESSION_LABEL: session, **MANAGED_BY},
        },
        "spec": {
            "enginePool": pool,
            "lora": {"rank": rank},
            "client": client,
            # No run length: the client decides when it is done (unload_model).
            "algorithm": {"maxSteps": 0},
            # A checkpoint every optimiser step: a crash replays at most the journal
            # since the last step (docs/design/gateway.md).
            "checkpoint": {"everySteps": 1, "keep": 2},
        },
    }


@dataclass(frozen=True)
class Binding:
    """Where an experiment's calls go now."""

    state: Literal["running", "paused", "failed"]
    engine: str | None = None
    reason: str = ""
    wake: bool = False  # suspended by its idle TTL: this call resumes it (idle.py)


def binding(obj: Mapping[str, Any]) -> Binding:
    status = obj.get("status") or {}
    phase, engine = status.get("phase"), status.get("engine")
    if phase == "Running" and isinstance(engine, str) and engine:
        return Binding("running", engine)
    if phase == "Failed":
        return Binding("failed", None, _reason(status) or "the experiment failed")
    why = _reason(status)
    where = f" on {engine}" if engine else ""
    if idle.idle_suspended(obj):
        return Binding("paused", None, IDLE_RESUMING, wake=True)
    if (obj.get("spec") or {}).get("suspend"):
        return Binding("paused", None, "the model is suspended (spec.suspend)")
    text = f"the model is {str(phase or 'Pending').lower()}{where}"
    return Binding("paused", None, f"{text}: {why}" if why else text)


def _reason(status: Mapping[str, Any]) -> str:
    """The message of the condition that explains the phase (Ready's, when False)."""
    for c in status.get("conditions") or ():
        if isinstance(c, Mapping) and c.get("type") == "Ready" and c.get("status") != "True":
            return str(c.get("message") or c.get("reason") or "")
    return ""


def paused_future(request_id: str, reason: str) -> dict[str, Any]:
    """``retrieve_future``'s answer while the model has no engine: the SDK polls on."""
    return {
        "type": "try_again",
        "request_id": request_id,
        "queue_state": PAUSED,
        "queue_state_reason": reason,
    }


def paused_error(reason: str) -> dict[str, Any]:
    """A new operation's answer (503) while the model has no engine: the SDK retries."""
    return {
        "error": {"code": "paused", "message": reason},
        "queue_state": PAUSED,
        "queue_state_reason": reason,
    }


def created_answer(name: str) -> dict[str, Any]:
    return {"model_id": model_id_of(name), "type": "create_model"}


def create_future(name: str) -> str:
    return CREATE_FUTURE + name


def model_future(name: str, request_id: str) -> str:
    return f"{MODEL_FUTURE}{name}~{request_id}"


def unloaded_future(name: str) -> str:
    """``unload_model``'s future when the model had no engine: its experiment is deleted."""
    return UNLOADED_FUTURE + name


def split_future(
    given: str,
) -> tuple[Literal["create", "model", "unloaded"], str, str] | None:
    """``("create", name, "")``, ``("model", name, engine request id)``, ``("unloaded",
    name, "")``, or None for a stage-1 future (``<engine pod>~<id>``)."""
    for prefix, kind in ((CREATE_FUTURE, "create"), (UNLOADED_FUTURE, "unloaded")):
        if given.startswith(prefix):
            name = given[len(prefix) :]
            return (kind, name, "") if NAME.fullmatch(name) else None  # type: ignore[return-value]
    if given.startswith(MODEL_FUTURE):
        name, sep, rid = given[len(MODEL_FUTURE) :].partition("~")
        return ("model", name, rid) if sep and rid and NAME.fullmatch(name) else None
    return None


def base_model_name(given: object) -> str | None:
    """The base model a request names, as engines compare it (the name before any ``:``
    tag); None where it names none (any); BadRequest for what is not a model name."""
    if given is None:
        return None
    if not isinstance(given, str) or not given.split(":")[0]:
        raise BadRequest("base_model", "a base model's name, or absent")
    return given.split(":")[0]


def not_served(namespace: str, base_model: str, served: set[str | None]) -> str:
    """Why no engine takes a request for ``base_model``: naming what the pools serve."""
    names = sorted(n for n in served if n)
    there = ", ".join(repr(n) for n in names) or "nothing"
    return (
        f"base model {base_model!r} is not served to namespace {namespace!r}: the pools "
        f"that admit it serve {there}"
    )


def base_sampler_id(session: str, seq: object, base_model: str) -> str | None:
    """A base-model sampler's id (None where the base model's name cannot be one)."""
    tag = format(seq, "x") if isinstance(seq, int) and not isinstance(seq, bool) else None
    if tag is None or seq < 0:  # type: ignore[operator]
        tag = secrets.token_hex(6)
    # A hub id's '/' is '--' in the id (a path segment); hub names never hold '--'.
    sid = f"{session}:sample:b{tag[-12:]}:{base_model.replace('/', '--')}"
    return sid if BASE_SAMPLER.fullmatch(sid) else None


def split_base_sampler(sampler_id: object) -> tuple[str, str] | None:
    """(session, base model) of a base-model sampler's id, else None."""
    m = BASE_SAMPLER.fullmatch(sampler_id) if isinstance(sampler_id, str) else None
    return (m.group(1), m.group(3).replace("--", "/")) if m else None
