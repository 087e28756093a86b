"""The operator keeps working when its credentials change under it.

A real operator process against the kmock API server, which lets in only the bearer
tokens of `ApiServer.tokens`. The operator authenticates through a kubeconfig `tokenFile`
(as a projected service-account token is read) or an `exec` plugin (EKS, GKE, AKS:
a command printing an ExecCredential). The token then rotates: the file changes and the
API server refuses the old token. An experiment created after the rotation must still be
seen by kopf's watches and handlers and get its status from the reconciler, which both
succeeds only if kopf and the operator's client loaded the new token.

No engines: an experiment whose EnginePool does not exist is admitted by the operator
alone (Pending, Admitted=False), which exercises kopf (watch, handler patches) and the
reconciler's client (status patch).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.harness import OPERATOR_AGENTS, Harness

EXEC_PLUGIN = """\
import json, sys
token = open(sys.argv[1]).read().strip()
print(json.dumps({
    "apiVersion": "client.authentication.k8s.io/v1beta1",
    "kind": "ExecCredential",
    "status": {"token": token},
}))
"""


def kubeconfig_user(how: str, token_file: Path, tmp_path: Path) -> dict[str, Any]:
    if how == "tokenFile":
        return {"tokenFile": str(token_file)}
    plugin = tmp_path / "exec-plugin.py"
    plugin.write_text(EXEC_PLUGIN)
    return {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1beta1",
            "command": sys.executable,
            "args": [str(plugin), str(token_file)],
            "interactiveMode": "Never",
        }
    }


def operator_tokens(h: Harness) -> set[str]:
    """The bearer tokens the operator's requests (kopf's and its client's) carried."""
    assert h.api is not None
    seen = set()
    for req in list(h.api):
        headers = {k.lower(): v for k, v in req.headers.items()}
        if headers.get("user-agent", "").startswith(OPERATOR_AGENTS):
            seen.add((headers["user-agent"].split("/")[0], headers.get("authorization")))
    return seen


async def admitted_pending(h: Harness, name: str) -> dict[str, Any]:
    await h.apply(h.experiment_obj(name, pool="no-such-pool"))
    status = await h.wait_phase("team-a", name, "Pending", timeout=90)
    cond = next(c for c in status["conditions"] if c["type"] == "Admitted")
    assert cond["status"] == "False" and "no-such-pool" in cond["message"]
    return status


@pytest.mark.parametrize("how", ["tokenFile", "exec"])
async def test_operator_survives_token_rotation(how: str, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("token-one\n")
    h = Harness(tmp_path, tmp_path)  # no engines are started: no pool exists
    h.kubeconfig_user = kubeconfig_user(how, token_file, tmp_path)
    h.api_tokens = {"token-one"}
    async with h:
        await admitted_pending(h, "before")

        token_file.write_text("token-two\n")
        h.api.tokens = {"token-two"}  # type: ignore[union-attr]
        await admitted_pending(h, "after")

        seen = operator_tokens(h)
        for agent in ("kopf", "loraplex-operator"):
            assert (agent, "Bearer token-two") in seen, json.dumps(sorted(map(str, seen)))
