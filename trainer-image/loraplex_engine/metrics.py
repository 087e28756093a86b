"""Prometheus metrics of one engine process (names: docs/metrics.md, engine section).

:class:`EngineMetrics` owns its own registry (so tests and several apps in one process do
not collide) and is fed from two places: the engine loop hands it every
:class:`~loraplex_engine.spec.api_types.TickReport`, and the ``/metrics`` route refreshes the
capacity gauges just before each scrape. Per-experiment series are dropped as soon as
the experiment is no longer loaded, so label sets stay bounded. The serving series (the
OpenAI routes; server/observe.py records them) are labelled by the request's ``model``: a
loaded experiment, the base model (``namespace=""``, ``experiment`` its name), or
``other`` for anything else (an unknown model, a request refused before its body was
accepted).

No ``_created`` series (prometheus-client's process-wide switch, also set by the
operator): Prometheus ignores them and they double a counter's series.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from loraplex_engine.spec.api_types import (
    FAILURE_REASONS,
    SYNC_TRANSPORTS,
    TICK_PHASES,
    Capacity,
    ExperimentStatus,
    TickReport,
)

# A tiny model on CPU ticks in milliseconds; a real model on a GPU in seconds to minutes.
TICK_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# An in-memory sync of a tiny adapter takes a millisecond; a 7B model's adapters at rank 64
# on every linear (~160 MB each in bf16) seconds.
SYNC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
# A serving request: a tiny model on CPU answers in milliseconds; on a busy GPU engine it
# waits for a serving tick between training ticks, then decodes: seconds to minutes.
SERVING_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
OTHER_MODEL = "other"  # the `experiment` of a request for no loaded experiment nor the base
_ERROR_CODE = re.compile(r"[a-z_]{1,32}")
BUSY_WINDOW_S = 60.0
MAX_REASON_LEN = 64
# The failure kinds a tick reports (tick/tick.py `Failure.kind`); exported at 0 from the start so
# the failures panel and alert read 0 instead of "no data" until the first failure.

__all__ = ["CONTENT_TYPE_LATEST", "FAILURE_REASONS", "EngineMetrics"]

disable_created_metrics()


class EngineMetrics:
    """All ``loraplex_engine_*`` series. Thread-safe: the loop thread and the request
    threads update it concurrently."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        busy_window_s: float = BUSY_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        per_exp = ["namespace", "experiment"]
        self.steps = Counter("loraplex_engine_steps", "Optimiser steps taken.", per_exp, registry=r)
        self.rollout_tokens = Counter(
            "loraplex_engine_rollout_tokens", "Generated tokens.", per_exp, registry=r
        )
        self.train_tokens = Counter(
            "loraplex_engine_train_tokens",
            "Tokens through the training forward/backward.",
            per_exp,
            registry=r,
        )
        self.reward = Gauge(
            "loraplex_engine_reward", "Mean reward of the latest step.", per_exp, registry=r
        )
        self.checkpoints = Counter(
            "loraplex_engine_checkpoints", "Checkpoints written.", per_exp, registry=r
        )
        # Only where the trainer recomputes the old log-probs (a vLLM rollout): the torch
        # rollout samples with the trainer's own model, so it has no gap to measure.
        self.logprob_gap = Gauge(
            "loraplex_engine_logprob_gap",
            "Mean |log p_sampler - log p_trainer| over the latest step's sampled tokens.",
            per_exp,
            registry=r,
        )
        # Only for experiments whose loss applies TIS (offPolicyCorrection: tis).
        self.tis_weight_mean = Gauge(
            "loraplex_engine_tis_weight_mean",
            "Mean truncated-importance (TIS) weight over the latest step's sampled tokens.",
            per_exp,
            registry=r,
        )
        # Only for experiments that have published versions (docs/versions.md).
        self.latest_version = Gauge(
            "loraplex_engine_latest_version",
            "N of the experiment's newest published version vN (its latest alias).",
            per_exp,
            registry=r,
        )
        # algorithm.dynamicSampling: exported at 0 for every experiment from its first step.
        self.groups_dropped = Counter(
            "loraplex_engine_groups_dropped",
            "Prompt groups dynamic sampling left out of the update (all rewards equal).",
            per_exp,
            registry=r,
        )
        self.updates_skipped = Counter(
            "loraplex_engine_updates_skipped",
            "Steps with every group dropped by dynamic sampling: no update.",
            per_exp,
            registry=r,
        )
        # spec.eval (docs/evaluation.md): only for experiments with an eval, from its first.
        self.eval_reward = Gauge(
            "loraplex_engine_eval_reward",
            "Mean reward of the latest eval's completions (spec.eval).",
            per_exp,
            registry=r,
        )
        self.eval_pass_at_k = Gauge(
            "loraplex_engine_eval_pass_at_k",
            "pass@k of the latest eval (spec.eval.passAtK), averaged over its prompts.",
            per_exp,
            registry=r,
        )
        self.eval_tokens = Counter(
            "loraplex_engine_eval_tokens",
            "Prompt and completion tokens of the evals' rows (not in rollout_tokens).",
            per_exp,
            registry=r,
        )
        self.failures = Counter(
            "loraplex_engine_experiment_failures",
            "Experiments failed (NaN, reward error, ...).",
            ["reason"],
            registry=r,
        )
        self.tick_seconds = Histogram(
            "loraplex_engine_tick_seconds", "One engine tick.", buckets=TICK_BUCKETS, registry=r
        )
        self.ticks = Counter(
            "loraplex_engine_ticks",
            "Engine ticks run, by kind (train, serve).",
            ["kind"],
            registry=r,
        )
        self.train_passes = Counter(
            "loraplex_engine_train_passes",
            "Forward/backward passes over the model (experiments' update, client calls).",
            registry=r,
        )
        self.phase_seconds = Histogram(
            "loraplex_engine_phase_seconds",
            "Time per phase per tick.",
            ["phase"],
            buckets=TICK_BUCKETS,
            registry=r,
        )
        # Only where the sampler holds its own copy of the adapters (vLLM): one observation
        # per tick that sent any; the torch rollout's series stay at 0.
        self.adapter_sync_seconds = Histogram(
            "loraplex_engine_adapter_sync_seconds",
            "Sending one tick's trained adapters to the sampler, by how they went.",
            ["transport"],
            buckets=SYNC_BUCKETS,
            registry=r,
        )
        self.busy_ratio = Gauge(
            "loraplex_engine_busy_ratio",
            "Share of wall time spent in ticks (last minute).",
            registry=r,
        )
        self.active_adapters = Gauge(
            "loraplex_engine_active_adapters", "Adapters loaded.", registry=r
        )
        self.free_slots = Gauge("loraplex_engine_free_slots", "Adapter slots free.", registry=r)
        # Published versions kept in free slots between serving ticks (versions/slot_cache.py).
        self.resident_versions = Gauge(
            "loraplex_engine_resident_versions",
            "Published versions resident in free adapter slots (evicted when a slot is needed).",
            registry=r,
        )
        self.version_loads = Counter(
            "loraplex_engine_version_loads",
            "Published versions loaded from their directory into a slot (a miss of the cache).",
            registry=r,
        )
        self._version_loads_seen = 0
        # Adapter paging (memory/paging.py): adapters in host memory, their bytes, moves.
        self.paged = Gauge("loraplex_engine_paged_adapters", "Adapters paged out.", registry=r)
        self.paged_bytes = Gauge(
            "loraplex_engine_paged_host_bytes", "Host bytes of paged-out adapters.", registry=r
        )
        self.pages = Counter(
            "loraplex_engine_pages", "Adapters paged in and out.", ["direction"], registry=r
        )
        self._pages_seen = {"in": 0, "out": 0}
        self.memory = Gauge("loraplex_engine_memory_bytes", "Memory in use.", ["kind"], registry=r)
        self.storage_full = Gauge(
            "loraplex_engine_checkpoint_storage_full",
            "1 while checkpoints wait for room on a full checkpoint volume, else 0.",
            registry=r,
        )
        self.serving_requests = Counter(
            "loraplex_engine_serving_requests",
            "OpenAI completions and chat completions answered, errors included.",
            per_exp,
            registry=r,
        )
        self.serving_errors = Counter(
            "loraplex_engine_serving_errors",
            "Serving requests answered with an error, by error code.",
            [*per_exp, "code"],
            registry=r,
        )
        self.serving_seconds = Histogram(
            "loraplex_engine_serving_request_seconds",
            "A serving request from its arrival to its last byte (a stream's end).",
            per_exp,
            buckets=SERVING_BUCKETS,
            registry=r,
        )
        self.serving_first_token = Histogram(
            "loraplex_engine_serving_first_token_seconds",
            "A serving request from its arrival to its first generated token.",
            per_exp,
            buckets=SERVING_BUCKETS,
            registry=r,
        )
        self.serving_queue = Gauge(
            "loraplex_engine_serving_queue_depth",
            "Completion jobs waiting for a serving tick.",
            registry=r,
        )
        for phase in TICK_PHASES:  # every phase visible from the first scrape
            self.phase_seconds.labels(phase=phase)
        for kind in ("rss", "device"):
            self.memory.labels(kind=kind)
        for transport in SYNC_TRANSPORTS:
            self.adapter_sync_seconds.labels(transport=transport)
        for reason in FAILURE_REASONS:
            self.failures.labels(reason=reason)
        for kind in ("train", "serve"):  # ticks of both kinds from the first scrape
            self.ticks.labels(kind=kind)
        for direction in ("in", "out"):  # pages both ways from the first scrape
            self.pages.labels(direction=direction)

        self._per_experiment = (
            self.steps,
            self.rollout_tokens,
            self.train_tokens,
            self.reward,
            self.checkpoints,
            self.logprob_gap,
            self.latest_version,
            self.tis_weight_mean,
            self.groups_dropped,
            self.updates_skipped,
            self.eval_reward,
            self.eval_pass_at_k,
            self.eval_tokens,
        )
        self._serving = (self.serving_requests, self.serving_seconds, self.serving_first_token)
        self._lock = threading.Lock()
        self._known: dict[str, str] = {}  # experiment id -> namespace
        self._base: str | None = None  # the base model's name, once known
        self._error_codes: set[str] = set()  # codes counted so far (to remove their series)
        self._clock = clock
        self._window = busy_window_s
        self._started = clock()
        self._ticks: deque[tuple[float, float]] = deque()  # (end time, seconds)
        self.busy_ratio.set_function(self.compute_busy_ratio)

    # --- per-experiment series -------------------------------------------------------

    def track(self, exp_id: str, namespace: str) -> None:
        """Create the experiment's series (at zero) so it shows before its first step."""
        with self._lock:
            self._track_locked(exp_id, namespace)

    def _track_locked(self, exp_id: str, namespace: str) -> None:
        old = self._known.get(exp_id)
        if old == namespace:
            return
        if old is not None:
            self._remove_locked(exp_id)
        self._known[exp_id] = namespace
        for metric in (self.steps, self.rollout_tokens, self.train_tokens, self.checkpoints):
            metric.labels(namespace=namespace, experiment=exp_id)
        for metric in self._serving:
            metric.labels(namespace=namespace, experiment=exp_id)

    def forget(self, exp_id: str) -> None:
        """Drop every series of an unloaded experiment."""
        with self._lock:
            self._remove_locked(exp_id)

    def _remove_locked(self, exp_id: str) -> None:
        namespace = self._known.pop(exp_id, None)
        if namespace is None:
            return
        self._remove_series(namespace, exp_id)

    def _remove_series(self, namespace: str, exp_id: str) -> None:
        for metric in (*self._per_experiment, *self._serving):
            with contextlib.suppress(KeyError):
                metric.remove(namespace, exp_id)
        for code in self._error_codes:
            with contextlib.suppress(KeyError):
                self.serving_errors.remove(namespace, exp_id, code)

    def tracked(self) -> dict[str, str]:
        with self._lock:
            return dict(self._known)

    def sync_experiments(self, loaded: Iterable[ExperimentStatus]) -> None:
        """Make the per-experiment series match the loaded experiments exactly."""
        loaded = list(loaded)
        with self._lock:
            ids = {s.id for s in loaded}
            for exp_id in [e for e in self._known if e not in ids]:
                self._remove_locked(exp_id)
            for s in loaded:
                self._track_locked(s.id, s.namespace)
                if s.reward is not None and s.step > 0:
                    self.reward.labels(namespace=s.namespace, experiment=s.id).set(s.reward)
                if s.logprob_gap is not None:
                    labels = {"namespace": s.namespace, "experiment": s.id}
                    self.logprob_gap.labels(**labels).set(s.logprob_gap)
                if s.tis_weight_mean is not None:
                    labels = {"namespace": s.namespace, "experiment": s.id}
                    self.tis_weight_mean.labels(**labels).set(s.tis_weight_mean)
                latest = s.aliases.get("latest")
                if latest is not None:
                    labels = {"namespace": s.namespace, "experiment": s.id}
                    self.latest_version.labels(**labels).set(int(latest[1:]))
                if s.eval_reward is not None and s.eval_pass_at_k is not None:
                    labels = {"namespace": s.namespace, "experiment": s.id}
                    self.eval_reward.labels(**labels).set(s.eval_reward)
                    self.eval_pass_at_k.labels(**labels).set(s.eval_pass_at_k)

    def count_checkpoint(self, exp_id: str, namespace: str) -> None:
        with self._lock:
            self._track_locked(exp_id, namespace)
            self.checkpoints.labels(namespace=namespace, experiment=exp_id).inc()

    # --- serving (the OpenAI routes) ---------------------------------------------------

    def set_base_model(self, name: str) -> None:
        """The base model's name: its serving series, at 0, under ``experiment=name``."""
        with self._lock:
            if name == self._base:
                return
            if self._base is not None:
                self._remove_series("", self._base)
            self._base = name
            for metric in self._serving:
                metric.labels(namespace="", experiment=name)

    def _serving_labels(self, model: str | None) -> dict[str, str]:
        """Bounded labels for a request's ``model``: loaded experiments and the base."""
        if model is not None and model in self._known:
            return {"namespace": self._known[model], "experiment": model}
        if model is not None and model == self._base:
            return {"namespace": "", "experiment": model}
        return {"namespace": "", "experiment": OTHER_MODEL}

    def observe_serving(
        self,
        model: str | None,
        seconds: float,
        first_token_s: float | None = None,
        error_code: str | None = None,
    ) -> None:
        """One answered serving request (``model`` None: refused before it was read)."""
        with self._lock:
            labels = self._serving_labels(model)
            self.serving_requests.labels(**labels).inc()
            self.serving_seconds.labels(**labels).observe(max(seconds, 0.0))
            if first_token_s is not None:
                self.serving_first_token.labels(**labels).observe(max(first_token_s, 0.0))
            if error_code is not None:
                code = error_code if _ERROR_CODE.fullmatch(error_code) else "other"
                self._error_codes.add(code)
                self.serving_errors.labels(**labels, code=code).inc()

    def set_serving_queue(self, depth: int) -> None:
        self.serving_queue.set(max(depth, 0))

    # --- ticks -----------------------------------------------------------------------

    def observe_tick(self, report: TickReport) -> None:
        now = self._clock()
        with self._lock:
            self.tick_seconds.observe(max(report.seconds, 0.0))
            self.ticks.labels(kind=report.kind).inc()
            self.train_passes.inc(max(report.train_passes, 0))
            for phase, seconds in report.phase_seconds.items():
                self.phase_seconds.labels(phase=phase).observe(max(seconds, 0.0))
            sync = report.adapter_sync
            if sync is not None:
                self.adapter_sync_seconds.labels(transport=sync.transport).observe(
                    max(sync.seconds, 0.0)
                )
            self._ticks.append((now, max(report.seconds, 0.0)))
            self._trim_locked(now)
            for t in report.experiments:
                self._track_locked(t.id, t.namespace)
                labels = {"namespace": t.namespace, "experiment": t.id}
                if t.failed_reason is not None:
                    self.failures.labels(reason=_reason(t.failed_reason)).inc()
                    continue
                if t.eval is not None:
                    self.eval_reward.labels(**labels).set(t.eval.reward)
                    self.eval_pass_at_k.labels(**labels).set(t.eval.pass_at_k)
                    self.eval_tokens.labels(**labels).inc(max(t.eval.tokens, 0))
                if t.eval_only:  # the last adapter's eval: no step was taken
                    continue
                self.steps.labels(**labels).inc()
                self.rollout_tokens.labels(**labels).inc(max(t.rollout_tokens, 0))
                self.train_tokens.labels(**labels).inc(max(t.train_tokens, 0))
                self.reward.labels(**labels).set(t.reward)
                if t.logprob_gap is not None:
                    self.logprob_gap.labels(**labels).set(t.logprob_gap)
                if t.tis_weight_mean is not None:
                    self.tis_weight_mean.labels(**labels).set(t.tis_weight_mean)
                self.groups_dropped.labels(**labels).inc(t.dropped_groups)
                self.updates_skipped.labels(**labels).inc(int(t.update_skipped))
                if t.checkpointed:
                    self.checkpoints.labels(**labels).inc()

    def _trim_locked(self, now: float) -> None:
        while self._ticks and self._ticks[0][0] < now - self._window:
            self._ticks.popleft()

    def compute_busy_ratio(self) -> float:
        now = self._clock()
        with self._lock:
            self._trim_locked(now)
            busy = 0.0
            start = now - self._window
            for end, seconds in self._ticks:
                busy += min(seconds, end - start)  # clip a tick that began before the window
            span = min(self._window, now - self._started)
        if span <= 0:
            return 0.0
        return max(0.0, min(1.0, busy / span))

    # --- capacity --------------------------------------------------------------------

    def update_capacity(self, capacity: Capacity) -> None:
        self.active_adapters.set(capacity.used_slots)
        self.free_slots.set(capacity.free_slots)
        self.memory.labels(kind="rss").set(capacity.memory.rss_bytes)
        self.memory.labels(kind="device").set(capacity.memory.device_bytes)
        self.storage_full.set(1 if capacity.storage_full is not None else 0)
        self.resident_versions.set(len(capacity.resident_versions))
        if capacity.version_loads > self._version_loads_seen:  # the engine's count so far
            self.version_loads.inc(capacity.version_loads - self._version_loads_seen)
        self._version_loads_seen = capacity.version_loads
        self.paged.set(capacity.paged_adapters)
        self.paged_bytes.set(capacity.paged_host_bytes)
        for way, total in (("in", capacity.page_ins), ("out", capacity.page_outs)):
            self.pages.labels(direction=way).inc(max(0, total - self._pages_seen[way]))
            self._pages_seen[way] = total

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _reason(reason: str) -> str:
    """A bounded label value: failure reasons are short codes, but guard against text."""
    reason = reason.strip().split(":", 1)[0].strip() or "unknown"
    return reason[:MAX_REASON_LEN]
