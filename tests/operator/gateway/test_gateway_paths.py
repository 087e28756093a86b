"""The gateway's allowlist (gateway/paths.py): a request path is plain or refused, a
Tinker call is one of the exact routes or refused, ids are checked and quoted, and the
role is checked on the route matched. Pure: no process (the live attacks are
tests/engine/server/test_gateway_paths_live.py's)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from loraplex_operator.gateway import paths
from loraplex_operator.gateway.keys import SAMPLE, TRAIN, Key
from loraplex_operator.gateway.paths import Refused, TinkerCall, match_tinker, plain_path

SID = "s0123456789abcdef0123"


@pytest.mark.parametrize(
    "raw",
    [
        f"/api/v1/sessions/{SID}/../../../../v1/experiments",
        f"/api/v1/sessions/{SID}/%2e%2e/%2e%2e/v1/experiments",
        f"/api/v1/sessions/{SID}/%2E%2E/v1/experiments",
        f"/api/v1/sessions/{SID}%2f..%2fv1%2fexperiments",
        f"/api/v1/sessions/{SID}//finish",
        "/api/v1/samplers/.",
        "/api/v1/create_session/",
        "/v1/models/team-a./../../../v1/experiments",
        "/v1/models/a%0ab",
        "/v1/models/a\nb",
        "/v1/models/a\rb",
        "/v1/models/a b",
        "/v1/models/a\\..\\b",
        "/v1/models/\u00e9",
        "v1/models",
        "//v1/models",
    ],
)
def test_a_path_that_is_not_plain_is_refused(raw: str) -> None:
    found = plain_path(raw.encode("utf-8"))
    assert isinstance(found, Refused) and found.status == 400, (raw, found)


@pytest.mark.parametrize(
    "raw", ["/", "/healthz", f"/api/v1/sessions/{SID}/finish", "/v1/models/team-a.m@v3"]
)
def test_a_plain_path_passes_unchanged(raw: str) -> None:
    assert plain_path(raw.encode()) == raw


@pytest.mark.parametrize(
    ("method", "route", "name"),
    [
        ("POST", "create_session", "create_session"),
        ("POST", f"sessions/{SID}/finish", "sessions/{}/finish"),
        ("GET", f"samplers/{SID}:sample:0", "samplers/{}"),
        ("GET", f"samplers/{SID}:sample:b1f:tiny-llama.v2", "samplers/{}"),
        ("GET", f"training_runs/{SID}:train:0", "training_runs/{}"),
        ("GET", f"training_runs/{SID}:train:0/checkpoints", "training_runs/{}/checkpoints"),
        ("GET", "checkpoints", "checkpoints"),
        ("POST", "forward_backward", "forward_backward"),
        ("POST", "retrieve_futures", "retrieve_futures"),
        ("POST", "cancel_future", "cancel_future"),
        ("POST", "save_weights_external", "save_weights_external"),
        (
            "DELETE",
            f"training_runs/{SID}:train:0/checkpoints/sampler_weights/step-1",
            "training_runs/{}/checkpoints/{}/{}",
        ),
        (
            "PUT",
            f"training_runs/{SID}:train:0/checkpoints/weights/final/ttl",
            "training_runs/{}/checkpoints/{}/{}/ttl",
        ),
        (
            "GET",
            f"training_runs/{SID}:train:0/checkpoints/external_weights/x/external_weights_urls",
            "training_runs/{}/checkpoints/{}/{}/external_weights_urls",
        ),
        (
            "GET",
            f"external_weights_files/team-a/{SID}:train:0/external_weights/x/adapter_config.json",
            "external_weights_files/{}/{}/{}/{}/{}",
        ),
    ],
)
def test_the_sdks_routes_match_as_themselves(method: str, route: str, name: str) -> None:
    call = match_tinker(method, route)
    assert isinstance(call, TinkerCall), call
    assert (call.name, call.route) == (name, route)


@pytest.mark.parametrize(
    ("method", "route", "status"),
    [
        ("GET", f"sessions/{SID}/../../../../v1/experiments", 404),  # no route that long
        ("GET", f"sessions/{SID}", 404),  # not a route the engine serves
        ("POST", f"sessions/{SID}/finish/x", 404),
        ("GET", "create_session", 404),  # the route, not that method
        ("POST", "samplers/x", 404),
        ("GET", "v1/experiments", 404),
        ("POST", "sessions/../finish", 400),
        ("POST", "sessions/./finish", 400),
        ("POST", "sessions//finish", 400),
        ("GET", "samplers/..", 400),
        ("GET", "samplers/a\nb", 400),
        ("GET", "samplers/a%2fb", 400),
        ("GET", "training_runs/.hidden", 400),
        ("GET", "training_runs/" + "x" * 600, 400),
        ("GET", f"training_runs/{SID}:train:0/checkpoints/weights/final", 404),  # DELETE only
        ("DELETE", f"training_runs/{SID}:train:0/checkpoints/../final", 400),
        ("POST", f"external_weights_files/team-a/{SID}:train:0/external_weights/x/f", 404),
        ("GET", f"external_weights_files/team-a/{SID}:train:0/external_weights/x", 404),
        ("GET", f"external_weights_files/team-a/{SID}:train:0/external_weights/x/..", 400),
    ],
)
def test_anything_else_is_refused(method: str, route: str, status: int) -> None:
    found = match_tinker(method, route)
    assert isinstance(found, Refused) and found.status == status, (route, found)


def test_ids_are_quoted_when_forwarded() -> None:
    # Every id the pattern admits is left as it is by quoting (the route forwarded is the
    # route matched); the pattern admits no character quoting would have to change.
    for ch in "/?#%\\ \n\r\t\"'<>[]{}|^`+=&;,$!*()":
        assert not paths.ID_RE.fullmatch("a" + ch), repr(ch)
        assert isinstance(match_tinker("GET", "samplers/a" + ch), Refused), repr(ch)
    assert paths.model_path("team-a.m:prod") == "/v1/models/team-a.m:prod"


def test_the_role_check_reads_the_route_matched() -> None:
    sample = Key(b"x" * 32, "team-a", SAMPLE, "k")
    train = Key(b"y" * 32, "team-a", TRAIN, "k")
    for route in ("forward_backward", "optim_step", "create_model", "load_weights"):
        call = match_tinker("POST", route)
        assert isinstance(call, TinkerCall)
        assert not sample.may(call.name) and train.may(call.name)
    run = f"training_runs/{SID}:train:0/checkpoints/weights/final"
    for method, route in (
        ("POST", "save_weights_external"),
        ("DELETE", run),
        ("PUT", f"{run}/ttl"),
    ):
        call = match_tinker(method, route)
        assert isinstance(call, TinkerCall)
        assert not sample.may(call.name) and train.may(call.name), route
    for method, route in (
        ("POST", f"sessions/{SID}/finish"),
        (
            "GET",
            f"training_runs/{SID}:train:0/checkpoints/external_weights/x/external_weights_urls",
        ),
    ):
        call = match_tinker(method, route)
        assert isinstance(call, TinkerCall) and sample.may(call.name), route


@pytest.mark.parametrize(
    "given", ["say-yes", "team-a.say-yes", "team-a.say-yes@v2", "team-a.say-yes:prod"]
)
def test_model_ids_pass(given: str) -> None:
    assert paths.model_problem(given) is None


@pytest.mark.parametrize(
    ("given", "status"),
    [
        ("team-a./../../../v1/experiments", 400),
        ("../v1/experiments", 400),
        ("..", 400),
        ("say\nyes", 400),
        ("say%0ayes", 400),
        ("a/b", 400),
        ("", 422),
        (None, 422),
        (3, 422),
    ],
)
def test_model_ids_that_are_not_ids_are_refused(given: object, status: int) -> None:
    found = paths.model_problem(given)
    assert found is not None and found.status == status and found.field == "model"


def test_the_allowlist_is_the_sdks_and_the_engines() -> None:
    """Every allowlisted route is one the engine serves, and the official SDK calls it
    (but the protocol's two it has no method for)."""
    import tinker
    from loraplex_engine.server.tinker import checkpoint_routes, future_routes, rest, routes

    sdk = ""
    for f in Path(tinker.__file__).parent.rglob("*.py"):
        sdk += f.read_text(encoding="utf-8")
    modules = (routes, rest, future_routes, checkpoint_routes)
    engine = "".join(Path(m.__file__).read_text() for m in modules)
    from loraplex_operator.gateway import tinker_downloads

    # The signed download URL's route: the SDK fetches the URL it is given, and the
    # engine's route is written with its FILES constant.
    download = f"{tinker_downloads.FILES}/{{}}/{{}}/{{}}/{{}}/{{}}"
    assert tinker_downloads.FILES == checkpoint_routes.FILES
    assert '@r.get(f"/{FILES}/{{ns}}/{{run_id}}/{{kind}}/{{name}}/{{file}}"' in engine
    for t in paths.TINKER_ROUTES:
        if t.name == download:
            continue
        sdk_name = t.name.replace("checkpoints/{}/{}", "checkpoints/{}")  # the SDK's <kind>/<name>
        sdk_pattern = re.escape("/api/v1/" + sdk_name).replace(re.escape("{}"), r"\{\w+\}")
        if t.name not in ("forward", "unload_model"):
            assert re.search(sdk_pattern, sdk), f"the SDK never calls {t.name}"
        engine_pattern = re.escape(f'@r.{t.method.lower()}("/{t.name}').replace(
            re.escape("{}"), r"\{\w+\}"
        )
        assert re.search(engine_pattern, engine), f"the engine serves no {t.method} {t.name}"


def test_body_ids_with_a_trailing_newline_are_not_ids() -> None:
    """The Kubernetes mode's ids (gateway/experiments.py) are matched whole: a ``$`` let
    ``s<hex>\\n`` through into an experiment's name."""
    from loraplex_operator.gateway import experiments as gx

    with pytest.raises(gx.BadRequest):
        gx.manifest("team-a", "pool", {"session_id": SID + "\n", "model_seq_id": 0})
    assert gx.experiment_name(f"{SID}:train:0") is not None
    assert gx.experiment_name(f"{SID}:train:0\n") is None
    assert gx.split_base_sampler(f"{SID}:sample:b1:tiny\n") is None
