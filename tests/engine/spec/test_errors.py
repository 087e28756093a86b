"""The one error hierarchy (loraplex_engine.spec.errors) and its HTTP statuses (server/errors.py).

Every API error class must be listed in the server's status table with a 4xx status (503
only for ``unavailable``) and its own stable code, documented in docs/engine-api.md, so a
new class can neither silently answer 500 nor inherit its parent's code by accident.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from loraplex_engine.server.app import create_app
from loraplex_engine.server.errors import HTTP_STATUS, http_status
from loraplex_engine.spec import errors
from loraplex_engine.spec.errors import ApiError, LoraplexError, UnavailableError

REPO = Path(__file__).resolve().parents[3]
PACKAGE = REPO / "trainer-image" / "loraplex_engine"

# Pinned: changing a code or status is an API change (docs/engine-api.md, the operator).
EXPECTED = {
    "UnauthorizedError": ("unauthorized", 401),
    "NotFoundError": ("not_found", 404),
    "ConflictError": ("conflict", 409),
    "NoCapacityError": ("no_capacity", 409),
    "NamespaceShareError": ("namespace_share", 409),
    "BodyTooLargeError": ("too_large", 413),
    "InvalidRequestError": ("invalid_request", 422),
    "InvalidSpecError": ("invalid_spec", 422),
    "BadCheckpointError": ("bad_checkpoint", 422),
    "UnavailableError": ("unavailable", 503),
}


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


API_ERRORS = _subclasses(ApiError)


def test_every_api_error_has_its_own_code_and_a_listed_client_status() -> None:
    assert API_ERRORS, "no ApiError subclasses found"
    for cls in API_ERRORS:
        assert cls.__module__ == "loraplex_engine.spec.errors", cls
        assert cls in HTTP_STATUS, f"{cls.__name__} has no entry in server_errors.HTTP_STATUS"
        status = HTTP_STATUS[cls]
        assert 400 <= status < 500 or (cls is UnavailableError and status == 503), cls
        assert "code" in vars(cls), f"{cls.__name__} inherits its code"
    codes = [cls.code for cls in API_ERRORS]
    assert len(set(codes)) == len(codes), codes
    assert {c.__name__: (c.code, HTTP_STATUS[c]) for c in API_ERRORS} == EXPECTED
    assert set(HTTP_STATUS) == {ApiError, *API_ERRORS}


def test_codes_and_statuses_are_the_documented_ones() -> None:
    doc = (REPO / "docs" / "engine-api.md").read_text()
    table = dict(re.findall(r"^\| `([a-z_]+)` \| (\d{3}) \|", doc, re.M))
    for cls in API_ERRORS:
        assert table.get(cls.code) == str(HTTP_STATUS[cls]), cls.__name__


def test_an_unlisted_subclass_answers_its_base_status_not_500() -> None:
    class Fresh(errors.ConflictError):
        code = "fresh"

    assert http_status(Fresh("x")) == 409


class _Raising:
    """An EngineService whose get_experiment raises the error it is given."""

    model_name = "fake-base"
    rollout_backend = "torch"

    def __init__(self) -> None:
        self.error: Exception = RuntimeError()

    def is_ready(self) -> bool:
        return True

    def get_experiment(self, exp_id: str) -> None:
        raise self.error


@pytest.fixture(scope="module")
def raising() -> Iterator[tuple[_Raising, TestClient]]:
    engine = _Raising()
    with TestClient(create_app(engine, None), raise_server_exceptions=False) as client:
        yield engine, client


def _client_get(raising: tuple[_Raising, TestClient], error: Exception) -> httpx.Response:
    engine, client = raising
    engine.error = error
    return client.get("/v1/experiments/a")


@pytest.mark.parametrize("cls", API_ERRORS, ids=lambda c: c.__name__)
def test_the_server_answers_each_api_error_with_its_status_and_body(
    cls: type[ApiError], raising: tuple[_Raising, TestClient]
) -> None:
    r = _client_get(raising, cls("what went wrong", field="spec.x"))
    status = HTTP_STATUS[cls]
    assert r.status_code == status
    openai_type = {401: "authentication_error", 404: "not_found_error"}.get(
        status, "server_error" if status >= 500 else "invalid_request_error"
    )
    assert r.content == (
        b'{"error":{"code":"%s","message":"what went wrong","field":"spec.x",'
        b'"type":"%s","param":"spec.x"}}' % (cls.code.encode(), openai_type.encode())
    )


def test_a_core_error_reaching_the_server_is_an_engine_bug(
    raising: tuple[_Raising, TestClient],
) -> None:
    r = _client_get(raising, errors.CheckpointError("untranslated"))
    assert r.status_code == 500
    assert r.json()["error"] == {
        "code": "internal",
        "message": "internal error (CheckpointError)",
        "field": None,
        "type": "server_error",
        "param": None,
    }


# Run by the vLLM worker in vLLM's environment, where loraplex_engine.spec.errors is not
# importable; their errors reach the engine as the protocol's error replies.
VLLM_WORKER_SIDE = {f"rollout/vllm/{f}.py" for f in ("worker", "worker_env", "tensor_sync")}


def test_every_engine_error_class_lives_in_errors_py() -> None:
    """One hierarchy, one module: no exception class is defined anywhere else."""
    elsewhere = []
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).as_posix() == "spec/errors.py":
            continue
        if (
            path.relative_to(PACKAGE).as_posix() in VLLM_WORKER_SIDE
        ):  # another interpreter: loraplex_engine is not there
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b) for b in node.bases]
                if any(b.endswith(("Error", "Exception")) for b in bases):
                    elsewhere.append(f"{path.relative_to(PACKAGE)}: {node.name}")
    assert elsewhere == []
    for cls in _subclasses(Exception):
        if cls.__module__ == "loraplex_engine.spec.errors":
            assert issubclass(cls, LoraplexError), cls
