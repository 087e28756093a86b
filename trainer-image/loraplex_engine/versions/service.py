"""The Engine's version routes over its publisher (versions/publisher.py): publishing by
hand, describing a version name, a publish block edited in place. The Engine composes
one (``self.versions``) and hands it, by name, what it needs: the publisher, the model
lock, and how to find a loaded experiment."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from loraplex_engine.experiment import Experiment
from loraplex_engine.spec.api_types import ExperimentStatus, VersionSummary
from loraplex_engine.spec.publish import PublishSpec
from loraplex_engine.versions.publisher import Publisher


@dataclass(frozen=True)
class VersionRoutes:
    publisher: Publisher
    model_lock: threading.RLock  # an experiment's adapter is read between ticks
    require: Callable[[str], Experiment]  # a loaded experiment by id, else NotFoundError

    def publish_version(self, exp_id: str) -> VersionSummary:
        """The experiment's adapter as its next version, now."""
        with self.model_lock:
            return self.publisher.publish_now(self.require(exp_id))

    def describe_version(self, model: str) -> VersionSummary:
        """The version a version name serves now (an alias: where it points)."""
        return self.publisher.describe(model)

    def update_publish(self, exp_id: str, publish: PublishSpec | None) -> ExperimentStatus:
        """A new ``spec.publish`` (the operator's, after a kubectl patch): applied in
        place, the experiment training on; its aliases move at once."""
        with self.model_lock:
            exp = self.require(exp_id)
            self.publisher.update_publish(exp, publish)
            return exp.status()
