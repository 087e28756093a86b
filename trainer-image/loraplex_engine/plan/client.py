"""A client model's adapter (Tinker's ``lora_config``: a rank and which module kinds
train) as this engine grants it: checked against its limits (plan/limits.py), the same
whether a Tinker client creates the model or a ``spec.client`` experiment does."""

from __future__ import annotations

from loraplex_engine.lora.config import LoRAConfig
from loraplex_engine.plan.limits import EngineLimits
from loraplex_engine.spec.errors import InvalidRequestError
from loraplex_engine.spec.training_service import ClientLora

# Tinker's LoRA scale is alpha / rank with a fixed alpha (the client chooses the rank).
LORA_ALPHA = 32.0
ATTENTION = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "query_key_value"})
MLP = frozenset({"gate_proj", "up_proj", "down_proj", "gate_up_proj", "fc1", "fc2"})
UNEMBED = frozenset({"lm_head"})


def client_lora_config(lora: ClientLora, limits: EngineLimits) -> tuple[LoRAConfig, ClientLora]:
    """The adapter ``lora`` asks for on this model, and ``lora`` as granted
    (``train_unembed`` off where the head is tied to the embeddings: not adaptable); an
    InvalidRequestError naming the ``lora_config`` field otherwise."""
    problem = limits.rank_problem(lora.rank)
    if problem is not None:
        raise InvalidRequestError(problem, field="lora_config.rank")
    known = limits.target_modules or frozenset()
    unembed = bool(known & UNEMBED) and lora.train_unembed
    targets = (known & ATTENTION if lora.train_attn else set()) | (
        known & MLP if lora.train_mlp else set()
    )
    targets |= known & UNEMBED if unembed else set()
    if not targets:
        raise InvalidRequestError(
            "no module to train: turn on train_attn, train_mlp or train_unembed",
            field="lora_config",
        )
    granted = ClientLora(lora.rank, lora.seed, lora.train_attn, lora.train_mlp, unembed)
    return LoRAConfig(lora.rank, LORA_ALPHA, 0.0, tuple(sorted(targets))), granted
