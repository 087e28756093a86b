"""``serve``'s experiment-tracking settings: which trackers the engine records every
experiment's steps to, and where (loraplex_engine/tracking/). The pool's choice
(EnginePool spec.tracking, passed as these flags): a tenant only names its run and tags it
(the experiment's spec.tracking). Credentials come from the trackers' own variables
(``MLFLOW_TRACKING_TOKEN``, ``WANDB_API_KEY``, ...; the pool's template.env), never from a flag.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict

from loraplex_engine.settings import values as v
from loraplex_engine.settings.values import Flag

WANDB_MODES = ("off", "offline", "online")
DEFAULT_QUEUE = 10_000


class TrackingSettings(BaseModel):
    """Where each experiment's step metrics are recorded, besides Prometheus."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    GROUP: ClassVar[str] = "tracking"

    tracking_mlflow_uri: Annotated[
        str | None,
        Flag(
            "MLflow tracking server to record each experiment's runs to (http(s)://...)",
            metavar="URI",
            default_text="none: no MLflow",
        ),
    ] = None
    tracking_mlflow_experiment: Annotated[
        str,
        Flag(
            "MLflow experiment name prefix: a namespace's runs go to experiment "
            "<PREFIX>/<namespace>",
            metavar="PREFIX",
        ),
    ] = "loraplex"
    tracking_wandb: Annotated[
        Literal["off", "offline", "online"],
        Flag(
            "Weights & Biases: off, offline (run files under --tracking-wandb-dir, for "
            "`wandb sync`) or online (WANDB_API_KEY from the environment)",
            v.one_of("W&B mode", WANDB_MODES),
            metavar="MODE",
        ),
    ] = "off"
    tracking_wandb_project: Annotated[str, Flag("W&B project of the runs", metavar="NAME")] = (
        "loraplex"
    )
    tracking_wandb_entity: Annotated[
        str | None,
        Flag("W&B entity (team) of the runs", metavar="NAME", default_text="the key's default"),
    ] = None
    tracking_wandb_dir: Annotated[
        str | None,
        Flag("directory of W&B's run files", metavar="DIR", default_text="<checkpoint-root>/wandb"),
    ] = None
    tracking_tensorboard_dir: Annotated[
        str | None,
        Flag(
            "write TensorBoard event files under DIR/<namespace>/<experiment>/<run id>/",
            metavar="DIR",
            default_text="none: no TensorBoard",
        ),
    ] = None
    tracking_queue: Annotated[
        int,
        Flag(
            "step records each tracker may hold while it is slow or down; past it the "
            "oldest are dropped (loraplex_engine_tracking_dropped_total)",
            v.positive_int,
            metavar="N",
        ),
    ] = DEFAULT_QUEUE

    @property
    def tracking_enabled(self) -> bool:
        return bool(
            self.tracking_mlflow_uri
            or self.tracking_wandb != "off"
            or self.tracking_tensorboard_dir
        )
