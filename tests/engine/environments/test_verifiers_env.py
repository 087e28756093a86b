"""verifiers (``verifiers.v1``) environments (issue 30 item 2, the second adapter):
installed from a test package (tests/plugins/loraplex_vf_envs, pip-installed as a
platform would), listed as ``verifiers:<taskset>`` ids, run by the real verifiers
machinery in a real plug-in worker with the engine answering every model call.

The driver tests stand a scripted policy in for the model (tests/support/episode_driver.py's
``ScriptedPolicy``: which ids, log-probs and masks a row gets is what they check, which a
sampled policy would make unknowable); the engine tests run real engine processes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from loraplex_engine.environments.episodes import EpisodeGroup
from loraplex_engine.environments.session import EnvironmentSession
from loraplex_engine.plugins import discovery
from loraplex_engine.plugins.host import PluginHost
from loraplex_engine.spec.plugins import EnvironmentSpec

from tests.support.episode_driver import (
    ScriptedPolicy,
    as_ids,
    as_text,
    episode_group,
    play_group,
)
from tests.support.plugin_install import install, with_path
from tests.support.server_process import EngineServer, wait_until
from tests.support.tenant_api import LIMITS, environment_spec, put, status, wait_steps

pytest.importorskip("verifiers.v1", reason="verifiers is in requirements/dev-nodeps.txt")

PACKAGE = Path(__file__).resolve().parents[2] / "plugins" / "loraplex_vf_envs"
GUESS = "verifiers:loraplex_vf_guess"
FEEDBACK = "wrong, try again:"  # loraplex_vf_guess's default feedback (a user turn)


@pytest.fixture(scope="module")
def vf_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return install(tmp_path_factory.mktemp("vf-envs"), PACKAGE)


@pytest.fixture
def session_of(vf_site: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator:
    monkeypatch.setenv("PYTHONPATH", with_path(vf_site)["PYTHONPATH"])
    opened: list[EnvironmentSession] = []

    def make(name: str, max_turns: int = 3, timeout: float = 30.0, **params: str):
        spec = EnvironmentSpec(name=name, maxTurns=max_turns, params=params)
        opened.append(EnvironmentSession(spec, PluginHost("test", f"environment:{name}", timeout)))
        return opened[-1]

    yield make
    for s in opened:
        s.close()


class _Turns(ScriptedPolicy):
    """Answers the k-th call with ``turns[k]``."""

    def __init__(self, *turns: str) -> None:
        super().__init__("")
        self.turns = turns

    def __call__(self, requests):
        self.turn = self.turns[min(len(self.calls), len(self.turns) - 1)]
        return super().__call__(requests)


def test_installed_verifiers_environments_are_listed(
    vf_site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each module of a distribution requiring verifiers that exports a Taskset, in the
    engine's listing child; nothing else of that distribution."""
    monkeypatch.setenv("PYTHONPATH", with_path(vf_site)["PYTHONPATH"])
    found = discovery._list_in_child()
    vf = [n for n in found.environments if n.startswith(discovery.VERIFIERS_PREFIX)]
    assert vf == [GUESS, "verifiers:loraplex_vf_hangs", "verifiers:loraplex_vf_raises"]
    assert found.problems == ()


def test_a_verifiers_episode_trains_on_the_sampled_ids_with_the_env_turns_masked(
    session_of,
) -> None:
    """loraplex_vf_guess: the policy's first two answers are wrong, the environment's
    Env.run answers each with a user turn, the third is right. The row is the sampled
    ids and log-probs exactly as the policy gave them, the user turns between them
    encoded and masked (log-prob 0); each turn was sampled from the whole context; the
    task's @reward scored the episode."""
    session = session_of(GUESS)
    group = episode_group(session, [("say yes", "yes")], budget=512)
    policy = _Turns("no", "nope", "yes!")
    play_group(group, policy)
    assert group.error is None
    (e,) = group.episodes
    obs = f"\n{FEEDBACK}\n"
    assert as_text(e.ids) == "no" + obs + "nope" + obs + "yes!"
    assert e.mask == [1] * 2 + [0] * len(obs) + [1] * 4 + [0] * len(obs) + [1] * 4
    assert e.logprobs == [-1.0] * 2 + [0.0] * len(obs) + [-2.0] * 4 + [0.0] * len(obs) + [-3.0] * 4
    assert e.turns == 3 and e.done and not e.cut and e.reward == 1.0
    first, second, third = (calls[0] for calls in policy.calls)
    assert first.prompt_ids == as_ids("say yes")
    assert second.prompt_ids == as_ids("say yes") + as_ids("no" + obs)
    assert third.prompt_ids == second.prompt_ids + as_ids("nope" + obs)


def test_an_episode_the_engine_cuts_is_scored_so_far_and_its_worker_goes_on(session_of) -> None:
    """maxTurns 2: the episode still waiting for its third turn is cut (reward 0, the
    environment never scored it) and its coroutine cancelled; the next step's episodes
    play in the same worker."""
    session = session_of(GUESS, max_turns=2)
    group = episode_group(session, [("say yes", "yes")], budget=512)
    play_group(group, _Turns("no"))
    (e,) = group.episodes
    assert group.error is None and e.cut and e.turns == 2 and e.reward == 0.0
    again = episode_group(session, [("say no", "no")], budget=512)
    play_group(again, _Turns("no"))
    assert again.error is None and again.episodes[0].reward == 1.0


def test_rows_from_the_taskset_and_params_to_its_config(session_of) -> None:
    """params.rows=taskset: the episode plays one of the taskset's own rows (its prompt,
    its answer), the same row for every copy of a prompt; another param sets the
    taskset's config (the feedback)."""
    session = session_of(GUESS, rows="taskset", feedback="again:")
    group = episode_group(session, [("p", "ignored"), ("p", "ignored")], budget=512)
    starts = [as_text(e.request.prompt_ids) for e in group.episodes]
    assert starts[0] == starts[1] and starts[0].startswith("row ")
    answer = starts[0].rsplit(" ", 1)[1]
    play_group(group, _Turns("hmm", answer))
    for e in group.episodes:
        assert as_text(e.ids) == f"hmm\nagain:\n{answer}" and e.reward == 1.0


def test_a_param_the_taskset_does_not_have_is_named(session_of) -> None:
    session = session_of(GUESS, colour="red")
    with pytest.raises(Exception, match=r"taskset\.colour.*Extra inputs are not permitted"):
        episode_group(session, [("p", "a")], budget=64)


@pytest.mark.parametrize("field", ["id", "system_prompt"])
def test_params_cannot_set_verifiers_own_taskset_fields(session_of, field: str) -> None:
    """A tenant's string may not choose the module imported (id) or a file read
    (system_prompt): refused, naming the param."""
    session = session_of(GUESS, **{field: "/etc/passwd"})
    with pytest.raises(Exception, match=rf"params {field}: not settable"):
        episode_group(session, [("p", "a")], budget=64)


def _failed(session, turns: int = 1) -> EpisodeGroup:
    group = episode_group(session, [("p", "a")], budget=64)
    play_group(group, _Turns("x"))
    assert group.error is not None and group.error[1] == "reward_error"
    return group


def test_a_reward_that_raises_fails_its_group_naming_it(session_of) -> None:
    group = _failed(session_of("verifiers:loraplex_vf_raises"))
    assert "ValueError: this reward is broken" in group.error[0]


def test_an_episode_that_hangs_fails_its_group_and_its_worker_is_killed(session_of) -> None:
    session = session_of("verifiers:loraplex_vf_hangs", timeout=2.0)
    pid = session.host.pid
    started = time.monotonic()
    group = _failed(session)
    assert "environment verifiers:loraplex_vf_hangs did not answer within 2s" in group.error[0]
    assert time.monotonic() - started < 90  # the worker's start-up (imports) + the bound
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


# ---- on a real engine process -----------------------------------------------------------

PLUGIN_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, vf_site: Path
) -> Iterator[EngineServer]:
    work = tmp_path_factory.mktemp("verifiers-engine")
    srv = EngineServer(
        tiny_model_dir,
        work / "ckpt",
        max_adapters=8,
        workdir=work,
        extra_args=[*LIMITS, "--plugin-timeout", str(PLUGIN_TIMEOUT_S)],
        env=with_path(vf_site),
    )
    with srv:
        yield srv


@pytest.mark.slow
def test_an_experiment_trains_on_a_verifiers_environment_and_hostile_ones_fail_alone(
    server: EngineServer,
) -> None:
    """An unknown verifiers id is refused at PUT, listing the installed ones. The guess
    environment trains for steps on copy's prompts, several turns an episode (the tiny
    model never says the prompt back exactly, so each gets the user's feedback): more
    tokens a row than one turn may sample. Beside it, the environment whose reward
    raises and the one that hangs each fail their own experiment, naming why; the guess
    experiment trains on."""
    env = {"name": GUESS, "maxTurns": 3, "maxEpisodeTokens": 96}
    with server.client() as api:
        unknown = {"name": "copy", "environment": {**env, "name": "verifiers:nope"}}
        refused = put(api, "default.unknown", environment_spec(unknown, group=4, prompts=2))
        assert refused.status_code == 422 and GUESS in refused.text, refused.text
        body = environment_spec({"name": "copy", "environment": env}, group=4, prompts=2)
        assert put(api, "team-a.guess", body).status_code == 201
        s = wait_steps(api, "team-a.guess", 2, timeout=300)
        assert s["phase"] == "Running", s
        assert s["rolloutTokens"] / (s["step"] * 8) > 8, s  # one turn samples at most 8
        hostile = {
            "team-b.raises": ("verifiers:loraplex_vf_raises", "ValueError: this reward is broken"),
            "team-c.hangs": (
                "verifiers:loraplex_vf_hangs",
                f"did not answer within {PLUGIN_TIMEOUT_S:g}s",
            ),
        }
        for exp, (name, _) in hostile.items():
            body = environment_spec(
                {"name": "copy", "environment": {"name": name}}, group=2, prompts=1
            )
            assert put(api, exp, body).status_code == 201
        for exp, (_, why) in hostile.items():
            f = wait_until(
                lambda e=exp: (x := status(api, e))["phase"] == "Failed" and x, timeout=180
            )
            assert f["failureReason"] == "reward_error" and why in f["error"], f
        step = status(api, "team-a.guess")["step"]
        s = wait_steps(api, "team-a.guess", step + 2, timeout=300)
        assert s["phase"] == "Running", s
        for exp in ["team-a.guess", *hostile]:
            assert api.delete(f"/v1/experiments/{exp}").status_code == 200
