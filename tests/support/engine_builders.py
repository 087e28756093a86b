"""Small builders for engine tests: specs that read like the manifests users write."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from loraplex_engine.engine import Engine
from loraplex_engine.settings.engine import EngineSettings
from loraplex_engine.spec.experiment import ExperimentSpec, parse_spec
from loraplex_engine.tenancy.trust import TrustPolicy

from tests.support.spec_bodies import spec_body

# Engine tests keep their datasets in pytest's temporary directories and score with
# loopback reward servers: the local runner's policy over the temporary directory. The
# engine service's own limits are tested in test_tenant_boundaries.py and test_trust.py.
TEST_TRUST = TrustPolicy.local([Path(tempfile.gettempdir()).resolve()])


def spec(
    task: dict[str, Any] | None = None,
    *,
    lr: float = 0.02,
    steps: int = 20,
    seed: int = 0,
    group: int = 8,
    prompts: int = 4,
    every: int = 10,
    keep: int = 3,
    kl: float = 0.0,
    **extra: Any,
) -> ExperimentSpec:
    body = spec_body(
        task,
        rank=8,
        group=group,
        prompts=prompts,
        lr=lr,
        steps=steps,
        new_tokens=8,
        every=every,
        keep=keep,
        seed=seed,
        kl=kl,
    )
    return parse_spec(body | extra)


def engine(model_dir: Path, root: Path, **kwargs: Any) -> Engine:
    kwargs.setdefault("max_adapters", 4)
    kwargs.setdefault("max_rank", 16)
    kwargs.setdefault("trust", TEST_TRUST)
    return Engine(model_dir, **engine_kwargs(checkpoint_root=str(root), **kwargs))


def engine_kwargs(**kwargs: Any) -> dict[str, Any]:
    """``Engine``'s keywords for ``kwargs``: the EngineSettings among them as ``settings``."""
    fields = {k: kwargs.pop(k) for k in list(kwargs) if k in EngineSettings.model_fields}
    return {"settings": EngineSettings(**fields), **kwargs}


def run_to_end(eng: Engine, ids: list[str], max_ticks: int = 500) -> dict[str, list[float]]:
    """Tick until no experiment runs; returns each experiment's reward curve."""
    curves: dict[str, list[float]] = {i: [] for i in ids}
    for _ in range(max_ticks):
        report = eng.tick()
        if report is None:
            return curves
        for exp in report.experiments:
            if exp.failed_reason is None and exp.id in curves:
                curves[exp.id].append(exp.reward)
    raise AssertionError(f"experiments still running after {max_ticks} ticks")


def mean(values: list[float]) -> float:
    return sum(values) / len(values)
