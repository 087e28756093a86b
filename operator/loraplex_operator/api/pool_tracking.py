"""``EnginePool.spec.tracking``: the experiment trackers the pool's engines record every
experiment's steps to (docs/tracking.md), and the ``serve --tracking-*`` flags they become.

The pool admin's choice alone: where runs go, under which MLflow experiment prefix, W&B
project and entity, and how much an engine holds while a tracker is down. Tenants only
name their runs and tag them (the experiment's spec.tracking). Credentials stay in the
engine's environment (template.env from a Secret: ``MLFLOW_TRACKING_TOKEN``,
``WANDB_API_KEY``), never in the spec.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from loraplex_operator.api.schema import ApiModel, Int32

AbsolutePath = Annotated[str, Field(min_length=2, max_length=4096, pattern=r"^/")]
PlainName = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")]


class MlflowTracking(ApiModel):
    """An MLflow tracking server."""

    tracking_uri: str = Field(
        alias="trackingUri",
        min_length=8,
        max_length=2048,
        pattern=r"^https?://[^\s]+$",
        description="The tracking server's http(s) URL (`serve --tracking-mlflow-uri`); a "
        "token or password for it goes in template.env (MLFLOW_TRACKING_TOKEN, from a Secret).",
    )
    experiment_prefix: str = Field(
        "loraplex",
        alias="experimentPrefix",
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*$",
        description="A namespace's runs go to the MLflow experiment <experimentPrefix>/"
        "<namespace> (`serve --tracking-mlflow-experiment`).",
    )


class WandbTracking(ApiModel):
    """Weights & Biases."""

    mode: Literal["offline", "online"] = Field(
        "offline",
        description="offline: run files under dir, for `wandb sync`; online: to W&B "
        "(WANDB_API_KEY in template.env, from a Secret).",
    )
    project: PlainName = Field("loraplex", description="The W&B project of the runs.")
    entity: PlainName | None = Field(
        None, description="The W&B entity (team). Absent: the API key's default."
    )
    dir: AbsolutePath | None = Field(
        None,
        description="Directory of the run files in the engine pods (on a volume, to outlive "
        "the pod). Absent: <checkpoint root>/wandb.",
    )


class TensorBoardTracking(ApiModel):
    """TensorBoard event files."""

    log_dir: AbsolutePath = Field(
        alias="logDir",
        description="Directory in the engine pods (on a volume, to outlive the pod) the runs "
        "are written under, as <logDir>/<namespace>/<experiment>/<run id>/.",
    )


class PoolTracking(ApiModel):
    """Experiment trackers the engines record every experiment's step metrics to (reward
    mean/std, KL, entropy, clip fraction, response length, step seconds, tokens; one run
    per experiment run, named and tagged by its spec.tracking), besides Prometheus. A
    tracker that is down or slow never stops or slows training: each has a bounded queue
    and is retried with backoff (loraplex_engine_tracking_* series). Absent: none. Applies
    to engine pods created after a change. See docs/tracking.md."""

    mlflow: MlflowTracking | None = Field(None, description=MlflowTracking.__doc__)
    wandb: WandbTracking | None = Field(None, description=WandbTracking.__doc__)
    tensorboard: TensorBoardTracking | None = Field(None, description=TensorBoardTracking.__doc__)
    queue: Int32 | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description="Step records each tracker may hold while it is down or slow; past it "
        "the oldest are dropped (`serve --tracking-queue`). Absent: the engine's (10000).",
    )


def tracking_args(tracking: PoolTracking | None) -> list[str]:
    """The pool's trackers as `serve` flags (`--flag=value`: a value is never a flag)."""
    if tracking is None:
        return []
    args: list[str] = []
    if tracking.mlflow is not None:
        args += [
            f"--tracking-mlflow-uri={tracking.mlflow.tracking_uri}",
            f"--tracking-mlflow-experiment={tracking.mlflow.experiment_prefix}",
        ]
    if (w := tracking.wandb) is not None:
        args += [f"--tracking-wandb={w.mode}", f"--tracking-wandb-project={w.project}"]
        args += [f"--tracking-wandb-entity={w.entity}"] if w.entity else []
        args += [f"--tracking-wandb-dir={w.dir}"] if w.dir else []
    if tracking.tensorboard is not None:
        args.append(f"--tracking-tensorboard-dir={tracking.tensorboard.log_dir}")
    if tracking.queue is not None:
        args.append(f"--tracking-queue={tracking.queue}")
    return args
