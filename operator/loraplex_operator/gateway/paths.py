"""Which requests the gateway forwards: an allowlist of exact routes, never a path.

A path is not a route. The engines behind the gateway also serve their admin API (the
pool token the gateway calls with opens it), and URL libraries (httpx included) remove
dot segments before sending, so a tenant's ``/api/v1/sessions/<id>/../../../../v1/
experiments`` would be sent as ``/v1/experiments``. So the gateway reads the request
target as it came (``plain_path``: no percent-escapes, no dot, empty or control
characters), matches it against the exact Tinker routes below (those of the official
SDK that the engine serves), checks every id in it, checks the key's role on the route
matched, and forwards the route rebuilt from those parts, each id quoted. What matches
no route is answered here (404; 400 for a malformed path or id), never forwarded.
OpenAI model ids (a path segment of ``/v1/models/<id>``, a body's ``model``) are checked
by ``model_problem`` before they name anything on an engine. Pure: no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import quote

ID = "{}"  # an id's place in a route
# Session, model, sampler and training run ids (``s<hex>``, ``<session>:train:<n>``,
# ``<session>:sample:<x>``, a base sampler's ``...:b<hex>:<model name>``).
# Matched whole (``fullmatch``: a ``$`` would let a trailing newline through).
ID_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._:~@-]{0,511}")
# An OpenAI model id: an experiment's ``<namespace>.<name>``, a version's ``@v<N>`` or
# ``:<alias>``, or the short name the namespace is added to.
MODEL_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._:@-]{0,252}")
SAFE = ":@~"  # left unquoted: path characters (RFC 3986 pchar) an id may hold


@dataclass(frozen=True)
class Template:
    method: str
    parts: tuple[str, ...]  # literal segments, ``ID`` where an id goes

    @property
    def name(self) -> str:
        return "/".join(self.parts)


def _t(method: str, route: str) -> Template:
    return Template(method, tuple(route.split("/")))


# The Tinker routes (under /api/v1) the gateway answers or forwards: the official SDK's
# (tinker 0.38) that the engine serves (loraplex_engine/server/tinker/routes.py and rest.py),
# and the protocol's ``forward`` and ``unload_model`` (the engine's; that SDK has no
# method for them).
TINKER_ROUTES: tuple[Template, ...] = (
    _t("GET", "healthz"),
    _t("POST", "client/config"),
    _t("POST", "client/dynamic_config"),
    _t("POST", "telemetry"),
    _t("GET", "get_server_capabilities"),
    _t("POST", "create_session"),
    _t("POST", "session_heartbeat"),
    _t("POST", "sessions/{}/finish"),
    _t("POST", "create_model"),
    _t("POST", "get_info"),
    _t("POST", "forward_backward"),
    _t("POST", "forward"),
    _t("POST", "optim_step"),
    _t("POST", "save_weights"),
    _t("POST", "save_weights_for_sampler"),
    _t("POST", "save_weights_external"),
    _t("POST", "load_weights"),
    _t("POST", "unload_model"),
    _t("POST", "create_sampling_session"),
    _t("GET", "samplers/{}"),
    _t("POST", "asample"),
    _t("POST", "create_custom_loss"),
    _t("POST", "retrieve_future"),
    _t("POST", "retrieve_futures"),  # a sampling session's completions (sample role)
    _t("POST", "cancel_future"),  # an abandoned sample (sample role)
    _t("GET", "training_runs"),
    _t("GET", "training_runs/{}"),
    _t("GET", "training_runs/{}/checkpoints"),
    # A checkpoint's id is ``<kind>/<name>``: two segments, each an id.
    _t("DELETE", "training_runs/{}/checkpoints/{}/{}"),
    _t("PUT", "training_runs/{}/checkpoints/{}/{}/ttl"),
    _t("GET", "training_runs/{}/checkpoints/{}/{}/external_weights_urls"),
    _t("GET", "checkpoints"),
    # A signed download URL's file (ns, run, kind, name, file): keyless, the signature is
    # the credential (tinker_downloads.py).
    _t("GET", "external_weights_files/{}/{}/{}/{}/{}"),
)


@dataclass(frozen=True)
class TinkerCall:
    """A request matched to a route: ``name`` its template (what the role check reads,
    e.g. ``sessions/{}/finish``), ``route`` what is forwarded (ids quoted)."""

    method: str
    name: str
    route: str
    ids: tuple[str, ...]


@dataclass(frozen=True)
class Refused:
    """Why a request is answered by the gateway and not forwarded."""

    status: int
    message: str
    field: str | None = None


def _control(text: str) -> bool:
    return any(ord(c) < 0x20 or ord(c) == 0x7F for c in text)


def plain_path(raw: bytes) -> str | Refused:
    """The request target's path (``raw_path``, before any decoding) when it is plain:
    ASCII, no percent-escapes, backslashes or control characters, no empty, ``.`` or
    ``..`` segment. Plain, it reads the same to every party that handles it."""
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        return Refused(400, "the request path is not ASCII")
    if _control(text) or " " in text:
        return Refused(400, "the request path holds a control character or a space")
    if "%" in text:
        return Refused(400, "percent-encoded characters are not accepted in the request path")
    if "\\" in text:
        return Refused(400, "a backslash is not accepted in the request path")
    if text == "/":
        return text
    if not text.startswith("/"):
        return Refused(400, "the request path must start with /")
    for segment in text[1:].split("/"):
        if segment in ("", ".", ".."):
            return Refused(400, f"the request path holds an empty, '.' or '..' segment: {text!r}")
    return text


def match_tinker(method: str, route: str) -> TinkerCall | Refused:
    """``route`` (the path after ``/api/v1/``) as one of ``TINKER_ROUTES``."""
    segments = route.split("/")
    shaped = False
    for t in TINKER_ROUTES:
        if len(t.parts) != len(segments):
            continue
        pairs = list(zip(t.parts, segments, strict=True))
        if any(p != ID and p != s for p, s in pairs):
            continue
        ids = tuple(s for p, s in pairs if p == ID)
        for given in ids:
            if not ID_RE.fullmatch(given):
                why = f"malformed id {given!r} in {t.name.replace(ID, '<id>')}: ids hold "
                return Refused(400, why + "letters, digits and . _ : ~ @ - only", "path")
        shaped = True
        if t.method != method:
            continue
        route = "/".join(quote(s, safe=SAFE) if p == ID else p for p, s in pairs)
        return TinkerCall(method, t.name, route, ids)
    if shaped:
        return Refused(404, f"no Tinker route {method} {route!r} (not that method)")
    return Refused(404, f"no Tinker route {method} {route!r}")


def model_problem(given: object, field: str = "model") -> Refused | None:
    """Why ``given`` is not an OpenAI model id the gateway may name to an engine."""
    if not isinstance(given, str) or not given:
        return Refused(422, f"{field} is required: a model id", field)
    if not MODEL_RE.fullmatch(given):
        shown = given if len(given) <= 80 else given[:80] + "..."
        why = f"{field} {shown!r} is not a model id: letters, digits and . _ : @ - only"
        return Refused(400, why, field)
    return None


def model_path(model_id: str) -> str:
    """The engine's path of one model, for an id ``model_problem`` accepted."""
    return "/v1/models/" + quote(model_id, safe=SAFE)
