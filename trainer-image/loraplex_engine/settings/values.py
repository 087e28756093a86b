"""How one setting meets the command line: its :class:`Flag` metadata and the parsers
of its text (a flag's value, or a ``LORAPLEX_*`` variable's).

A parser raises ``argparse.ArgumentTypeError``, so a bad value is argparse's usage error
(exit 2); a value read from a variable is an :class:`EnvValue`, so the error names the
variable as well.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from loraplex_engine.spec.api_types import DTYPE_NAMES, LORA_KERNELS

ENV_PREFIX = "LORAPLEX_"

# Byte counts (``--device-memory 80GiB``): decimal and binary units.
UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_bytes(text: str) -> int:
    """``80GiB``, ``141GB``, ``1.5e9``: a byte count (ValueError naming the value)."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in UNITS:
        raise ValueError(f"--device-memory: cannot read {text!r} (e.g. 80GiB, 141GB)")
    try:
        return int(float(match.group(1)) * UNITS[unit])
    except ValueError:
        raise ValueError(f"--device-memory: cannot read {text!r} (e.g. 80GiB, 141GB)") from None


# store: --flag VALUE; switch: --flag (store_true); toggle: --flag/--no-flag;
# append: --flag VALUE, repeatable (a variable holds the whole list); merge: as append,
# each item a (key, value) pair laid over the variable's JSON object.
Action = Literal["store", "switch", "toggle", "append", "merge"]


@dataclass(frozen=True)
class Flag:
    """A setting's command-line face, carried in its field's ``Annotated`` metadata."""

    help: str
    parse: Callable[[str], Any] | None = None  # one value's text -> value
    action: Action = "store"
    metavar: str | None = None
    flag: str | None = None  # default: --<field-name>
    env: str | None = None  # default: LORAPLEX_<FLAG>
    env_parse: Callable[[str], Any] | None = None  # append/merge: the variable's text
    env_help: str | None = None  # the variable's row in `serve --help`; default: the flag
    default_text: str | None = None  # shown for the default (needed where it is None)
    positional: bool = False

    def option(self, field: str) -> str:
        return self.flag or "--" + field.replace("_", "-")

    def variable(self, field: str) -> str:
        return self.env or ENV_PREFIX + self.option(field)[2:].replace("-", "_").upper()


class EnvValue(str):
    """A default taken from ``LORAPLEX_<NAME>``, remembering the variable.

    argparse runs a flag's ``type`` over a *string* default only when the flag is not
    given, and only while parsing that subcommand; so a bad value fails ``serve`` alone
    (not every subcommand at parser build time), as a usage error that names it."""

    var: str

    def __new__(cls, value: str, var: str) -> EnvValue:
        obj = super().__new__(cls, value)
        obj.var = var
        return obj


def invalid(what: str, value: str, hint: str = "") -> argparse.ArgumentTypeError:
    where = f" (from {value.var})" if isinstance(value, EnvValue) else ""
    return argparse.ArgumentTypeError(f"invalid {what}: {str(value)!r}{where}{hint}")


def truthy(text: str | None) -> bool:
    """A switch's variable: on for 1, true, yes or on (any case); off otherwise."""
    return str(text or "").strip().lower() in ("1", "true", "yes", "on")


def to_int(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise invalid("int value", value) from None


def positive_int(value: str) -> int:
    number = to_int(value)
    if number < 1:
        raise invalid("value", value, "; must be at least 1")
    return number


def seconds(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not number >= 0:  # also refuses nan
        raise invalid("seconds value", value)
    return number


def _positive_or_none(
    unset: str, parse: Callable[[str], int], what: str, hint: str
) -> Callable[[str], int | None]:
    """A parser of a positive count (``parse``), or ``unset`` (or empty) for None."""

    def parse_value(value: str) -> int | None:
        if str(value).strip().lower() in ("", unset):
            return None
        try:
            number = parse(value)
        except ValueError:
            number = 0
        if number < 1:
            raise invalid(what, value, hint)
        return number

    return parse_value


# None: the memory plan derives it.
tokens_or_auto = _positive_or_none("auto", int, "token count", "; a positive integer, or auto")
# None: no bound.
bytes_or_none = _positive_or_none("none", parse_bytes, "byte count", "; e.g. 50GiB, or none")
bytes_or_auto = _positive_or_none("auto", parse_bytes, "byte count", "; e.g. 80GiB, 141GB, or auto")
# None: every one there is.
count_or_all = _positive_or_none("all", int, "count", "; a positive integer, or all")


def fraction(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not 0.0 <= number < 1.0:
        raise invalid("fraction", value, "; a number in [0, 1)")
    return number


def share(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not 0.0 < number < 1.0:
        raise invalid("share", value, "; a number in (0, 1)")
    return number


DEVICES = "auto, cpu, cuda or cuda:N"


def device(value: str) -> str:
    """auto (or empty), cpu, cuda or cuda:N (distributed.device_for_rank resolves it)."""
    text = str(value).strip().lower() or "auto"
    if text in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", text):
        return text
    raise invalid("device", value, f"; choose {DEVICES}")


def one_of(what: str, names: tuple[str, ...], fold: bool = False) -> Callable[[str], str]:
    """A parser taking one of ``names`` (``fold``: in any case)."""

    def parse(value: str) -> str:
        text = str(value).lower() if fold else str(value)
        if text not in names:
            raise invalid(what, value, f"; choose one of {', '.join(names)}")
        return text

    return parse


dtype = one_of("dtype", DTYPE_NAMES)
lora_kernel = one_of("LoRA kernel", LORA_KERNELS)
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
log_level = one_of("log level", LOG_LEVELS, fold=True)
LOG_FORMATS = ("text", "json")  # loraplex_engine/logs.py
log_format = one_of("log format", LOG_FORMATS, fold=True)


def boolean(value: str) -> bool:
    text = str(value).strip().lower()
    if text not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        raise invalid("boolean", value, "; use true or false")
    return text in ("1", "true", "yes", "on")


def key_value(value: str) -> tuple[str, Any]:
    """``KEY=VALUE``, the value parsed as JSON if it parses, else kept as text."""
    key, sep, text = value.partition("=")
    if not sep or not key:
        raise invalid("KEY=VALUE", value)
    try:
        return key, json.loads(text)
    except ValueError:
        return key, text


def unparse_key_value(key: str, value: Any) -> str:
    """:func:`key_value`'s inverse: JSON always, so the value reads back the same type."""
    return f"{key}={json.dumps(value)}"


def split_on(sep: str) -> Callable[[str], list[str]]:
    """A list variable: items separated by ``sep``, blanks dropped."""
    return lambda text: [item.strip() for item in text.split(sep) if item.strip()]
