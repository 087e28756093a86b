"""Where a run's checkpoints live and which one a resume loads.

Layout: ``<root>/<namespace>/<name>/<run id>/step-NNNNNNNN/``, one directory per run, so a
recreated experiment of the same name writes elsewhere and never overwrites the old run's
checkpoints. Each run keeps its newest ``keep`` checkpoints, and each experiment name its
newest ``keep_runs`` runs: when a run writes, the name's other runs past the newest
``keep_runs - 1`` are removed, oldest first (:func:`runs_to_prune`); the writing run is
never one of them, nor anything outside ``<root>/<namespace>/<name>/``.

Resume policy: the newest intact checkpoint of the run. Given a checkpoint to resume from,
that is the newest one of its run at or after its step (one written after the caller last
looked, e.g. on SIGTERM, is not redone; the requested one may be pruned by then); given
only a run id, the newest one in the run's directory. Broken newer checkpoints are
skipped (and kept). The choice itself is pure
(:func:`resume_order`, :func:`run_order`); :class:`RunStore` tries the candidates in order.

The file format of one checkpoint (PEFT adapter, optimiser and RNG state, atomic writes)
is :mod:`loraplex_engine.store.checkpoint`'s.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import re
import shutil
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from safetensors import SafetensorError

from loraplex_engine.experiment import Experiment
from loraplex_engine.lora.layers import LoRAConfig
from loraplex_engine.lora.model import MultiLoRAModel
from loraplex_engine.spec.api_types import (
    DEFAULT_KEEP_RUNS,
    RUN_ID_MAX_LENGTH,
    RUN_ID_PATTERN,
    CheckpointRef,
)
from loraplex_engine.spec.errors import BadCheckpointError, CheckpointError, StorageFullError
from loraplex_engine.store import checkpoint as ckpt
from loraplex_engine.store.quota import CheckpointQuota, tree_bytes
from loraplex_engine.tenancy.trust import checkpoint_inside
from loraplex_engine.train.optim import PerAdapterAdamW

# Metadata key of the run id: made when an experiment starts fresh, carried over on resume.
RUN_ID = "runId"
# The names the store gives checkpoint directories (temporary ones start with ".").
STEP_DIR = re.compile(r"step-\d{8}")
# What checkpoint.atomic_dir leaves behind when the process dies mid-write.
LEFTOVER_DIR = re.compile(r"\.step-\d{8}\.(tmp|old)-.+")
# A leftover untouched this long is no engine's write in progress (those take seconds).
STALE_LEFTOVER_S = 3600.0
_RUN_ID = re.compile(RUN_ID_PATTERN)

log = logging.getLogger("loraplex_engine.store.run_store")


class RunStore:
    """Writes, prunes and resumes the checkpoints of the experiments on one engine."""

    def __init__(
        self,
        root: Path,
        model: MultiLoRAModel,
        optimizer: PerAdapterAdamW,
        base_model: str,
        quota: CheckpointQuota | None = None,
        keep_runs: int = DEFAULT_KEEP_RUNS,
    ) -> None:
        self.root = root
        self.model = model
        self.optimizer = optimizer
        self.base_model = base_model  # written into adapter_config.json
        self.quota = quota  # None: a namespace's checkpoints are not bounded
        self.keep_runs = keep_runs  # runs kept per experiment name, the writing one included
        self.remove_stale_leftovers()

    def remove_stale_leftovers(self, older_than_s: float = STALE_LEFTOVER_S) -> int:
        """At start-up, the leftovers of runs nobody may hold any more: untouched for
        ``older_than_s`` (a write in progress on another engine is seconds old)."""
        cutoff = time.time() - older_than_s
        found = [
            p
            for p in self.root.glob("*/*/*/.step-*")
            if LEFTOVER_DIR.fullmatch(p.name) and _mtime(p) < cutoff
        ]
        for path in found:
            shutil.rmtree(path, ignore_errors=True)
        if found:
            log.info("removed %d stale half-written checkpoints under %s", len(found), self.root)
        return len(found)

    def remove_leftovers(self, run_dir: Path) -> int:
        """Remove what a crashed writer left in one run directory
        (``.step-N.tmp-*``, ``.step-N.old-*``); returns how many. Only ever a run this
        engine holds: the checkpoint root may be shared by every engine of a pool, and
        another engine's write in progress looks exactly like a crash's leftover."""
        found = [p for p in run_dir.glob(".step-*") if LEFTOVER_DIR.fullmatch(p.name)]
        for path in found:
            shutil.rmtree(path, ignore_errors=True)
        if found:
            log.info("removed %d half-written checkpoint directories in %s", len(found), run_dir)
        return len(found)

    def run_dir(self, namespace: str, name: str, run_id: str) -> Path:
        return self.root / namespace / name / run_id

    def prune_runs(self, exp: Experiment) -> list[Path]:
        """Remove the runs of ``exp``'s name past the newest ``keep_runs``, its own run
        counted first (:func:`runs_to_prune`); returns what was removed. Only run
        directories (a valid run id, no link) of ``<root>/<namespace>/<name>/``."""
        name_dir = self.root / exp.namespace / exp.name
        try:
            entries = list(name_dir.iterdir())
        except OSError:
            return []
        runs = {
            p.name: _mtime(p)
            for p in entries
            if valid_run_id(p.name) and p.is_dir() and not p.is_symlink()
        }
        doomed = [name_dir / r for r in runs_to_prune(runs, exp.run_id, self.keep_runs)]
        for path in doomed:
            shutil.rmtree(path, ignore_errors=True)
        if doomed:
            log.info("%s: removed old runs %s", exp.id, [p.name for p in doomed])
        return doomed

    def save(self, exp: Experiment) -> CheckpointRef:
        """Adapter (PEFT) + trainer state, written atomically into the run's own directory;
        keep its newest K, and the name's newest ``keep_runs`` runs (:meth:`prune_runs`,
        before the write: their room is the write's)."""
        self.prune_runs(exp)
        run_dir = self.run_dir(exp.namespace, exp.name, exp.run_id)
        self.remove_leftovers(run_dir)  # the experiment is bound here: the run is ours
        target = run_dir / f"step-{exp.step:08d}"
        kept = [d for d in step_dirs(run_dir) if d != target]
        pruned = kept[: max(0, len(kept) - (exp.plan.checkpoint.keep - 1))]
        if self.quota is not None:
            writing = tree_bytes(kept[-1]) if kept else self._estimated_bytes(exp.id)
            self.quota.check(self.root, exp.namespace, writing, pruned)
        try:
            with ckpt.atomic_dir(target, overwrite=True) as tmp:
                ckpt.save_adapter(self.model, exp.id, tmp, base_model_name_or_path=self.base_model)
                ckpt.save_trainer_state(
                    tmp, self.optimizer, exp.id, exp.sample_gen, metadata=_metadata(exp)
                )
        except (OSError, SafetensorError) as e:
            if _out_of_space(e):
                why = os.strerror(e.errno) if isinstance(e, OSError) and e.errno else str(e)
                raise StorageFullError(f"the checkpoint volume {self.root} is full ({why})") from e
            raise
        exp.checkpoint = CheckpointRef(path=str(target), step=exp.step)
        exp.adapter_path = str(target)
        for old in step_dirs(run_dir)[: -exp.plan.checkpoint.keep]:
            shutil.rmtree(old, ignore_errors=True)
        return exp.checkpoint

    def _estimated_bytes(self, exp_id: str) -> int:
        """A first checkpoint's size: the adapter and its two Adam moments, fp32."""
        tensors = self.model.adapter_state_dict(exp_id).values()
        return 3 * 4 * sum(t.numel() for t in tensors)

    def resume_from(
        self,
        exp: Experiment,
        config: LoRAConfig,
        requested: Path,
        run_id: str | None,
        alone: bool,
    ) -> None:
        """Resume from the newest intact checkpoint of the requested one's run at or after
        its step; the requested one's own error is the one reported. With ``run_id`` the
        requested checkpoint must belong to that run. ``alone``: no other experiment is
        loaded (see :meth:`_load`). It must lie in the experiment's own directory,
        ``<root>/<namespace>/<name>/`` (resolved): no tenant loads another's adapter."""
        inside = checkpoint_inside(requested, self.root / exp.namespace / exp.name)
        if inside is None:
            raise BadCheckpointError(
                f"resumeFrom {str(requested)!r} is not allowed: it must lie in this "
                f"experiment's checkpoint directory <root>/{exp.namespace}/{exp.name}/",
                field="resumeFrom",
            )
        requested = inside
        try:
            own = Candidate(requested, ckpt.read_metadata(requested))
        except CheckpointError:
            # Loading it reports what is wrong with it; one that is gone may have been
            # pruned after a newer one of its run was written, which the resume then finds.
            own = Candidate(requested, None if requested.exists() else gone_as(requested, run_id))
        own_run = run_of(own.metadata)
        if own.metadata is not None and own_run is None:
            raise BadCheckpointError(
                f"resumeFrom {requested}: its trainer state names no valid {RUN_ID}",
                field="resumeFrom",
            )
        if run_id is not None and own_run not in (None, run_id):
            raise BadCheckpointError(
                f"resumeFrom {requested} belongs to run {own_run!r}, not to runId "
                f"{run_id!r}: name a checkpoint of run {run_id!r}, or leave out "
                "resumeFrom to resume that run's newest checkpoint",
                field="resumeFrom",
            )
        for path in self._resume_candidates(exp, own, own_run):
            try:
                meta = self._load(exp, config, path, alone)
            except CheckpointError as e:
                if path == requested:
                    raise BadCheckpointError(str(e), field="resumeFrom") from e
                log.warning("resume of %s: skipping newer checkpoint %s: %s", exp.id, path, e)
                continue
            exp.run_id = run_of(meta) or exp.run_id
            return

    def _resume_candidates(self, exp: Experiment, own: Candidate, run: str | None) -> list[Path]:
        """Candidates in :func:`resume_order`: the step directories beside the requested
        one and in this experiment's own directory of the run (they differ when the
        requested checkpoint was written under another name or checkpoint root)."""
        step = own.metadata.get("step") if own.metadata else None
        if not isinstance(step, int) or run is None:
            return [own.path]
        dirs = [own.path.parent, self.run_dir(exp.namespace, exp.name, run)]
        seen = {os.path.realpath(own.path)}
        siblings = []
        for path in (p for d in dirs for p in step_dirs(d) if dir_step(p) > step):
            real = os.path.realpath(path)
            if real in seen:
                continue
            seen.add(real)
            try:
                siblings.append(Candidate(path, ckpt.read_metadata(path)))
            except CheckpointError as e:  # may be this run's, but it cannot be told: skip it
                log.warning("resume from %s: skipping newer checkpoint: %s", own.path, e)
        return resume_order(own, siblings)

    def resume_run(self, exp: Experiment, config: LoRAConfig, alone: bool) -> bool:
        """Resume run ``exp.run_id`` from the newest intact checkpoint in its directory;
        False when it has none (a fresh start). A run whose directory holds checkpoints
        none of which loads is refused rather than restarted over them."""
        run_dir = self.run_dir(exp.namespace, exp.name, exp.run_id)
        found = step_dirs(run_dir)
        if not found:
            return False
        candidates = []
        for path in found:
            try:
                candidates.append(Candidate(path, ckpt.read_metadata(path)))
            except CheckpointError as e:
                log.warning("resume of run %s: skipping checkpoint: %s", exp.run_id, e)
        first_error = f"no checkpoint of run {exp.run_id!r} among {[p.name for p in found]}"
        for i, path in enumerate(run_order(exp.run_id, candidates)):
            try:
                self._load(exp, config, path, alone)
                return True
            except CheckpointError as e:
                log.warning("resume of run %s: skipping checkpoint %s: %s", exp.run_id, path, e)
                if i == 0:
                    first_error = str(e)
        raise BadCheckpointError(
            f"runId {exp.run_id!r}: {run_dir} holds checkpoints but none of them loads "
            f"({first_error}); it is not restarted over them",
            field="runId",
        )

    def _load(self, exp: Experiment, config: LoRAConfig, path: Path, alone: bool) -> dict[str, Any]:
        """Load one checkpoint into ``exp`` (returns its metadata); a CheckpointError
        leaves nothing loaded."""
        saved = ckpt.read_adapter_config(path)
        if saved != config:
            raise CheckpointError(f"{path}: checkpoint has {saved}, the spec asks for {config}")
        meta = ckpt.read_metadata(path)
        progress = saved_progress(meta, path)  # validated before anything is loaded
        ckpt.load_adapter(self.model, exp.id, path)
        try:
            # torch's global RNG (dropout masks) is shared by every tenant: restore the
            # saved one only when this experiment will be alone on the engine, so a
            # resume never reshuffles the masks of experiments already training.
            ckpt.load_trainer_state(path, self.optimizer, exp.id, exp.sample_gen, global_rng=alone)
            # Settings (lr, schedule, clipping) from the spec; the step count, and with it
            # the schedule's position, from the checkpoint.
            self.optimizer.configure(exp.id, exp.plan.optimizer)
        except BaseException:
            self._unload(exp.id)  # all or nothing: no half-loaded adapter keeps its slot
            raise
        _restore(exp, progress, path)
        return meta

    def _unload(self, exp_id: str) -> None:
        if self.optimizer.has_adapter(exp_id):
            self.optimizer.remove_adapter(exp_id)
        self.model.remove_adapter(exp_id)


def _out_of_space(e: Exception) -> bool:
    """ENOSPC or EDQUOT, from Python's own writes or from safetensors' (which wraps the
    OS error in its own, numbered the OS's way)."""
    codes = (errno.ENOSPC, errno.EDQUOT)
    if isinstance(e, OSError):
        return e.errno in codes
    return any(f"(os error {code})" in str(e) for code in codes)


def _metadata(exp: Experiment) -> dict[str, Any]:
    """What a checkpoint records of the experiment beside its adapter and optimiser."""
    return {
        "experiment": exp.id,
        RUN_ID: exp.run_id,
        "step": exp.step,
        "reward": exp.reward,
        "rolloutTokens": exp.rollout_tokens,
        "trainTokens": exp.train_tokens,
        "promptRng": _encode_random_state(exp.prompt_rng),
        "spec": exp.spec.model_dump(by_alias=True, mode="json"),
    }


class SavedProgress(BaseModel):
    """The experiment's progress a trainer state records (:func:`_metadata`), validated
    strictly: a checkpoint whose values do not fit is refused before it is loaded."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    step: int = Field(0, ge=0)
    reward: float | None = None
    rollout_tokens: int = Field(0, ge=0, alias="rolloutTokens")
    train_tokens: int = Field(0, ge=0, alias="trainTokens")
    prompt_rng: list[Any] | None = Field(None, alias="promptRng")

    @field_validator("prompt_rng")
    @classmethod
    def _a_random_state(cls, raw: list[Any] | None) -> list[Any] | None:
        if raw is not None:
            try:
                random.Random().setstate(_decode_random_state(raw))
            except (TypeError, ValueError) as e:
                raise ValueError(f"not a random.Random state ({e})") from None
        return raw


def saved_progress(meta: Mapping[str, Any], path: Path) -> SavedProgress:
    """The validated progress in ``meta``; a CheckpointError naming the first bad field."""
    try:
        return SavedProgress.model_validate(meta)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise CheckpointError(
            f"{path / ckpt.TRAINER_STATE}: metadata field {where}: {err['msg']}"
        ) from None


def _restore(exp: Experiment, progress: SavedProgress, path: Path) -> None:
    exp.step = progress.step
    exp.reward = progress.reward
    exp.rollout_tokens = progress.rollout_tokens
    exp.train_tokens = progress.train_tokens
    if progress.prompt_rng is not None:
        exp.prompt_rng.setstate(_decode_random_state(progress.prompt_rng))
    exp.checkpoint = CheckpointRef(path=str(path), step=exp.step)
    exp.adapter_path = str(path)
    if exp.finished_steps and not exp.awaits_final_eval():  # else: its eval-only tick
        exp.phase = "Succeeded"


def _encode_random_state(rng: random.Random) -> list[Any]:
    version, state, gauss = rng.getstate()
    return [version, list(state), gauss]


def _decode_random_state(raw: list[Any]) -> tuple[Any, ...]:
    version, state, gauss = raw
    return (version, tuple(state), gauss)


# ---- which checkpoint to resume from (pure) ----------------------------------------------


def valid_run_id(value: object) -> bool:
    """A run id the store may use as a directory name (1-64 of ``[A-Za-z0-9._-]``, starting
    with a letter or digit: no "/", never "." or "..")."""
    return (
        isinstance(value, str)
        and len(value) <= RUN_ID_MAX_LENGTH
        and _RUN_ID.fullmatch(value) is not None
    )


def run_of(metadata: Mapping[str, Any] | None) -> str | None:
    """The run id a trainer state's metadata names; None when absent or not a valid id."""
    return _run_and_step(metadata)[0]


def step_dirs(directory: Path) -> list[Path]:
    """The checkpoint (``step-NNNNNNNN``) directories in ``directory``, oldest first; none
    when it does not exist. Temporary directories never match."""
    try:
        entries = list(directory.iterdir())
    except OSError:
        return []
    return sorted(p for p in entries if STEP_DIR.fullmatch(p.name) and p.is_dir())


def runs_to_prune(runs: Mapping[str, float], current: str, keep: int) -> list[str]:
    """Which runs of one experiment name to remove, oldest first: ``runs`` maps each run
    id to when its directory last changed (a checkpoint written or pruned in it). The
    ``current`` run (the one writing) is always kept and counts as one of the newest
    ``keep``; of the others the newest ``keep - 1`` are kept (ties: by id)."""
    others = sorted(((t, r) for r, t in runs.items() if r != current), reverse=True)
    return [r for _, r in reversed(others[max(keep - 1, 0) :])]


def dir_step(path: Path) -> int:
    """The step a ``step-NNNNNNNN`` directory is named after."""
    return int(path.name[5:])


@dataclass(frozen=True)
class Candidate:
    """A checkpoint directory and its trainer-state metadata (None: unreadable)."""

    path: Path
    metadata: Mapping[str, Any] | None


def gone_as(requested: Path, run_id: str | None) -> dict[str, Any] | None:
    """What a requested checkpoint that no longer exists was, from its path alone:
    ``<run id>/step-NNNNNNNN`` gives its run and step. A run keeps only its newest
    ``keep`` checkpoints, so the one the operator last saw may be pruned by the time an
    engine dies and the experiment resumes; its run's newer checkpoints continue it.
    None when the path does not say, or names another run than ``run_id``."""
    run = requested.parent.name
    if not (STEP_DIR.fullmatch(requested.name) and valid_run_id(run)):
        return None
    if run_id is not None and run != run_id:
        return None
    return {RUN_ID: run, "step": dir_step(requested)}


def resume_order(requested: Candidate, siblings: Iterable[Candidate]) -> list[Path]:
    """Checkpoints to try, best first: the run's newer ones, newest first, then the
    requested one (always last, so its own error is the one reported).

    A newer checkpoint counts only when it provably continues the requested one: the
    same run id and a later step. Without a readable run id and step on the requested
    one, nothing but the requested checkpoint is used.
    """
    run, step = _run_and_step(requested.metadata)
    if run is None or step is None:
        return [requested.path]
    newer: dict[Path, int] = {}
    for c in siblings:
        c_run, c_step = _run_and_step(c.metadata)
        if c.path != requested.path and c_run == run and c_step is not None and c_step > step:
            newer[c.path] = c_step
    ordered = sorted(newer.items(), key=lambda pc: pc[1], reverse=True)
    return [p for p, _ in ordered] + [requested.path]


def run_order(run_id: str, candidates: Iterable[Candidate]) -> list[Path]:
    """The checkpoints of run ``run_id`` among ``candidates`` (those in its directory),
    newest step first: what a resume by run id alone tries, in order. A checkpoint whose
    metadata names another run, or none, or cannot be read, is not one of them."""
    found: list[tuple[int, Path]] = []
    for c in candidates:
        c_run, c_step = _run_and_step(c.metadata)
        if c_run == run_id and c_step is not None:
            found.append((c_step, c.path))
    found.sort(key=lambda sp: sp[0], reverse=True)
    return [p for _, p in found]


def _run_and_step(metadata: Mapping[str, Any] | None) -> tuple[str | None, int | None]:
    if not metadata:
        return None, None
    run, step = metadata.get(RUN_ID), metadata.get("step")
    valid_step = isinstance(step, int) and not isinstance(step, bool)
    return (run if valid_run_id(run) else None), (step if valid_step else None)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # removed meanwhile (its writer finished)
        return time.time()
