"""Everything the command line does with a settings class, generated from its fields.

- :func:`add_flags`: its argparse flags, each help ending in its default, each default
  read from the flag's ``LORAPLEX_*`` variable where the command reads them;
- :func:`from_namespace`: argparse's answer as the typed settings;
- :func:`to_argv`: the settings back as a command line (``serve ...``, ``run ...``), which a
  worker rank is started with and parses to equal settings (as skyrl-tx's EngineConfig
  re-serialises itself for its workers);
- :func:`env_rows`: every variable the command reads, for its ``--help``.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from loraplex_engine.settings import values as v
from loraplex_engine.settings.values import EnvValue, Flag
from loraplex_engine.spec.errors import UsageError

S = TypeVar("S", bound=BaseModel)


class DefaultsFormatter(argparse.RawDescriptionHelpFormatter):
    """Every option's help ends in its default (unless it says it already); the
    description and epilog keep their lines (the variables' table)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, [], argparse.SUPPRESS):
            return text
        if not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def flags_of(cls: type[BaseModel]) -> Iterator[tuple[str, FieldInfo, Flag]]:
    """The fields the command offers as flags, in declaration order, with their Flag."""
    skip = getattr(cls, "NOT_FLAGS", frozenset())
    for name, info in cls.model_fields.items():
        flag = next((m for m in info.metadata if isinstance(m, Flag)), None)
        if flag is None:
            raise TypeError(f"{cls.__name__}.{name} has no Flag: every setting needs one")
        if name not in skip:
            yield name, info, flag


def owner(cls: type[BaseModel], name: str) -> type[BaseModel]:
    """The class in ``cls``'s hierarchy that declares field ``name`` (its help group)."""
    return next(c for c in reversed(cls.__mro__) if name in getattr(c, "__annotations__", {}))


def default_text(info: FieldInfo, flag: Flag) -> str | None:
    """What the help shows as the default; None for a required setting."""
    if flag.default_text is not None:
        return flag.default_text
    if info.is_required():
        return None
    default = info.get_default(call_default_factory=True)
    if isinstance(default, bool):
        return "on" if default else "off"
    return str(default)


def help_text(info: FieldInfo, flag: Flag) -> str:
    shown = default_text(info, flag)
    return flag.help if shown is None else f"{flag.help} (default: {shown})"


class _AppendOver(argparse.Action):
    """A repeatable flag whose first use replaces the default (the variable's list)
    instead of appending to it: a flag given on the command line wins."""

    def __call__(self, parser: Any, ns: argparse.Namespace, value: Any, option: Any = None) -> None:
        current = getattr(ns, self.dest, None)
        items = [] if current is self.default or current is None else list(current)
        setattr(ns, self.dest, [*items, value])


def add_flags(parser: argparse.ArgumentParser, cls: type[BaseModel]) -> None:
    """``cls``'s flags on ``parser``, grouped by the class that declares them."""
    env = bool(getattr(cls, "ENV", False))
    groups: dict[type, Any] = {}
    for name, info, flag in flags_of(cls):
        home = owner(cls, name)
        if home not in groups:
            groups[home] = parser.add_argument_group(f"{getattr(home, 'GROUP', 'other')} settings")
        group = groups[home]
        raw = os.environ.get(flag.variable(name)) if env else None
        default = None if info.is_required() else info.get_default(call_default_factory=True)
        kwargs: dict[str, Any] = {"help": help_text(info, flag)}
        if flag.metavar:
            kwargs["metavar"] = flag.metavar
        if flag.positional:
            group.add_argument(name, type=flag.parse, **kwargs)
            continue
        kwargs["dest"] = name
        if flag.action == "switch":
            on = v.truthy(raw) if env else default
            group.add_argument(flag.option(name), action="store_true", default=on, **kwargs)
            continue
        if flag.action == "append":
            listed = flag.env_parse(raw) if raw is not None and flag.env_parse else default
            kwargs.update(action=_AppendOver, default=listed)
        elif flag.action == "merge":  # the variable is merged in from_namespace
            kwargs.update(action="append", default=None)
        else:
            if raw is not None:  # parsed by argparse only if the flag is not given
                default = EnvValue(raw, flag.variable(name)) if flag.parse else raw
            kwargs.update(default=default, required=info.is_required())
            if flag.action == "toggle":
                kwargs["action"] = argparse.BooleanOptionalAction
        group.add_argument(flag.option(name), type=flag.parse, **kwargs)


def from_namespace(cls: type[S], ns: argparse.Namespace) -> S:
    """argparse's answer for ``cls``'s flags as ``cls`` (UsageError if it does not fit)."""
    env = bool(getattr(cls, "ENV", False))
    values: dict[str, Any] = {}
    for name, _, flag in flags_of(cls):
        value = getattr(ns, name)
        if flag.action == "merge":
            base = _env_object(flag.variable(name)) if env else {}
            value = {**base, **dict(value or ())}
        elif flag.action == "append":
            value = tuple(value or ())
        values[name] = value
    try:
        return cls.model_validate(values)
    except ValidationError as e:
        err = e.errors()[0]
        raise UsageError(f"{'.'.join(map(str, err['loc']))}: {err['msg']}") from None


def _env_object(var: str) -> dict[str, Any]:
    raw = os.environ.get(var)
    if not raw:
        return {}
    try:
        return dict(json.loads(raw))
    except (ValueError, TypeError) as e:
        raise UsageError(f"{var} must be a JSON object: {e}") from None


def to_argv(settings: BaseModel) -> list[str]:
    """The command line that parses back to ``settings`` (``COMMAND`` first): every
    setting spelled out, so a worker rank does not depend on what it inherits."""
    cls = type(settings)
    head: list[str] = [cls.COMMAND]  # type: ignore[attr-defined]
    argv: list[str] = []
    for name, _, flag in flags_of(cls):
        value = getattr(settings, name)
        option = flag.option(name)
        if flag.positional:
            head.append(str(value))
        elif value is None:  # unset: the command's own default (auto) is None too
            continue
        elif flag.action == "switch":
            argv += [option] if value else []
        elif flag.action == "toggle":
            argv.append(option if value else f"--no-{option[2:]}")
        elif flag.action == "append":
            argv += [f"{option}={item}" for item in value]
        elif flag.action == "merge":
            argv += [f"{option}={v.unparse_key_value(k, x)}" for k, x in value.items()]
        else:
            argv.append(f"{option}={value}")
    return head + argv


def env_rows(cls: type[BaseModel]) -> list[tuple[str, str]]:
    """(variable, what it sets) for every variable the command reads."""
    rows = [
        (flag.variable(name), flag.env_help or flag.option(name))
        for name, _, flag in flags_of(cls)
        if not flag.positional
    ]
    return rows + list(getattr(cls, "ENV_EXTRA", ()))


def env_epilog(cls: type[BaseModel]) -> str:
    rows = env_rows(cls)
    width = max(len(var) for var, _ in rows)
    lines = [f"  {var:<{width}}  {what}" for var, what in rows]
    return "environment (a flag given on the command line wins):\n" + "\n".join(lines)


def add_command(sub: Any, cls: type[BaseModel], help: str) -> argparse.ArgumentParser:
    """The subcommand of ``cls`` (``cls.COMMAND``), its flags and, where it reads the
    environment, the table of its variables."""
    parser = sub.add_parser(cls.COMMAND, help=help, formatter_class=DefaultsFormatter)  # type: ignore[attr-defined]
    add_flags(parser, cls)
    if getattr(cls, "ENV", False):
        parser.epilog = env_epilog(cls)
    return parser
