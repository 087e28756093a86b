"""The engine's side of published versions: publish an experiment's adapter (on its
``publish.everySteps`` or by hand), keep its aliases in step with the spec and the gate,
and find the directory a version name serves from.

Called under the engine's model lock (placement, the tick's bookkeeping phase, spec
edits, the publish route), so an experiment's versions and aliases have one writer on
this engine. A publish that fails (quota, a full volume) does not fail the experiment:
training goes on, the failure is its status's ``publishError``, and the next due step
tries again.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from loraplex_engine.base_model import fingerprint
from loraplex_engine.experiment import Experiment, PublishState, check_same
from loraplex_engine.lora.model import MultiLoRAModel
from loraplex_engine.spec.api_types import VersionSummary
from loraplex_engine.spec.errors import (
    CheckpointError,
    ConflictError,
    NotFoundError,
    UnavailableError,
)
from loraplex_engine.spec.eval_scores import EvalResult
from loraplex_engine.spec.experiment import ExperimentSpec
from loraplex_engine.spec.publish import STABLE, PublishSpec, hand_aliases, pinned_versions
from loraplex_engine.store import checkpoint as ckpt
from loraplex_engine.store.versions import Manifest, VersionStore, version_name
from loraplex_engine.versions import names
from loraplex_engine.versions.policy import (
    best_scores,
    due,
    eval_score,
    gate,
    gate_note,
    improves,
    moves,
    next_aliases,
    scores_of,
    token_due,
)
from loraplex_engine.versions.slot_cache import VersionSlots, resident_name

log = logging.getLogger("loraplex_engine.versions")

RECENT_VERSIONS = 10  # how many the status lists


class Publisher:
    def __init__(
        self,
        store: VersionStore,
        model: MultiLoRAModel,
        model_dir: Path,
        serves_versions: bool,
    ) -> None:
        self.store = store
        self.model = model
        self.model_dir = model_dir
        # The rollout decodes with the trained model (torch): a version loads into a
        # spare slot. A vLLM rollout has its own adapters: a vLLM fleet serves versions.
        self.serves_versions = serves_versions
        # Versions stay resident in spare slots between the ticks that serve them.
        self.slots = VersionSlots(model) if serves_versions else None
        self._fingerprint: str | None = None  # of the base model, on the first publish

    # ---- an experiment's versions -------------------------------------------------------

    def attach(self, exp: Experiment) -> None:
        """On placement: what a killed writer left, the versions and aliases on disk (a
        resumed experiment continues their sequence), then the spec's aliases."""
        self.store.remove_leftovers(exp.namespace, exp.name)  # bound here: ours
        ns, name = exp.namespace, exp.name
        exp.published = PublishState(
            aliases=self.store.read_aliases(ns, name), token=self.store.read_token(ns, name)
        )
        exp.published.best = best_scores([self._manifest(exp, n).scores for n in self._all(exp)])
        self._refresh(exp)
        self._apply(exp)
        self._requested(exp)

    def after_step(self, exp: Experiment, reward: float) -> None:
        """The tick's bookkeeping: the step's reward joins the next version's window; a
        version is published when one is due. With spec.eval and an eval due at this
        step, the version waits for that eval's scores (:meth:`after_eval`); if the
        adapter moved on before they came, it is published now with the latest before."""
        if exp.plan.publish is None:
            return
        st = exp.published
        st.window.append(reward)
        if st.awaiting_eval is not None and st.awaiting_eval < exp.step:
            st.awaiting_eval = None
            self.publish(exp)
        if due(exp.step, exp.plan.publish):
            if exp.eval_due():
                st.awaiting_eval = exp.step
            else:
                self.publish(exp)
        self._requested(exp)

    def after_eval(self, exp: Experiment, result: EvalResult) -> None:
        """An eval's result (spec.eval), while the adapter is the one evaluated (or, in a
        stale pipelined step, one step on): its scores join the next version's; the
        version due at its step is published, and so is one whose score beats every
        published version's (publish.onEvalImprovement; never the untrained adapter)."""
        st, spec = exp.published, exp.plan.publish
        st.last_eval = result
        if spec is None:
            return
        waited = st.awaiting_eval is not None and st.awaiting_eval <= result.step
        which = spec.on_eval_improvement
        better = which is not None and result.step > 0
        better = better and improves(eval_score(result, which or ""), st.best.get(which or ""))
        if waited or better:
            st.awaiting_eval = None
            self.publish(exp)

    def publish(
        self, exp: Experiment, by_hand: bool = False, token: str | None = None
    ) -> VersionSummary | None:
        """Publish ``exp``'s adapter now; None (the reason in its status) when refused.
        ``by_hand``: the error is raised too, for the caller to answer with; ``token``:
        the publish.requestToken it answers."""
        spec = exp.plan.publish or PublishSpec()
        scores = scores_of(exp.published.window, exp.published.last_eval, exp.step)
        last_eval = exp.published.last_eval
        eval_step = last_eval.step if last_eval and last_eval.step <= exp.step else None
        passed = gate(scores, spec.promote_when)
        protected = pinned_versions(spec) | set(exp.published.aliases.values())
        protected |= set(hand_aliases(spec).values())

        def write(tmp: Path) -> None:
            ckpt.save_adapter(self.model, exp.id, tmp, base_model_name_or_path=str(self.model_dir))

        def manifest(number: int, parent: int | None, digest: str) -> Manifest:
            return Manifest(
                version=number,
                experiment=exp.id,
                run_id=exp.run_id,
                parent=parent,
                base_model=self.model_dir.name,
                base_model_hash=self._base_hash(),
                step=exp.step,
                scores=scores,
                eval_step=eval_step,
                gate_passed=passed,
                gate_note=gate_note(scores, spec.promote_when),
                request_token=token,
                content_hash=digest,
                created_at=datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
            )

        try:
            made = self.store.publish(
                exp.namespace, exp.name, write, manifest, spec.keep, protected, self._estimate(exp)
            )
        except (CheckpointError, OSError) as e:
            exp.published.error = f"publish at step {exp.step} failed: {e}"
            log.warning("experiment %s: %s", exp.id, exp.published.error)
            if by_hand:
                raise
            return None
        exp.published.window.clear()
        exp.published.best = best_scores([exp.published.best, made.scores])
        log.info("experiment %s: published %s at step %d%s", exp.id, version_name(made.version),
                 exp.step, f" ({made.gate_note})" if made.gate_note else "")  # fmt: skip
        self._refresh(exp)
        self._apply(exp, promoted=made.version if passed else None)
        if token is not None:  # last: a status read (no model lock) that shows the token
            self._token_written(exp, token, made.version)  # shows its version too
        return summary(made)

    def publish_now(self, exp: Experiment) -> VersionSummary:
        """By hand (the engine's publish route): the next version, or the error."""
        try:
            made = self.publish(exp, by_hand=True)
        except CheckpointError as e:  # the quota: the tenant's to fix
            raise ConflictError(str(exp.published.error)) from e
        except OSError as e:  # the volume's
            raise UnavailableError(str(exp.published.error)) from e
        assert made is not None  # by hand, a refusal raises
        return made

    def update_publish(self, exp: Experiment, publish: PublishSpec | None) -> None:
        """A new publish block, applied in place."""
        self.update(exp, exp.spec.model_copy(update={"publish": publish}), exp.run_id)

    def update(self, exp: Experiment, spec: ExperimentSpec, run_id: str | None) -> None:
        """A PUT of a loaded experiment: a no-op with its spec and run, but a changed
        publish block (kubectl patch of the aliases, a pin, the policy) is applied in
        place, the experiment training on; any other change is a ConflictError."""
        if check_same(exp, spec, run_id):
            exp.plan = exp.plan.republished(spec.publish)
            self._apply(exp)
            self._requested(exp)

    def _requested(self, exp: Experiment) -> None:
        """Publish the version a new publish.requestToken asks for (once per token: it is
        recorded with the version, so neither an edit nor a resume publishes it again). A
        refused one is retried after each step."""
        token = token_due(exp.plan.publish, exp.published.token)
        if token is not None:
            self.publish(exp, token=token)

    def _token_written(self, exp: Experiment, token: str, version: int) -> None:
        exp.published.token = token
        try:
            self.store.write_token(exp.namespace, exp.name, token, version)
        except OSError as e:  # the manifest holds it too (store.read_token)
            log.warning("experiment %s: requestToken file not written: %s", exp.id, e)

    def _apply(self, exp: Experiment, promoted: int | None = None) -> None:
        hand = hand_aliases(exp.plan.publish)
        existing = self.store.list(exp.namespace, exp.name)
        failed = {v for a, v in hand.items() if a == STABLE and self._gate_of(exp, v) is False}
        before = exp.published.aliases
        after, problems = next_aliases(before, hand, existing, failed, promoted)
        if after != before:
            try:
                self.store.write_aliases(exp.namespace, exp.name, after)
            except OSError as e:
                exp.published.error = f"aliases not written: {e}"
                return
            for m in moves(before, after):
                log.info("experiment %s: alias %s moved %s -> %s", exp.id, m.alias,
                         _v(m.before), _v(m.after))  # fmt: skip
        exp.published.aliases = after
        exp.published.error = "; ".join(problems) or None

    def _gate_of(self, exp: Experiment, version: int) -> bool | None:
        try:
            return self.store.read(exp.namespace, exp.name, version).gate_passed
        except CheckpointError:
            return None

    def _all(self, exp: Experiment) -> list[int]:
        return self.store.list(exp.namespace, exp.name)

    def _manifest(self, exp: Experiment, version: int) -> Manifest:
        """A version's manifest; an empty one (no scores) when it is unreadable."""
        try:
            return self.store.read(exp.namespace, exp.name, version)
        except CheckpointError as e:  # pruned meanwhile, or tampered with
            log.warning("experiment %s: %s", exp.id, e)
            return Manifest.model_construct(scores={})

    def _refresh(self, exp: Experiment) -> None:
        recent = []
        for n in self.store.list(exp.namespace, exp.name)[-RECENT_VERSIONS:]:
            try:
                recent.append(summary(self.store.read(exp.namespace, exp.name, n)))
            except CheckpointError as e:  # pruned meanwhile, or tampered with
                log.warning("experiment %s: %s", exp.id, e)
        exp.published.recent = recent

    def _estimate(self, exp: Experiment) -> int:
        return sum(4 * t.numel() for t in self.model.adapter_state_dict(exp.id).values())

    def _base_hash(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = fingerprint(self.model_dir)
        return self._fingerprint

    # ---- serving ------------------------------------------------------------------------

    def slot_stats(self) -> dict[str, Any]:
        """Capacity's fields of the version slot cache (versions/slot_cache.py)."""
        if self.slots is None:
            return {}
        return {"resident_versions": self.slots.resident(), "version_loads": self.slots.loads}

    def serving(self, model: str) -> tuple[str, Path]:
        """The adapter name (the version's own and its content: slot_cache.resident_name)
        and directory that model name ``model`` serves from now: a version
        (``<ns>.<name>@v<N>``) or where an alias points (``<ns>.<name>:<alias>``).
        NotFoundError when it names nothing published."""
        ref = names.parse(model)
        if ref is None:
            raise NotFoundError(
                f"no model {model!r}: use an experiment id, <namespace>.<name>@v<N>, "
                "<namespace>.<name>:<alias> or the base model"
            )
        if not self.serves_versions:
            raise UnavailableError(
                f"{model!r}: this engine's rollout backend (vLLM) serves only its live "
                "adapters; serve published versions from a vLLM fleet (docs/versions.md)"
            )
        version = ref.version
        if version is None:
            version = self.store.read_aliases(ref.namespace, ref.name).get(ref.alias or "")
            if version is None:
                raise NotFoundError(f"no alias {ref.alias!r} of experiment {ref.experiment!r}")
        try:
            manifest = self.store.read(ref.namespace, ref.name, version)
        except CheckpointError as e:
            raise NotFoundError(f"{model!r}: {e}") from e
        directory = self.store.path(ref.namespace, ref.name, version)
        served = names.served_name(ref.namespace, ref.name, version)
        return resident_name(served, manifest.content_hash), directory

    def describe(self, model: str) -> VersionSummary:
        """What :meth:`serving` would serve for ``model``, as its summary."""
        _, directory = self.serving(model)
        ref = names.parse(model)
        assert ref is not None  # serving() refuses anything else
        try:
            return summary(self.store.read(ref.namespace, ref.name, int(directory.name[1:])))
        except CheckpointError as e:  # pruned since
            raise NotFoundError(f"{model!r}: {e}") from e


def summary(m: Manifest) -> VersionSummary:
    return VersionSummary(
        version=version_name(m.version),
        step=m.step,
        scores=m.scores,
        gate_passed=m.gate_passed,
        created_at=m.created_at,
        content_hash=m.content_hash,
        eval_step=m.eval_step,
        gate_note=m.gate_note,
        request_token=m.request_token,
    )


def _v(n: int | None) -> str:
    return "-" if n is None else version_name(n)
