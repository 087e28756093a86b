"""Which modules a client experiment's module kinds train, and which of them its pool
does not allow (pure; issue 29 item 3, docs/design/gateway.md).

A client experiment (``spec.client``, what the gateway creates for the Tinker SDK's
``create_model``) asks for module kinds, not names: ``trainAttn``, ``trainMlp``,
``trainUnembed``. What a kind trains is the engine's: the modules it wraps (its
``/v1/capacity`` ``targetModules``) of that kind, as ``ClientModels.lora_config`` picks
them (the sets below are that module's; a test ties them). The pool's
``allowedTargetModules`` must allow every one of them, as it must allow every
``spec.lora.targetModules`` name of a task experiment (the gateway turns ``trainUnembed``
off where the pool allows no ``lm_head``: ``granted``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

ATTENTION = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "query_key_value"})
MLP = frozenset({"gate_proj", "up_proj", "down_proj", "gate_up_proj", "fc1", "fc2"})
UNEMBED = frozenset({"lm_head"})
# (spec.client field, the SDK's lora_config field, the kind's module names)
KINDS = (
    ("trainAttn", "train_attn", ATTENTION),
    ("trainMlp", "train_mlp", MLP),
    ("trainUnembed", "train_unembed", UNEMBED),
)


def granted(client: Mapping[str, Any], allowed: Sequence[str]) -> dict[str, Any]:
    """What the gateway writes for a create_model's kinds on a pool: ``trainUnembed`` off
    where the pool allows no ``lm_head``. The SDK asks for it by default (every
    ``LoraConfig`` does), and the engine grants it off where the head cannot be adapted
    (get_info says so); refusing it would refuse the SDK's default on every pool that
    keeps the default allowlist. Attention and MLP are refused, not narrowed."""
    out = dict(client)
    if not UNEMBED & set(allowed):
        out["trainUnembed"] = False
    return out


def refused(
    asked: Mapping[str, Any], wrapped: Iterable[str], allowed: Sequence[str]
) -> list[tuple[str, str, list[str]]]:
    """The kinds ``asked`` (spec.client's fields; absent = true) that would train a module
    ``allowed`` lacks: (spec field, SDK field, those modules), for the error to name."""
    known = frozenset(wrapped)
    out = []
    for field, wire, names in KINDS:
        if asked.get(field, True) is not False:
            extra = sorted((known & names) - set(allowed))
            if extra:
                out.append((field, wire, extra))
    return out


def message(pool: str, extra: Sequence[str], allowed: Sequence[str], field: str) -> str:
    return (
        f"would train {', '.join(extra)}, which EnginePool {pool!r} does not allow "
        f"(allowed: {', '.join(allowed)}); set {field} false"
    )
