"""The plug-in worker: a child process per experiment that runs its plug-in code.

One JSON request a line on stdin, one JSON answer a line on the protocol descriptor (the
original stdout; plug-in code printing to stdout writes to stderr instead, so it cannot
corrupt the exchange). Requests: ``reward`` (a TRL-style function over a batch),
``env_check`` (the spec's params, at PUT), ``env_open`` (closing the episodes of the
last step first) / ``env_step`` / ``env_close`` (episodes, by the engine's ids). Answers are
``{"ok": true, ...}`` or ``{"ok": false, "error": str}``: a plug-in's exception becomes
the error its experiment fails with. Values are passed on as given (NaN included): the
engine checks them. The argument, ``reward:NAME`` or ``environment:NAME``, is imported
before the worker answers ready: an import is start-up, not a bounded call. ``--list``
prints the installed plug-ins (discovery.py) and exits. Free of torch and of the
engine's state: a hang here is ended by killing this process.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

from loraplex_engine.environments.base import Environment, ParamError, Step
from loraplex_engine.plugins import discovery

_loaded: dict[tuple[str, str], object] = {}


def load(group: str, name: str) -> object:
    """An entry point's object, imported once (at start-up: see ``main``)."""
    key = (group, name)
    if key not in _loaded:
        _loaded[key] = discovery.load_entry_point(group, name)
    return _loaded[key]


def preload(kind: str, name: str) -> None:
    """Import the plug-in before answering ready: its import is start-up, not a call."""
    if kind == "reward":
        load(discovery.REWARD_GROUP, name)
    elif name.startswith(discovery.VERIFIERS_PREFIX):
        # verifiers and the taskset's module, imported (the environment is loaded with
        # its params at the first episode's start)
        from loraplex_engine.environments.verifiers_env import import_taskset

        import_taskset(name.removeprefix(discovery.VERIFIERS_PREFIX))
    elif name in discovery.entry_point_names(discovery.ENVIRONMENT_GROUP):
        load(discovery.ENVIRONMENT_GROUP, name)
    else:
        import skyrl_gym

        if name not in skyrl_gym.registry:
            raise KeyError(f"no skyrl-gym environment {name!r}")


def _reward(req: dict[str, Any], _state: dict[Any, Environment]) -> dict[str, Any]:
    fn = load(discovery.REWARD_GROUP, req["name"])
    if not callable(fn):
        raise TypeError(f"entry point {req['name']!r} is not callable")
    # TRL's convention: prompts and completions by name, each dataset column by name.
    scores = fn(prompts=req["prompts"], completions=req["completions"], **req["columns"])
    if not isinstance(scores, list | tuple):
        raise TypeError(f"returned a {type(scores).__name__}, not a list")
    return {"scores": [_number(s) for s in scores]}


def _number(value: Any) -> Any:
    """A score as JSON carries it: None, a bool or a number as is (the engine says what is
    wrong), anything else by its type's name."""
    if value is None or isinstance(value, bool | int | float):
        return float(value) if isinstance(value, int) and not isinstance(value, bool) else value
    try:  # numpy and torch scalars
        return float(value)
    except (TypeError, ValueError):
        return {"type": type(value).__name__}


def _make_env(name: str, prompt: str, answer: str, params: dict, max_turns: int) -> Environment:
    from loraplex_engine.environments.skyrl import SkyRLEnvironment, is_skyrl_env

    if name.startswith(discovery.VERIFIERS_PREFIX):
        from loraplex_engine.environments.verifiers_env import VerifiersEnvironment

        return VerifiersEnvironment(name, prompt, answer, params, max_turns)
    if name in discovery.entry_point_names(discovery.ENVIRONMENT_GROUP):
        obj = load(discovery.ENVIRONMENT_GROUP, name)
        if isinstance(obj, type) and issubclass(obj, Environment):
            return obj(prompt, answer, params, max_turns)
        if is_skyrl_env(obj):
            assert isinstance(obj, type)
            return SkyRLEnvironment(obj, prompt, answer, params, max_turns)
        raise TypeError(f"entry point {name!r} is neither an Environment nor a BaseTextEnv")
    return SkyRLEnvironment(name, prompt, answer, params, max_turns)


def _env_check(req: dict[str, Any], _state: dict[Any, Environment]) -> dict[str, Any]:
    """The environment's verdict on the spec's params, at PUT: its ``check_params``, or
    for a skyrl-gym environment (which checks in its constructor) one built and closed.
    A refusal is an answer (``problem``), not a failure of the call."""
    name, params = req["name"], req["params"]
    try:
        if name in discovery.entry_point_names(discovery.ENVIRONMENT_GROUP):
            obj = load(discovery.ENVIRONMENT_GROUP, name)
            if isinstance(obj, type) and issubclass(obj, Environment):
                obj.check_params(params)
                return {"problem": None}
        _make_env(name, "", "", params, req["maxTurns"]).close()
    except ParamError as e:
        return {"problem": {"param": e.param, "message": _line(e)}}
    except ImportError as e:  # not the params: the image lacks what it needs
        return {"problem": {"load": True, "message": f"{type(e).__name__}: {_line(e)}"}}
    except Exception as e:  # a constructor's assert or KeyError: a param it lacks
        return {"problem": {"param": None, "message": f"{type(e).__name__}: {_line(e)}"}}
    return {"problem": None}


def _line(e: Exception) -> str:
    return " ".join(str(e).split())[:500] or "(no message)"


def _env_open(req: dict[str, Any], state: dict[Any, Environment]) -> dict[str, Any]:
    _env_close({"ids": req.get("close", [])}, state)  # the last step's, ended since
    starts = []
    for ep in req["episodes"]:
        env = _make_env(req["name"], ep["prompt"], ep["answer"], req["params"], req["maxTurns"])
        state[ep["id"]] = env
        start = env.start()
        if not isinstance(start, str):
            raise TypeError(f"start() returned a {type(start).__name__}, not a str")
        starts.append(start)
    return {"starts": starts}


def _env_step(req: dict[str, Any], state: dict[Any, Environment]) -> dict[str, Any]:
    out = []
    for ep_id, action in req["steps"]:
        step = state[ep_id].step(action)
        if not isinstance(step, Step):
            raise TypeError(f"step() returned a {type(step).__name__}, not a Step")
        if not isinstance(step.observation, str):
            raise TypeError("step().observation is not a str")
        chat = [list(m) for m in step.chat()]
        out.append([step.observation, _number(step.reward), bool(step.done), step.tool_calls, chat])
    return {"steps": out}


def _env_close(req: dict[str, Any], state: dict[Any, Environment]) -> dict[str, Any]:
    problems = []
    for ep_id in req["ids"]:
        env = state.pop(ep_id, None)
        try:
            if env is not None:
                env.close()
        except Exception as e:  # an episode that fails to close fails nothing else
            problems.append(f"{type(e).__name__}: {e}")
    return {"problems": problems[:3]}


OPS: dict[str, Callable[[dict[str, Any], dict[Any, Environment]], dict[str, Any]]] = {
    "reward": _reward,
    "env_check": _env_check,
    "env_open": _env_open,
    "env_step": _env_step,
    "env_close": _env_close,
}


def serve(proto: Any, kind: str, name: str) -> None:
    state: dict[Any, Environment] = {}
    try:
        preload(kind, name)
        ready: dict[str, Any] = {"ok": True, "ready": True}
    except Exception as e:  # reported by the first call: its experiment fails with it
        ready = {"ok": False, "error": f"{type(e).__name__}: {' '.join(str(e).split())}"}
    proto.write(json.dumps(ready) + "\n")
    proto.flush()
    for line in sys.stdin:
        req = json.loads(line)
        try:
            answer = {"ok": True, **OPS[req["op"]](req, state)}
        except Exception as e:  # the plug-in's failure is its experiment's, reported
            answer = {"ok": False, "error": f"{type(e).__name__}: {' '.join(str(e).split())}"}
        proto.write(json.dumps(answer) + "\n")
        proto.flush()


def main() -> None:
    # The protocol keeps the original stdout; print() in plug-in code goes to stderr.
    proto = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    if "--list" in sys.argv:
        found = discovery.list_here()
        proto.write(json.dumps({**found.to_json(), "problems": list(found.problems)}) + "\n")
        proto.flush()
        return
    kind, _, name = sys.argv[1].partition(":")  # reward:NAME or environment:NAME
    serve(proto, kind, name)


if __name__ == "__main__":
    main()
