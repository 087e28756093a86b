"""The statuses the operator writes, as typed objects (KubeRay's typed status):
``EnginePool.status`` (built by ``status.pool_status``) and ``LoRAExperiment.status``
(built by ``status.derive_status``). The publisher patches their JSON, and
``scripts/gen_crds.py`` generates each CRD's status schema from them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from loraplex_operator.api.condition import Condition, conditions_field, find
from loraplex_operator.api.plugins import PluginGrant
from loraplex_operator.api.schema import ApiModel, DateTime, Int32, Int64

# A publish request's token: loraplex_engine/spec/publish.py TOKEN_PATTERN (a test ties
# them; the operator image does not carry the engine).
TOKEN_PATTERN = r"^[A-Za-z0-9]([-._A-Za-z0-9]{0,61}[A-Za-z0-9])?$"
GATE_NOTE_MAX = 256  # the engine's gateNote, cut to this in the status
ALIASES_MAX = 40  # status.aliases: the spec's 32 set by hand, latest, stable and room
SCORES_MAX = 8  # score names per version (the engine has three)

# --- EnginePool ------------------------------------------------------------------------


class InstalledPlugins(ApiModel):
    """Plug-ins installed in the pool's engine image (docs/plugins.md)."""

    rewards: tuple[str, ...] | None = Field(
        None, description="Reward plug-ins: names a LoRAExperiment's task.reward may use."
    )
    environments: tuple[str, ...] | None = Field(
        None,
        description="Environments (entry points, then skyrl-gym ids): names "
        "task.environment.name may use.",
    )
    allowed: tuple[PluginGrant, ...] | None = Field(
        None,
        description="The plug-in allowlist the engines enforce (spec.plugins.allowed, as a "
        "ready engine reports it): a namespace may name only the plug-ins of the grants "
        "that list it or list no namespaces. Absent: every namespace may name every "
        "installed plug-in.",
    )


class EnginePoolStatus(ApiModel):
    """Observed state, written by the operator once per reconcile round."""

    observed_generation: Int64 | None = Field(
        None,
        alias="observedGeneration",
        description="The metadata.generation this status was computed from.",
    )
    engines: Int32 | None = Field(
        None,
        ge=0,
        description="Engine pods of the pool that count (neither failed nor being deleted).",
    )
    ready: Int32 | None = Field(
        None,
        ge=0,
        description="Of those, the ones that are ready and answering (model loaded).",
    )
    slots_used: Int32 | None = Field(
        None,
        alias="slotsUsed",
        ge=0,
        description="Adapter slots in use over the ready engines.",
    )
    slots_free: Int32 | None = Field(
        None,
        alias="slotsFree",
        ge=0,
        description="Adapter slots free over the ready engines.",
    )
    registered_used: Int32 | None = Field(
        None,
        alias="registeredUsed",
        ge=0,
        description="Adapters registered over the ready engines, resident in slots or paged "
        "out to host memory (an engine that does not page counts its slots).",
    )
    registered_free: Int32 | None = Field(
        None,
        alias="registeredFree",
        ge=0,
        description="Adapters the ready engines may still register (each engine's "
        "maxRegistered, else its slots): what placement packs by.",
    )
    paged_adapters: Int32 | None = Field(
        None,
        alias="pagedAdapters",
        ge=0,
        description="Of the registered adapters, those paged out of their slots now (in "
        "host memory or spilled to the checkpoint volume).",
    )
    spilled_adapters: Int32 | None = Field(
        None,
        alias="spilledAdapters",
        ge=0,
        description="Of the paged adapters, those written to the checkpoint volume past "
        "hostAdapterMemoryBytes.",
    )
    paged_host_bytes: Int64 | None = Field(
        None,
        alias="pagedHostBytes",
        ge=0,
        description="Host memory the paged-out adapters take over the ready engines.",
    )
    plugins: InstalledPlugins | None = Field(
        None,
        description="Plug-ins the pool's engines have installed, as a ready engine reports "
        "them (GET /v1/capacity); absent while none is ready.",
    )
    conditions: tuple[Condition, ...] | None = conditions_field(
        "metav1.Condition list, one per type. Ready: True when the pool is neither "
        "Reconciling nor Stalled (some engine ready, or none wanted). Reconciling: True while "
        "engine pods are asked for but not ready (starting, gated, unschedulable) or fewer "
        "than replicas.min are ready. Stalled: True when the token Secret is missing. "
        "CapacityPending: True while engine pods have no node yet, reason WaitingForAdmission "
        "(a scheduling gate, e.g. Kueue) or Unschedulable, the message naming the pods. "
        "StorageFull: True (reason CheckpointVolumeFull) while engines' checkpoints wait for "
        "room on a full checkpoint volume (deferred, retried every tick; training goes on), "
        "the message naming the engine pods and the engines' reason."
    )

    def condition(self, type_: str) -> Condition | None:
        return find(self.conditions, type_)


# --- LoRAExperiment --------------------------------------------------------------------

ExperimentPhase = Literal["Pending", "Scheduled", "Running", "Suspended", "Succeeded", "Failed"]


class CheckpointStatus(ApiModel):
    """The newest checkpoint the operator has seen; a recovery or resume starts from it
    (or from a newer one of the same run)."""

    path: str | None = Field(
        None,
        description="Checkpoint directory in the pool's checkpoint volume "
        "(<root>/<namespace>/<name>/<uid>/step-NNNNNNNN).",
    )
    step: Int64 | None = Field(None, description="Optimiser step the checkpoint was written at.")


class VersionStatus(ApiModel):
    """A published version of the adapter (docs/versions.md), as its engine reports it."""

    version: str = Field(
        pattern=r"^v[1-9][0-9]{0,8}$", description="Its name: served as <namespace>.<name>@v<N>."
    )
    step: Int64 | None = Field(None, description="The optimiser step it was published at.")
    scores: dict[str, float] | None = Field(
        None,
        max_length=SCORES_MAX,
        description="Its scores: meanReward = the mean training reward over the steps since "
        "the version before it; evalReward, evalPassAtK = spec.eval's, of the eval at "
        "evalStep.",
    )
    eval_step: Int64 | None = Field(
        None,
        alias="evalStep",
        ge=0,
        description="The step of the adapter the eval in its scores scored (absent: no eval yet).",
    )
    gate_passed: bool | None = Field(
        None,
        alias="gatePassed",
        description="Whether it passed spec.publish.promoteWhen (absent: no gate). A version "
        "that failed never becomes stable.",
    )
    gate_note: str | None = Field(
        None,
        alias="gateNote",
        max_length=GATE_NOTE_MAX,
        description="Why it failed its gate (e.g. evalReward 0.41 < promoteWhen.atLeast 0.8).",
    )
    request_token: str | None = Field(
        None,
        alias="requestToken",
        max_length=63,
        pattern=TOKEN_PATTERN,
        description="The spec.publish.requestToken it answered (absent: another trigger).",
    )
    created_at: DateTime | None = Field(None, alias="createdAt", description="When.")


class ExperimentStatus(ApiModel):
    """Observed state, written by the operator only (status subresource): where the
    experiment runs and how far it got, copied from its engine every round."""

    # Written as a JSON merge patch (`to_patch`): a field never set is left as the API
    # server has it, a field set to None is deleted (a stale engine and node).

    phase: ExperimentPhase | None = Field(
        None,
        description="Pending (not placed: waiting for admission or room), Scheduled (bound to "
        "an engine that does not report it yet), Running, Suspended (spec.suspend, "
        "checkpointed and unloaded), Succeeded (reached maxSteps) or Failed (the engine "
        "failed it, or it ran out of restarts). Succeeded and Failed are final.",
    )
    conditions: tuple[Condition, ...] | None = conditions_field(
        "metav1.Condition list, one per type. For generic tools (kstatus, `kubectl wait "
        "--for=condition=Ready`, Argo CD, Flux): Ready (True while it trains, phase Running, "
        "and once Succeeded), Reconciling (True while Pending or Scheduled for a reason that "
        "passes, e.g. WaitingForEngine, WaitingForAdmission), Stalled (True when Failed, or "
        "Pending for a reason that needs a human: AdmissionFailed, Unschedulable). Per phase: "
        "Admitted (the pool accepts the spec; False names the field), Scheduled, Running, "
        "Suspended, Succeeded, Failed. The reason of the condition matching the phase says "
        "why."
    )
    observed_generation: Int64 | None = Field(
        None,
        alias="observedGeneration",
        description="The metadata.generation this status was computed from.",
    )
    engine: str | None = Field(
        None,
        description="Engine pod running the experiment (absent while pending or suspended).",
    )
    node: str | None = Field(None, description="Node of that engine pod.")
    step: Int64 | None = Field(
        None, description="Optimiser steps done so far (of spec.algorithm.maxSteps)."
    )
    progress: str | None = Field(
        None,
        description="Steps done of spec.algorithm.maxSteps, for `kubectl get lx`: 12/50 (a "
        "continual experiment, maxSteps 0: 12/-).",
    )
    reward: float | None = Field(None, description="Mean reward of the last step's completions.")
    # spec.eval's latest result, as the engine reports it (docs/evaluation.md).
    eval_step: Int64 | None = Field(
        None,
        alias="evalStep",
        description="spec.eval: the step of the adapter the latest eval scored (0: before "
        "training; maxSteps: the final adapter).",
    )
    eval_reward: float | None = Field(
        None,
        alias="evalReward",
        description="spec.eval: mean reward of the latest eval's completions (of the adapter "
        "at evalStep).",
    )
    eval_pass_at_k: float | None = Field(
        None,
        alias="evalPassAtK",
        description="spec.eval: pass@k (k = spec.eval.passAtK) of the latest eval: the share "
        "of eval prompts with a passing completion among k, estimated without bias.",
    )
    checkpoint: CheckpointStatus | None = Field(
        None,
        description="The newest checkpoint the operator has seen; a recovery or resume "
        "starts from it (or from a newer one of the same run).",
    )
    adapter_path: str | None = Field(
        None,
        alias="adapterPath",
        description="Directory of the newest adapter: its newest checkpoint, a PEFT directory "
        "that PeftModel.from_pretrained and vLLM load.",
    )
    restarts: Int32 | None = Field(
        None,
        ge=0,
        description="Times the experiment was recovered on another engine after losing its "
        "own; above the operator's budget (LORAPLEX_MAX_RESTARTS, 3) it fails.",
    )
    started_at: DateTime | None = Field(
        None, alias="startedAt", description="When the experiment first ran."
    )
    completed_at: DateTime | None = Field(
        None, alias="completedAt", description="When it reached Succeeded or Failed."
    )
    versions: tuple[VersionStatus, ...] | None = Field(
        None,
        max_length=10,
        description="The most recent published versions, newest last (spec.publish).",
    )
    aliases: dict[str, str] | None = Field(
        None,
        max_length=ALIASES_MAX,
        description="Where each alias points (alias -> version): latest (the newest), stable "
        "(the gate's, or spec.publish.aliases'), and those spec.publish.aliases sets. "
        "Served as <namespace>.<name>:<alias>.",
    )
    publish_request_token: str | None = Field(
        None,
        alias="publishRequestToken",
        max_length=63,
        pattern=TOKEN_PATTERN,
        description="The last spec.publish.requestToken a version answered: a GitOps edit of "
        "the token landed once this equals it.",
    )
    message: str | None = Field(
        None,
        description='What the phase means right now, for people (e.g. "bound to '
        'pool-a-engine-x2k9q").',
    )

    def condition(self, type_: str) -> Condition | None:
        return find(self.conditions, type_)

    def to_patch(self) -> dict[str, Any]:
        """The JSON merge patch that writes this status: its values, and a null for each
        field set to None, which the API server deletes. Only top-level nulls: one inside
        a condition would replace the list with an invalid entry, not delete a key."""
        cleared = {
            type(self).model_fields[name].alias or name: None
            for name in sorted(self.model_fields_set)
            if getattr(self, name) is None
        }
        return {**self.to_json(), **cleared}


__all__ = [
    "CheckpointStatus",
    "EnginePoolStatus",
    "ExperimentPhase",
    "ExperimentStatus",
    "VersionStatus",
]
