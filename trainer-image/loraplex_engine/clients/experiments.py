"""Client experiments: a ``LoRAExperiment`` with ``spec.client`` (issue 29 item 3), placed
by the operator like any experiment and trained by its Tinker client.

``PUT /v1/experiments/<ns>.<name>`` with ``spec.client`` registers a client model
(clients/models.py) under ``spec.client.modelId`` in the experiment's namespace,
resumed from its newest checkpoint when it has one. Its checkpoints are the client
store's ``weights`` states named ``step-<N>`` (``<root>/<ns>/_tinker/<modelId>/weights/
step-<N>/``), written after every ``spec.checkpoint.everySteps``-th optimiser step before
that step's call is answered (``ClientModels.stepped``), ``keep`` of them kept; so an
optimiser step its client saw done survives the pod. ``DELETE`` (suspend, preemption,
deletion) writes one more and frees the slot. The status is an experiment's: phase
Running while loaded, ``step`` its optimiser steps, ``checkpoint`` its newest.

``ClientExperimentAPI`` is the Engine's experiment API over both kinds: a spec with a
task goes to the engine's own (``put_task_experiment``...), one with a client here.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from loraplex_engine.clients import saved
from loraplex_engine.clients.models import ClientModels
from loraplex_engine.plan.experiment import ExperimentPlan, compile_plan
from loraplex_engine.spec.api_types import CheckpointRef, ExperimentStatus
from loraplex_engine.spec.errors import ConflictError, NotFoundError
from loraplex_engine.spec.experiment import ExperimentSpec
from loraplex_engine.spec.service import PromptJob
from loraplex_engine.spec.training_service import Adoption
from loraplex_engine.tenancy.admissions import KeyedLocks

STEP = re.compile(r"^step-([0-9]{8,})$")


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def _now() -> str:
    return datetime.now(UTC).isoformat()


@dataclass
class ClientExperiment:
    id: str
    namespace: str
    name: str
    plan: ExperimentPlan  # its spec compiled against the engine (plan/experiment.py)
    started_at: str
    checkpoint: CheckpointRef | None = None
    phase: str = "Running"
    error: str | None = None
    restored_steps: int = 0  # the optimiser steps of the checkpoint it started from

    @property
    def spec(self) -> ExperimentSpec:
        return self.plan.spec

    @property
    def model_id(self) -> str:
        assert self.plan.client is not None
        return self.plan.client.model_id


class ClientExperiments:
    def __init__(self, clients: ClientModels) -> None:
        self.clients = clients
        self._lock = threading.Lock()
        self._exps: dict[str, ClientExperiment] = {}

    def __contains__(self, exp_id: str) -> bool:
        with self._lock:
            return exp_id in self._exps

    def by_model(self, namespace: str, model_id: str) -> ClientExperiment | None:
        with self._lock:
            return next(
                (
                    e
                    for e in self._exps.values()
                    if e.namespace == namespace and e.model_id == model_id
                ),
                None,
            )

    def newest(self, namespace: str, model_id: str) -> tuple[int, str] | None:
        """The newest ``step-<N>`` checkpoint of a model: (N, its tinker:// path)."""
        found = []
        for s in saved.list_saved(self.clients.host.store.root, namespace, model_id):
            m = STEP.match(s.name)
            if s.kind == "weights" and m:
                found.append((int(m.group(1)), s.path))
        return max(found) if found else None

    def put(
        self, exp_id: str, spec: ExperimentSpec, namespace: str, name: str
    ) -> tuple[ExperimentStatus, bool]:
        plan = compile_plan(spec, self.clients.host.plan_limits)  # rank, modules: plan/
        client, lora = plan.client, plan.client_lora
        assert client is not None and lora is not None
        with self._lock:
            existing = self._exps.get(exp_id)
        if existing is not None:
            if existing.plan.client != client or existing.plan.client_lora != lora:
                raise ConflictError(f"experiment {exp_id!r} is loaded with another spec.client")
            return self.status(exp_id), False
        if self.by_model(namespace, client.model_id) is not None:
            raise ConflictError(f"model {client.model_id!r} belongs to another experiment")
        newest = self.newest(namespace, client.model_id)
        exp = ClientExperiment(exp_id, namespace, name, plan, _now())
        if newest is None:
            self.clients.create_model(namespace, client.model_id, lora)
            steps = 0
        else:
            steps, path = newest
            self.clients.create_model_from_state(namespace, client.model_id, path, True)
            exp.checkpoint = CheckpointRef(path=path, step=steps)
        model = self.clients.loaded(namespace, client.model_id)
        assert model is not None
        model.steps = exp.restored_steps = steps
        model.checkpoints = (plan.checkpoint.every_steps, plan.checkpoint.keep)
        model.on_checkpoint = lambda ref, e=exp: setattr(e, "checkpoint", ref)
        with self._lock:
            self._exps[exp_id] = exp
        return self.status(exp_id), True

    def _require(self, exp_id: str) -> ClientExperiment:
        with self._lock:
            exp = self._exps.get(exp_id)
        if exp is None:
            raise NotFoundError(f"no experiment {exp_id!r} on this engine")
        return exp

    def status(self, exp_id: str) -> ExperimentStatus:
        exp = self._require(exp_id)
        model = self.clients.loaded(exp.namespace, exp.model_id)
        phase, error = exp.phase, exp.error
        if model is None and phase == "Running":  # unloaded by its client on this engine
            phase = "Succeeded"
        ckpt = exp.checkpoint
        return ExperimentStatus(
            id=exp.id,
            namespace=exp.namespace,
            name=exp.name,
            phase=phase,  # type: ignore[arg-type]
            step=model.steps if model is not None else (ckpt.step if ckpt else 0),
            max_steps=0,
            reward=None,
            rollout_tokens=0,
            train_tokens=0,
            checkpoint=ckpt,
            adapter_path=None if ckpt is None else self._directory(exp, ckpt),
            error=error,
            started_at=exp.started_at,
            updated_at=_now(),
            idle_seconds=None if model is None else model.idle_seconds(time.monotonic()),
        )

    def _directory(self, exp: ClientExperiment, ref: CheckpointRef) -> str:
        state = saved.parse_path(ref.path)
        return str(state.directory(self.clients.host.store.root, exp.namespace))

    def statuses(self) -> list[ExperimentStatus]:
        with self._lock:
            ids = list(self._exps)
        return [self.status(i) for i in ids]

    def checkpoint(self, exp_id: str) -> CheckpointRef:
        exp = self._require(exp_id)
        model = self.clients.loaded(exp.namespace, exp.model_id)
        if model is None:
            raise ConflictError(f"experiment {exp_id!r}: its model was unloaded")
        name = step_name(model.steps)
        state = self.clients.save_state(exp.namespace, exp.model_id, name, "weights")
        exp.checkpoint = CheckpointRef(path=state.path, step=model.steps)
        return exp.checkpoint

    def remove(self, exp_id: str) -> ExperimentStatus:
        """Checkpoint (when it moved on since the last), unload, forget. A model its client
        unloaded (unload_model, maybe while this runs) leaves nothing to keep: its journal
        goes too (its saved states stay)."""
        exp = self._require(exp_id)
        model = self.clients.loaded(exp.namespace, exp.model_id)
        try:
            if model is not None:
                if exp.checkpoint is None or exp.checkpoint.step != model.steps:
                    self.checkpoint(exp_id)
                self.clients.unload_model(exp.namespace, exp.model_id, save=False)
        except NotFoundError:  # unloaded by its client meanwhile
            model = None
        status = self.status(exp_id)
        if model is None:
            shutil.rmtree(self.journal_dir(exp.namespace, exp.model_id), ignore_errors=True)
        with self._lock:
            self._exps.pop(exp_id, None)
        return status

    def served(self, job: PromptJob) -> PromptJob:
        """A completion naming a client experiment (``<ns>.<name>``, as /v1/models lists
        it) runs on its client model's adapter as trained so far; any other job as it is."""
        with self._lock:
            exp = self._exps.get(job.model)
        model = self.clients.loaded(exp.namespace, exp.model_id) if exp is not None else None
        if model is None:
            return job
        return dataclasses.replace(job, model=model.name)

    def journal_dir(self, namespace: str, model_id: str) -> Path:
        root = self.clients.host.store.root
        return root / namespace / saved.CLIENT_DIR / model_id / "journal"

    def adoptable(self, namespace: str, model_id: str) -> Adoption | None:
        """A loaded client experiment's model (the Tinker protocol adopts it), None if
        ``model_id`` is none here."""
        exp = self.by_model(namespace, model_id)
        model = self.clients.loaded(namespace, model_id) if exp is not None else None
        if exp is None or model is None:
            return None
        every, journal = exp.plan.checkpoint.every_steps, self.journal_dir(namespace, model_id)
        return Adoption(model.info.lora.rank, exp.restored_steps, every, str(journal))


class ClientExperimentAPI:
    """The Engine's experiment API (EngineService) over task and client experiments."""

    client_experiments: ClientExperiments
    admissions: KeyedLocks
    model_name: str  # the Engine's: its base model, and its task experiments by id
    _experiments: dict[str, Any]

    def put_experiment(
        self,
        exp_id: str,
        spec: ExperimentSpec,
        namespace: str = "default",
        name: str | None = None,
        resume_from: str | None = None,
        run_id: str | None = None,
    ) -> tuple[ExperimentStatus, bool]:
        with self.admissions.hold(exp_id):  # a retried PUT waits for the one in flight
            if spec.client is not None:
                return self.client_experiments.put(exp_id, spec, namespace, name or exp_id)
            if exp_id in self.client_experiments:
                raise ConflictError(f"experiment {exp_id!r} is loaded as a client experiment")
            return self.put_task_experiment(exp_id, spec, namespace, name, resume_from, run_id)

    def get_experiment(self, exp_id: str) -> ExperimentStatus:
        if exp_id in self.client_experiments:
            return self.client_experiments.status(exp_id)
        return self.get_task_experiment(exp_id)

    def list_experiments(self) -> list[ExperimentStatus]:
        return [*self.list_task_experiments(), *self.client_experiments.statuses()]

    def checkpoint_experiment(self, exp_id: str) -> CheckpointRef:
        if exp_id in self.client_experiments:
            return self.client_experiments.checkpoint(exp_id)
        return self.checkpoint_task_experiment(exp_id)

    def remove_experiment(self, exp_id: str) -> ExperimentStatus:
        if exp_id in self.client_experiments:
            return self.client_experiments.remove(exp_id)
        return self.remove_task_experiment(exp_id)

    # The Engine's own (engine.py), for task experiments.
    def put_task_experiment(self, *args: Any) -> tuple[ExperimentStatus, bool]:
        raise NotImplementedError

    def get_task_experiment(self, exp_id: str) -> ExperimentStatus:
        raise NotImplementedError

    def list_task_experiments(self) -> list[ExperimentStatus]:
        raise NotImplementedError

    def checkpoint_task_experiment(self, exp_id: str) -> CheckpointRef:
        raise NotImplementedError

    def remove_task_experiment(self, exp_id: str) -> ExperimentStatus:
        raise NotImplementedError
