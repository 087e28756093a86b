"""verifiers (``verifiers.v1``) environments behind our interface, the engine sampling
every model turn.

A verifiers environment drives its episode itself: ``Env.run_episode`` runs its agents,
whose harness asks an OpenAI-compatible endpoint for each model turn, then scores the
trace with the task's ``@reward`` functions. There is no turn-level stepping to call,
so the control is inverted here: each episode runs as a coroutine on one event loop in
this (plug-in worker) process, with the real verifiers machinery (its interception
server, ``Env.run``/``finalize``, the task's scoring), and its model client is
:class:`EngineClient`, which answers a model call by handing it back to the engine:

* ``start()`` runs the episode to its first model call; the call's messages are the
  text the engine encodes and samples from the experiment's live adapter;
* ``step(action)`` answers the pending call with the engine's decoded sample and runs
  the episode to its next call (the messages the environment added since, tool results
  or a user's turn, are the observation: appended as encoded text, masked out of the
  loss) or to its end (its traces' rewards, summed, are the episode's reward).

So the trained row is the engine's own: the prompt, the sampled ids with their
log-probs, the observations; nothing the harness sends back is re-tokenised. A harness
that rewrites the conversation (anything but appending to it) fails its experiment: its
context would no longer be the sampled tokens. Every seat plays verifiers_chat.py's
in-process harness (why: there). Runs in the plug-in worker only (imports verifiers).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import queue
import sys
import threading
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

from verifiers.v1.clients import Client, EvalClientConfig, ModelContext
from verifiers.v1.clients.train import serialize_completion
from verifiers.v1.configs.agent import AgentConfig
from verifiers.v1.configs.taskset import TasksetConfig
from verifiers.v1.interception import server as interception_server
from verifiers.v1.types import AssistantMessage, Response, Usage, content_text
from verifiers.v1.utils.loaders import (
    env_config_type,
    load_environment,
    resolve_env_config,
    taskset_class,
)

from loraplex_engine.environments import verifiers_chat
from loraplex_engine.environments.base import Environment, Step
from loraplex_engine.plugins.discovery import VERIFIERS_PREFIX

PREFIX = VERIFIERS_PREFIX  # task.environment.name = "verifiers:<taskset module>"
ENGINE_URL = "http://loraplex-engine.invalid/v1"  # never dialled: EngineClient answers
ROWS = ("engine", "taskset")  # params["rows"]: whose rows the episodes play
MAX_TASKSET_ROWS = 100_000  # rows="taskset": the most rows read from the taskset

sys.modules.setdefault(verifiers_chat.HARNESS_ID, verifiers_chat)


class _Loop:
    """One event loop, on a thread, for every episode of this worker."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True, name="verifiers").start()

    def submit(self, coro: Any) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)


_loop: _Loop | None = None
_envs: dict[tuple, Any] = {}
_episodes: dict[str, _Episode] = {}
_ids = itertools.count()


def loop() -> _Loop:
    global _loop
    if _loop is None:
        _loop = _Loop()
    return _loop


class EngineClient(Client):
    """verifiers' model client for every loraplex episode: a call waits for the engine."""

    async def get_response(self, dialect, body, sampling, session_id=None, turn=None, headers=None):
        model = str(body.get("model"))
        episode = _episodes.get(model)
        if episode is None:
            raise RuntimeError(f"no loraplex episode {model!r} (the model name is the episode's)")
        messages = [
            (m.role, content_text(getattr(m, "content", None)))
            for m in dialect.parse_request(body).messages
        ]
        answer: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        episode.events.put(("call", messages, answer))
        text = await answer
        response = Response(
            id=f"{model}-{episode.turns}",
            created=0,
            model=model,
            message=AssistantMessage(content=text),
            finish_reason="stop",
            usage=Usage(prompt_tokens=0, completion_tokens=0),  # the engine counts tokens
        )
        response.raw = serialize_completion(response, model)
        return response


_resolve = interception_server.resolve_client


def _resolve_client(config: Any) -> Client:
    """verifiers builds its model clients from their configs: ENGINE_URL's is ours."""
    if getattr(config, "base_url", None) == ENGINE_URL:
        return EngineClient()
    return _resolve(config)


interception_server.resolve_client = _resolve_client


def import_taskset(taskset_id: str) -> None:
    """Import the taskset's module (``ModuleNotFoundError``, ``TypeError``: not one)."""
    taskset_class(taskset_id)


def environment(taskset_id: str, params: Mapping[str, str]) -> Any:
    """The verifiers environment of ``taskset_id`` (an installed module exporting a
    ``Taskset``), configured by ``params`` (the fields its taskset's config adds, and
    ``rows``),
    loaded once per worker and serving (its interception, shared tools) on the loop."""
    key = (taskset_id, tuple(sorted(params.items())))
    if key not in _envs:
        fields = {k: v for k, v in params.items() if k != "rows"}
        # Tenants' strings: only the taskset's own fields. verifiers' base fields choose
        # what runs or is read (id: the module imported; system_prompt: a file; task:
        # reward functions by import path), the platform's business.
        base = sorted(set(fields) & set(TasksetConfig.model_fields))
        if base:
            raise ValueError(f"params {', '.join(base)}: not settable (verifiers' own fields)")
        cls = env_config_type(taskset_id)
        seat = {"harness": {"id": verifiers_chat.HARNESS_ID}, "runtime": {"type": "subprocess"}}
        roles = [n for n, f in cls.model_fields.items() if isinstance(f.default, AgentConfig)]
        config = resolve_env_config(
            {"taskset": {"id": taskset_id, **fields}, "interception": {"type": "server"}}
            | {role: seat for role in roles}
        )
        env = load_environment(config)
        stack = contextlib.AsyncExitStack()
        loop().submit(stack.enter_async_context(env.serving())).result()
        _envs[key] = env
    return _envs[key]


def _task(env: Any, prompt: str, answer: str, rows: str) -> Any:
    """The episode's verifiers task: the engine's problem (its prompt, and its answer
    where the taskset's data has an ``answer`` field), or with ``rows=taskset`` one of
    the taskset's own rows, picked by the prompt (a group's copies play the same row)."""
    if rows == "taskset":
        tasks = getattr(env, "_loraplex_rows", None)
        if tasks is None:
            tasks = env._loraplex_rows = list(itertools.islice(iter(env.taskset), MAX_TASKSET_ROWS))
        if not tasks:
            raise ValueError("params.rows=taskset: the taskset has no rows")
        pick = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big")
        return tasks[pick % len(tasks)]
    task_cls = type(env.taskset).task_type()
    data_cls = task_cls.data_type()
    data = {"prompt": prompt} | ({"answer": answer} if "answer" in data_cls.model_fields else {})
    return task_cls(data_cls(**data), env.taskset.config.task)


def _render(messages: list[tuple[str, str]]) -> str:
    return "".join(f"\n{text}\n" for _, text in messages)


class _Episode:
    """What the engine's calls and the episode's coroutine pass each other."""

    def __init__(self) -> None:
        self.model = f"loraplex-episode-{next(_ids)}"
        self.events: queue.Queue = queue.Queue()
        self.turns = 0
        self.messages: list[tuple[str, str]] = []  # the pending call's
        self.answer: asyncio.Future[str] | None = None  # the pending call's
        self.last_action: str | None = None  # the sampled turn that answered the last call
        self.run: Future | None = None


class VerifiersEnvironment(Environment):
    """One episode of an installed verifiers environment (``verifiers:<taskset id>``)."""

    def __init__(
        self, name: str, prompt: str, answer: str, params: Mapping[str, str], max_turns: int
    ) -> None:
        super().__init__(prompt, answer, params, max_turns)
        rows = params.get("rows", "engine")
        if rows not in ROWS:
            raise ValueError(f"params.rows must be one of {', '.join(ROWS)}, got {rows!r}")
        self.env = environment(name.removeprefix(PREFIX), params)
        self.task = _task(self.env, prompt, answer, rows)
        self.episode = _Episode()

    def start(self) -> str:
        e = self.episode
        _episodes[e.model] = e
        ctx = ModelContext(
            e.model, EvalClientConfig(base_url=ENGINE_URL, api_key_var="LORAPLEX_NONE")
        )
        e.run = loop().submit(self._play(ctx))
        if self._next()[0] == "done":
            raise RuntimeError("the verifiers episode ended before the policy's first turn")
        return "\n\n".join(text for _, text in e.messages)

    async def _play(self, ctx: ModelContext) -> None:
        try:
            result = await self.env.run_episode(self.task, ctx)
        except BaseException as error:  # cancelled (cut by the engine) or broken
            self.episode.events.put(("error", error))
            raise
        self.episode.events.put(("done", result))

    def _next(self) -> tuple:
        """The episode's next model call (kept pending) or its end."""
        event = self.episode.events.get()  # bounded by the engine: --plugin-timeout
        if event[0] == "error":
            error = event[1]
            raise RuntimeError(f"the verifiers episode failed: {type(error).__name__}: {error}")
        if event[0] == "call":
            _, messages, self.episode.answer = event
            self._check_appended(messages)
            self.episode.messages = messages
        return event

    def _check_appended(self, messages: list[tuple[str, str]]) -> None:
        e = self.episode
        if e.last_action is None:
            return
        before = [*e.messages, ("assistant", e.last_action)]
        if messages[: len(before)] != before:
            raise RuntimeError(
                "the verifiers harness rewrote the conversation (its next request does "
                "not extend the last one with the sampled turn): loraplex trains on the "
                "sampled tokens, so a conversation may only grow"
            )

    def step(self, action: str) -> Step:
        e = self.episode
        assert e.answer is not None and e.run is not None
        before = len(e.messages) + 1
        e.turns += 1
        e.last_action = action
        loop().loop.call_soon_threadsafe(_set, e.answer, action)
        event = self._next()
        if event[0] == "call":
            return Step(observation=_render(e.messages[before:]))
        return Step(reward=_reward(event[1]), done=True)

    def close(self) -> None:
        e = self.episode
        _episodes.pop(e.model, None)
        if e.run is not None and not e.run.done():
            e.run.cancel()  # an episode the engine cut: its coroutine ends here


def _set(answer: asyncio.Future, text: str) -> None:
    if not answer.done():
        answer.set_result(text)


def _reward(episode: Any) -> float:
    """The episode's reward: its traces' (each the sum of its weighted rewards); an
    episode that failed (a hook raised, a deadline passed) fails its experiment."""
    if not episode.ok:
        errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
        why = f"{errors[0].type}: {errors[0].message}" if errors else "a trace failed"
        raise RuntimeError(f"the verifiers episode failed: {' '.join(why.split())[:500]}")
    return float(sum(trace.reward for trace in episode.traces))
