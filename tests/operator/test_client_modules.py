"""client_modules.py: which modules a client experiment's kinds train (the engine's own
choice, mirrored), and which of them a pool's allowedTargetModules refuses."""

from __future__ import annotations

from loraplex_engine.plan import client as engine_clients
from loraplex_operator import client_modules as cm

WRAPPED = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_the_kinds_are_the_engines() -> None:
    assert (cm.ATTENTION, cm.MLP, cm.UNEMBED) == (
        engine_clients.ATTENTION,
        engine_clients.MLP,
        engine_clients.UNEMBED,
    )


def test_refused_names_each_kind_and_its_modules() -> None:
    allowed = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]
    assert cm.refused({}, WRAPPED, allowed) == [("trainAttn", "train_attn", ["k_proj", "o_proj"])]
    assert cm.refused({"trainAttn": False}, WRAPPED, allowed) == []
    assert cm.refused({}, WRAPPED, WRAPPED) == []
    assert cm.refused({}, [*WRAPPED, "lm_head"], WRAPPED) == [
        ("trainUnembed", "train_unembed", ["lm_head"])
    ]
    assert cm.refused({}, [], []) == []  # nothing wrapped, nothing trained
    text = cm.message("pool-a", ["k_proj"], allowed, "lora_config.train_attn")
    assert "'pool-a'" in text and "k_proj" in text and "lora_config.train_attn false" in text


def test_unembed_is_granted_off_where_the_pool_allows_no_lm_head() -> None:
    """The SDK asks train_unembed by default: the gateway writes it off on a pool whose
    allowlist has no lm_head (the default), instead of refusing every default model."""
    asked = {"modelId": "m", "trainAttn": True, "trainMlp": True, "trainUnembed": True}
    written = cm.granted(asked, WRAPPED)
    assert written == {**asked, "trainUnembed": False}
    assert cm.refused(written, [*WRAPPED, "lm_head"], WRAPPED) == []
    assert cm.granted(asked, [*WRAPPED, "lm_head"]) == asked
