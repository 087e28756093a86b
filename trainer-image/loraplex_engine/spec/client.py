"""``spec.client``: a LoRAExperiment its client trains (issue 29 item 3).

The gateway creates one for each Tinker ``create_model``: no task, no rollouts, no
reward; the client sends every forward_backward and optim_step itself, and the operator
places, prioritises, suspends, preempts and recovers it like any experiment
(docs/design/gateway.md, "Tinker models as experiments"). The rank is ``spec.lora.rank``;
the module kinds are the SDK's ``LoraConfig`` switches, so ``spec.lora.targetModules``
stays unset.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from loraplex_engine.spec.schema import CelRule, Int32, Int64, SpecModel, immutable

# The SDK's spelling, as the Tinker protocol hands it out (server/tinker/state.py):
# <session>:train:<model_seq_id>, a session being "s" + 20 hex digits.
MODEL_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}:train:[0-9]{1,10}$"
ModelId = Annotated[str, Field(min_length=1, max_length=80, pattern=MODEL_ID_PATTERN)]
IDLE_DEFAULT_S = 3600
IDLE_MAX_S = 30 * 24 * 3600

# spec-level rules (ExperimentSpec.CEL_RULES): one of task and client, and a client's
# modules chosen by kind.
ONE_OF_TASK_CLIENT = CelRule(
    "has(self.task) != has(self.client)",
    "set exactly one of spec.task (the engine trains it on the task's prompts) and "
    "spec.client (its Tinker client trains it)",
    "task",
    lambda spec: (spec.task is None) != (spec.client is None),
)
# A transition rule (the API server runs it on updates only; pydantic sees no old object):
# spec.task's and spec.client's own immutability rules are skipped where the old or the
# new object lacks the block, so this one keeps an experiment's kind.
ONE_KIND_FOR_LIFE = CelRule(
    "has(self.client) == has(oldSelf.client)",
    "a LoRAExperiment is trained by its task or by its client for life: create a new "
    "LoRAExperiment to change which",
    "client",
    lambda spec: True,
)
CLIENT_MODULES_BY_KIND = CelRule(
    "!has(self.client) || !has(self.lora) || !has(self.lora.targetModules)",
    "a client experiment chooses its modules by kind (spec.client.trainAttn, trainMlp, "
    "trainUnembed): leave spec.lora.targetModules unset",
    "lora.targetModules",
    lambda spec: spec.client is None or spec.lora.target_modules is None,
)


CLIENT_RULES = (ONE_OF_TASK_CLIENT, ONE_KIND_FOR_LIFE, CLIENT_MODULES_BY_KIND)


def client_field() -> Any:
    """``ExperimentSpec.client``: optional, immutable once created."""
    return Field(
        None,
        description="Set instead of spec.task: a model its Tinker client trains (the gateway "
        "creates these for create_model; docs/design/gateway.md). Immutable.",
        json_schema_extra=immutable(
            "spec.client is immutable once created (the model's identity and adapter "
            "shape): create a new LoRAExperiment to change it"
        ),
    )


class ClientSpec(SpecModel):
    """A model trained by its client through the Tinker API (the gateway writes this)."""

    model_id: ModelId = Field(
        alias="modelId",
        description="The Tinker model id the client uses (<session>:train:<n>).",
    )
    seed: Int64 | None = Field(
        None, description="Seed of the adapter's initial weights (the SDK's lora_config.seed)."
    )
    train_attn: bool = Field(True, alias="trainAttn", description="LoRA on attention.")
    train_mlp: bool = Field(True, alias="trainMlp", description="LoRA on the MLP.")
    train_unembed: bool = Field(True, alias="trainUnembed", description="LoRA on lm_head.")
    idle_seconds: Int32 = Field(
        IDLE_DEFAULT_S,
        ge=0,
        le=IDLE_MAX_S,
        alias="idleSeconds",
        description="A model no call has named for this long is suspended (spec.suspend "
        "with the loraplex.dev/idle-suspended annotation: checkpointed, its slot freed) and "
        "resumes on its next call through the gateway; 0 = never.",
    )
