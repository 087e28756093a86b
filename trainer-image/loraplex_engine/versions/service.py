"""The Engine's version routes: a mixin over ``self.publisher`` (versions/publisher.py),
so that engine.py only composes it (``Engine(ClientExperimentAPI, Versions)``)."""

from __future__ import annotations

import threading
from typing import Protocol

from loraplex_engine.experiment import Experiment
from loraplex_engine.spec.api_types import ExperimentStatus, VersionSummary
from loraplex_engine.spec.publish import PublishSpec
from loraplex_engine.versions.publisher import Publisher


class _Host(Protocol):
    publisher: Publisher
    _model_lock: threading.RLock

    def _require(self, exp_id: str) -> Experiment: ...


class Versions:
    """Publishing by hand and a publish block edited in place."""

    def publish_version(self: _Host, exp_id: str) -> VersionSummary:
        """The experiment's adapter as its next version, now."""
        with self._model_lock:
            return self.publisher.publish_now(self._require(exp_id))

    def describe_version(self: _Host, model: str) -> VersionSummary:
        """The version a version name serves now (an alias: where it points)."""
        return self.publisher.describe(model)

    def update_publish(self: _Host, exp_id: str, publish: PublishSpec | None) -> ExperimentStatus:
        """A new ``spec.publish`` (the operator's, after a kubectl patch): applied in
        place, the experiment training on; its aliases move at once."""
        with self._model_lock:
            exp = self._require(exp_id)
            self.publisher.update_publish(exp, publish)
            return exp.status()
