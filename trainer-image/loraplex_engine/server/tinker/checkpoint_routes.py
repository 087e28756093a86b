"""The SDK's checkpoint management routes: ``save_weights_external`` (the adapter as a
PEFT directory), delete, set a TTL, and signed download URLs for an external weights
checkpoint (what ``tinker checkpoint download`` and ``RestClient.get_external_weights_urls``
read: one URL per file, fetched with no API key).

Every route acts on the caller's namespace only: another namespace's path is not found.
A download URL is signed (HMAC over namespace, path, file and expiry, with a key this
engine process drew at start) and valid for ``URL_TTL_S``; the SDK signs again when one
is about to expire. After an engine restart old URLs answer 403: sign again.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any
from urllib.parse import quote

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse
from pydantic import BaseModel, ConfigDict, Field

from loraplex_engine.server.tinker.protocol import _name
from loraplex_engine.server.tinker.rest import Ns
from loraplex_engine.spec.errors import InvalidRequestError, NotFoundError, UnauthorizedError
from loraplex_engine.spec.tinker_paths import MAX_TTL_S, StatePath, parse_path
from loraplex_engine.spec.training_service import SavedState, SaveState

if TYPE_CHECKING:
    from loraplex_engine.server.tinker.protocol import Protocol

URL_TTL_S = 3600
FILES = "external_weights_files"  # the download route's first segment
# A checkpoint's lifetime in seconds (None: kept until deleted); a 422 names it past that.
TtlSeconds = Annotated[int | None, Field(ge=1, le=MAX_TTL_S)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class SaveExternal(_Body):
    model_id: str = Field(min_length=1, max_length=300)
    path: str = Field(min_length=1, max_length=128)
    seq_id: int | None = None
    ttl_seconds: TtlSeconds = None
    age_encryption_recipients: list[str] | None = None


class Ttl(_Body):
    ttl_seconds: TtlSeconds = None


def checkpoint_path(run_id: str, kind: str, name: str) -> StatePath:
    """The route's ``<run>/checkpoints/<kind>/<name>`` as a path (422 naming it if bad)."""
    return parse_path(f"tinker://{run_id}/{kind}/{name}", field="checkpoint_id")


class Signer:
    """Signs and checks download URLs with a key drawn per engine process."""

    def __init__(self, key: bytes | None = None) -> None:
        self._key = key or secrets.token_bytes(32)

    def signature(self, ns: str, path: StatePath, file: str, expires: int) -> str:
        text = "\n".join((ns, path.uri, file, str(expires))).encode()
        return hmac.new(self._key, text, hashlib.sha256).hexdigest()

    def check(self, ns: str, path: StatePath, file: str, expires: int, signature: str) -> None:
        good = self.signature(ns, path, file, expires)
        if not hmac.compare_digest(good, signature) or time.time() >= expires:
            raise UnauthorizedError("the download URL is expired or not signed by this engine")


def add_checkpoint_routes(
    r: APIRouter, proto: Protocol, call: Callable[..., Awaitable[Any]]
) -> None:
    signer = Signer()

    @r.post("/save_weights_external")
    async def save_external(ns: Ns, body: SaveExternal) -> dict[str, Any]:
        rid = await call(save_weights_external, proto, ns, body)
        return {"request_id": rid, "model_id": body.model_id}

    @r.delete("/training_runs/{run_id}/checkpoints/{kind}/{name}")
    async def delete(ns: Ns, run_id: str, kind: str, name: str) -> None:
        path = checkpoint_path(run_id, kind, name)
        await call(proto.training().delete_saved, ns, path.uri)

    @r.put("/training_runs/{run_id}/checkpoints/{kind}/{name}/ttl")
    async def set_ttl(ns: Ns, run_id: str, kind: str, name: str, body: Ttl) -> None:
        path = checkpoint_path(run_id, kind, name)
        await call(proto.training().set_saved_ttl, ns, path.uri, body.ttl_seconds)

    @r.get("/training_runs/{run_id}/checkpoints/{kind}/{name}/external_weights_urls")
    async def urls(ns: Ns, run_id: str, kind: str, name: str, request: Request) -> dict[str, Any]:
        path = checkpoint_path(run_id, kind, name)
        files = await call(proto.training().saved_files, ns, path.uri)
        expires = int(time.time()) + URL_TTL_S
        base = str(request.base_url).rstrip("/")  # the address the client called
        where = "/".join(quote(p, safe=":") for p in (ns, run_id, kind, name))
        signed = {
            f: f"{base}/api/v1/{FILES}/{where}/{f}?expires={expires}"
            f"&signature={signer.signature(ns, path, f, expires)}"
            for f in files
        }
        return {"urls": signed, "expires": datetime.fromtimestamp(expires, UTC).isoformat()}

    @r.get(f"/{FILES}/{{ns}}/{{run_id}}/{{kind}}/{{name}}/{{file}}", include_in_schema=False)
    async def download(
        ns: str, run_id: str, kind: str, name: str, file: str, expires: int, signature: str
    ) -> FileResponse:
        path = checkpoint_path(run_id, kind, name)
        signer.check(ns, path, file, expires, signature)  # the URL is the credential
        files = await call(proto.training().saved_files, ns, path.uri)
        if file not in files or not files[file].is_file():
            raise NotFoundError(f"no file {file!r} in {path.uri}", field="file")
        return FileResponse(files[file], media_type="application/octet-stream")


def save_weights_external(proto: Protocol, ns: str, body: SaveExternal) -> str:
    """The model's adapter as a PEFT directory (``tinker://<model>/external_weights/<name>``),
    queued on the model's queue like save_weights."""
    if body.age_encryption_recipients:
        raise InvalidRequestError(
            "age encryption of exported weights is not supported",
            field="age_encryption_recipients",
        )
    model = proto.registry.model(ns, body.model_id)
    name = _name(body.path, "", "path")
    ttl = body.ttl_seconds

    def done(saved: SavedState) -> dict[str, Any]:
        return {"path": saved.path, "size_bytes": saved.size_bytes, "type": "save_weights_external"}

    call = SaveState(name, "external_weights", ttl)
    return proto.queue_call(model, body.seq_id, "SaveWeightsExternal", call, done)
