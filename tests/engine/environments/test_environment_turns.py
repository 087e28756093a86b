"""Issue 30 item 2's leftovers on multi-turn environments: a slow environment holds only
its own experiment (its step completes in a later tick, the others' steps go on),
observations through the chat template (the exact sampled ids kept, the rendered
observation masked), on real plug-in workers and real engine processes. Helpers and the
scripted policy are tests/support/episode_driver.py's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from loraplex_engine.environments.episodes import new_group
from loraplex_engine.environments.observations import ChatObserver
from loraplex_engine.environments.player import EpisodePlayer, play
from loraplex_engine.rollout.base import Completion, RolloutRequest

from tests.support.episode_driver import (
    ScriptedPolicy,
    as_ids,
    as_text,
    episode_group,
    opened_sessions,
)
from tests.support.plugin_install import with_path
from tests.support.server_process import EngineServer, wait_until
from tests.support.tenant_api import LIMITS, environment_spec, put, status, wait_steps


@pytest.fixture
def session_of(plugins_site: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator:
    yield from opened_sessions(plugins_site, monkeypatch)


def test_a_slow_environment_leaves_its_turns_to_later_ticks_and_the_others_play_on(
    session_of, tmp_path: Path
) -> None:
    """Two experiments' groups in one player, ticked: the gated environment has not
    answered its first turn (its gate is shut), so its group waits in play while the
    other's two-turn episodes play to their end (its second turn sampled in a later
    round or tick); once the gate opens, the waiting group ends too, having taken exactly
    its one turn. Ordered by the gate, not by a clock: the deadline only sets how long
    each "tick" waits."""
    gate = tmp_path / "gate"
    slow = session_of("gated", max_turns=1, params={"gate": str(gate)})
    fast = session_of("word-tool", max_turns=2)
    slow_group = episode_group(slow, [("p", "a")], budget=64, slot=1, opened=False)
    fast_group = episode_group(fast, [("say yes:", "yes")], budget=64, slot=2, opened=False)
    player: EpisodePlayer[str] = EpisodePlayer(deadline_s=0.05)
    policy = ScriptedPolicy("yes")
    ended = player.play([("slow", slow_group), ("fast", fast_group)], policy, as_text)

    def tick() -> None:  # as the engine loop does: the next tick once an answer is back
        wait_until(player.has_arrived, timeout=60)
        ended.extend(player.play([], policy, as_text))

    while not ended:  # the fast one's worker starts, its two turns are played
        tick()
    assert [owner for owner, _ in ended] == ["fast"], ended
    assert fast_group.episodes[0].turns == 2 and fast_group.error is None
    assert player.waits(slow) and not player.waits(fast)
    waiting = gate.with_suffix(".waiting")  # the slow one's turn is with its environment
    while not waiting.exists():
        wait_until(lambda: waiting.exists() or player.has_arrived(), timeout=60)
        if not waiting.exists():
            tick()
    assert [owner for owner, _ in ended] == ["fast"] and player.waits(slow)
    slow_turns = [r for call in policy.calls for r in call if r.slot == 1]
    assert len(slow_turns) == 1  # no second turn while its environment is out
    gate.touch()
    tick()
    assert [owner for owner, _ in ended] == ["fast", "slow"]
    (e,) = slow_group.episodes
    assert e.done and e.turns == 1 and e.reward == 1.0 and not player.waits(slow)


# ---- observations through the chat template ---------------------------------------------

# SmolLM2-Instruct's template (ChatML), on the tiny tokenizer with its two special tokens.
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _tokenizer(kind: str, model_dir: Path):
    from loraplex_engine.dev.tiny_model import _llama3_style
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    if kind == "llama3":
        return _llama3_style(tok), "<|eot_id|>"
    if kind == "chatml":
        tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
        tok.chat_template = CHATML
        return tok, "<|im_end|>"
    return tok, tok.eos_token  # the tiny model's own template: "role: content\\n"


@pytest.mark.parametrize(
    ("kind", "observation"),
    [
        ("tiny", "\nuser: yes count 1\nassistant:"),  # after </s>: the turn's "\n" too
        ("llama3", "user: yes count 1<|eot_id|>assistant: "),  # <|eot_id|> was sampled
        ("chatml", "\n<|im_start|>user\nyes count 1<|im_end|>\n<|im_start|>assistant\n"),
    ],
)
def test_chat_observations_are_template_messages_after_the_exact_sampled_ids(
    session_of, tiny_model_dir: Path, kind: str, observation: str
) -> None:
    """observationFormat chat, with three chat templates: the tool's output joins the
    context as a user message rendered by the template (the assistant turn closed where
    the sampled turn did not close it, and opened again after), its ids masked; the
    sampled ids, stop token included, are in the row exactly as sampled, with their
    log-probs, and the second turn is sampled after the rendered observation."""
    tok, stop = _tokenizer(kind, tiny_model_dir)
    turn = [*tok("yes no", add_special_tokens=False).input_ids, tok.convert_tokens_to_ids(stop)]
    session = session_of("word-tool", max_turns=2)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "say yes:"}], tokenize=False, add_generation_prompt=True
    )
    prompt_ids = tok(prompt, add_special_tokens=False).input_ids

    def request(ids: list[int], room: int) -> RolloutRequest:
        return RolloutRequest(1, prompt_ids=ids, max_new_tokens=min(16, room), temperature=1)

    group = new_group(
        session,
        [("say yes:", "yes")],
        lambda text: prompt_ids,
        request,
        lambda ids: 512,
        ChatObserver(tok),
    )
    calls: list[list[RolloutRequest]] = []

    def policy(requests: list[RolloutRequest]) -> list[Completion]:
        calls.append(requests)
        return [Completion(list(turn), [-0.5 - len(calls)] * len(turn)) for _ in requests]

    play([group], policy, lambda ids: tok.decode(ids, skip_special_tokens=True))
    (e,) = group.episodes
    assert e.turns == 2 and e.done and group.error is None
    n, obs = len(turn), e.ids[len(turn) : -len(turn)]
    assert e.ids[:n] == turn and e.ids[-n:] == turn  # the sampled ids, untouched
    assert tok.decode(obs, skip_special_tokens=False) == observation
    assert e.mask == [1] * n + [0] * len(obs) + [1] * n
    assert e.logprobs == [-1.5] * n + [0.0] * len(obs) + [-2.5] * n
    assert calls[1][0].prompt_ids == prompt_ids + turn + obs


def test_an_observation_in_the_assistants_role_fails_its_group(
    session_of, tiny_model_dir: Path
) -> None:
    """observationFormat chat: the assistant's turns are the policy's, sampled; an
    environment's message in that role fails its experiment, naming the role."""
    tok, _ = _tokenizer("tiny", tiny_model_dir)
    session = session_of("impersonates", max_turns=3)

    def request(ids: list[int], room: int) -> RolloutRequest:
        return RolloutRequest(1, prompt_ids=ids, max_new_tokens=min(8, room), temperature=1)

    group = new_group(session, [("p", "a")], as_ids, request, lambda ids: 64, ChatObserver(tok))
    play([group], ScriptedPolicy("x"), as_text)
    assert group.error is not None and group.error[1] == "reward_error"
    assert "has a 'assistant' message; observations may be user or tool messages" in group.error[0]


def test_chat_observations_need_a_usable_chat_template(tiny_model_dir: Path) -> None:
    """Checked at PUT (engine._build): no template, or one that re-renders the earlier
    turns when a message is added, is an invalid spec naming observationFormat; the
    default follows task.chatTemplate."""
    from loraplex_engine.environments.observations import check_chat_templates, observation_format
    from loraplex_engine.spec.errors import InvalidSpecError
    from loraplex_engine.spec.experiment import TaskSpec
    from loraplex_engine.tokens import TokenCodec

    tok, _ = _tokenizer("tiny", tiny_model_dir)
    env = {"name": "word-tool"}
    chat = TaskSpec.model_validate(
        {"name": "copy", "environment": {**env, "observationFormat": "chat"}}
    )
    assert (
        observation_format(TaskSpec.model_validate({"name": "copy", "environment": env})) == "text"
    )
    with_prompts = TaskSpec.model_validate(
        {"name": "copy", "chatTemplate": True, "environment": env}
    )
    assert observation_format(with_prompts) == "chat"
    check_chat_templates(chat, TokenCodec(tok), "tiny")  # usable: no error
    tok.chat_template = "{% for m in messages[-1:] %}{{ m['content'] }}{% endfor %}"  # last only
    with pytest.raises(InvalidSpecError, match="renders earlier turns anew") as e:
        check_chat_templates(chat, TokenCodec(tok), "tiny")
    assert e.value.field == "spec.task.environment.observationFormat"
    tok.chat_template = None
    with pytest.raises(InvalidSpecError, match="no chat template: use observationFormat text"):
        check_chat_templates(chat, TokenCodec(tok), "tiny")


def _patient(model: Path, work: Path, site: Path, *args: str) -> EngineServer:
    """An engine whose plug-in bound (300 s) no test here reaches: a slow environment is
    slow, not hung."""
    extra = [*LIMITS, "--plugin-timeout", "300", *args]
    return EngineServer(
        model, work / "ckpt", max_adapters=4, workdir=work, extra_args=extra, env=with_path(site)
    )


@pytest.fixture(scope="module")
def patient_server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, plugins_site: Path
) -> Iterator[EngineServer]:
    with _patient(tiny_model_dir, tmp_path_factory.mktemp("patient"), plugins_site) as srv:
        yield srv


@pytest.fixture(scope="module")
def patient_pipelined(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, plugins_site: Path
) -> Iterator[EngineServer]:
    work = tmp_path_factory.mktemp("patient-pipelined")
    with _patient(tiny_model_dir, work, plugins_site, "--schedule", "pipelined") as srv:
        yield srv


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["patient_server", "patient_pipelined"])
def test_a_slow_environment_does_not_hold_the_other_tenants_steps(
    engine: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """team-a's environment answers its turn only when the test opens its gate. While
    its turn is out (its `.waiting` marker is written), team-b's experiment takes step
    after step; team-a's stays at step 0, Running. Then the gate opens and team-a's step
    completes (reward 1). Before, the environment's turn was played inside the tick: the
    tick, and team-b's steps with it, waited for the gate. Under both schedules (the
    pipelined one's lanes wait for a step in play too)."""
    server: EngineServer = request.getfixturevalue(engine)
    gate = tmp_path / "gate"
    env = {"name": "gated", "params": {"gate": str(gate)}, "maxTurns": 1, "maxEpisodeTokens": 8}
    slow, fast = "team-a.slow-env", "team-b.steps-on"
    with server.client() as api:
        body = environment_spec({"name": "copy"}, new_tokens=4, group=4, prompts=2)
        assert put(api, fast, body).status_code == 201
        body = environment_spec({"name": "copy", "environment": env}, steps=1, group=2, prompts=1)
        assert put(api, slow, body).status_code == 201
        wait_until(gate.with_suffix(".waiting").exists, timeout=120)
        start = status(api, fast)["step"]
        wait_steps(api, fast, start + 3, timeout=120)
        s = status(api, slow)
        assert s["step"] == 0 and s["phase"] == "Running", s
        gate.touch()
        s = wait_until(lambda: (s := status(api, slow))["phase"] == "Succeeded" and s, timeout=120)
        assert s["step"] == 1 and s["reward"] == 1.0, s
        assert status(api, fast)["phase"] == "Running"
        for e in (slow, fast):
            assert api.delete(f"/v1/experiments/{e}").status_code == 200


@pytest.mark.slow
def test_an_environment_trains_with_chat_observations(patient_server: EngineServer) -> None:
    """task.chatTemplate on (so observations are chat messages too) with the word-tool
    environment: episodes of two turns, the rendered observation between them, train."""
    env = {"name": "word-tool", "maxTurns": 2, "maxEpisodeTokens": 64}
    task = {"name": "target-token", "params": {"target": "yes"}, "chatTemplate": True}
    exp = "default.chat-env"
    with patient_server.client() as api:
        body = environment_spec({**task, "environment": env}, group=4, prompts=2)
        assert put(api, exp, body).status_code == 201
        s = wait_steps(api, exp, 2)
        assert s["phase"] == "Running", s
        # Each row: two sampled turns and "\nuser: yes count N\nassistant:" between them.
        assert s["rolloutTokens"] / (s["step"] * 8) > 8, s
        assert api.delete(f"/v1/experiments/{exp}").status_code == 200


@pytest.mark.slow
def test_an_experiment_removed_while_its_environment_holds_a_turn_goes_cleanly(
    patient_server: EngineServer, tmp_path: Path
) -> None:
    """DELETE while its environment holds a turn: answered at once (no tick is waiting on
    the environment), its worker is stopped and its step in play dropped; the same id
    PUT again starts afresh and completes its step."""
    gate = tmp_path / "gate"
    env = {"name": "gated", "params": {"gate": str(gate)}, "maxTurns": 1, "maxEpisodeTokens": 8}
    exp = "team-a.removed"
    body = environment_spec({"name": "copy", "environment": env}, steps=1, group=2, prompts=1)
    with patient_server.client() as api:
        assert put(api, exp, body).status_code == 201
        wait_until(gate.with_suffix(".waiting").exists, timeout=120)
        assert api.delete(f"/v1/experiments/{exp}").status_code == 200
        gate.touch()
        assert put(api, exp, body).status_code == 201
        s = wait_until(lambda: (s := status(api, exp))["phase"] == "Succeeded" and s, timeout=120)
        assert s["step"] == 1 and s["reward"] == 1.0, s
        assert api.delete(f"/v1/experiments/{exp}").status_code == 200


def test_a_template_that_refuses_an_observation_fails_only_that_group(
    session_of, tiny_model_dir: Path
) -> None:
    """A chat template that raises for a role (as some refuse non-alternating or tool
    turns) fails the group whose observation it could not render, with the template's
    message: the tick goes on."""
    tok, _ = _tokenizer("tiny", tiny_model_dir)
    tok.chat_template = (
        "{% for m in messages %}{% if m['content'] == 'yes count 1' %}"
        "{{ raise_exception('this template refuses it') }}{% endif %}"
        "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    session = session_of("word-tool", max_turns=2)

    def request(ids: list[int], room: int) -> RolloutRequest:
        return RolloutRequest(1, prompt_ids=ids, max_new_tokens=min(8, room), temperature=1)

    group = new_group(
        session, [("say yes:", "yes")], as_ids, request, lambda ids: 64, ChatObserver(tok)
    )
    play([group], ScriptedPolicy("yes no"), as_text)
    assert group.error is not None and group.error[1] == "reward_error", group.error
    assert "this template refuses it" in group.error[0]
