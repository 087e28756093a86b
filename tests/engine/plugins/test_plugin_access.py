"""The pool's plug-in allowlist on a real ``loraplex-engine serve``.

The engine runs with ``--allow-plugins`` as the operator passes an EnginePool's
``spec.plugins.allowed`` (tests/operator/test_engine_pod.py checks that half): the reward
plug-in ``says-target`` granted to team-b alone, the ``gsm8k-calculator`` environment to
every namespace. team-a naming team-b's reward is refused at PUT (422 naming the field
and the namespace, and not listing team-b's plug-ins), team-b's PUT of it is admitted,
and /v1/capacity reports the grants.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.plugin_install import with_path
from tests.support.server_process import EngineServer, wait_until
from tests.support.tenant_api import LIMITS, put, spec, status

pytestmark = pytest.mark.slow

GRANTS = [
    "--allow-plugins=team-b=reward:says-target",
    "--allow-plugins=*=environment:gsm8k-calculator",
]
SAYS_TARGET = {"name": "target-token", "params": {"target": "yes"}, "reward": "says-target"}


@pytest.fixture(scope="module")
def server(
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    plugins_site: Path,
    engine_site: Path,
) -> Iterator[EngineServer]:
    work = tmp_path_factory.mktemp("plugin-access")
    srv = EngineServer(
        tiny_model_dir,
        work / "ckpt",
        max_adapters=4,
        workdir=work,
        extra_args=[*LIMITS, *GRANTS],
        env=with_path(plugins_site, engine_site),
    )
    with srv:
        yield srv


def test_a_plugin_granted_to_another_namespace_is_refused_at_put(server: EngineServer) -> None:
    with server.client() as api:
        r = put(api, "team-a.borrowed", spec(SAYS_TARGET))
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert error["field"] == "spec.task.reward", error
        assert "'says-target' is not allowed for namespace 'team-a'" in error["message"]
        assert error["message"].endswith("it may use: none"), error  # team-b's stay unnamed
        assert api.get("/v1/experiments/team-a.borrowed").status_code == 404
        env = {"name": "target-token", "environment": {"name": "word-tool"}}
        r = put(api, "team-a.env", spec(env))  # installed, granted to nobody
        assert r.status_code == 422 and r.json()["error"]["field"] == "spec.task.environment.name"
        assert "'word-tool' is not allowed for namespace 'team-a'" in r.json()["error"]["message"]


def test_the_namespace_granted_a_plugin_trains_with_it(server: EngineServer) -> None:
    with server.client() as api:
        r = put(api, "team-b.own", spec(SAYS_TARGET))
        assert r.status_code == 201, r.text
        wait_until(lambda: status(api, "team-b.own")["step"] >= 1, timeout=120)
        assert api.delete("/v1/experiments/team-b.own").status_code == 200
        # A grant to every namespace: team-a's environment experiment is admitted.
        calc = {"name": "gsm8k", "environment": {"name": "gsm8k-calculator", "maxTurns": 2}}
        assert put(api, "team-a.calc", spec(calc)).status_code == 201
        assert api.delete("/v1/experiments/team-a.calc").status_code == 200


def test_capacity_reports_the_grants(server: EngineServer) -> None:
    with server.client() as api:
        plugins = api.get("/v1/capacity").json()["plugins"]
    assert "says-target" in plugins["rewards"]  # installed: listed for the operator
    assert plugins["allowed"] == [
        {"namespaces": ["team-b"], "rewards": ["says-target"], "environments": []},
        {"namespaces": None, "rewards": [], "environments": ["gsm8k-calculator"]},
    ]
