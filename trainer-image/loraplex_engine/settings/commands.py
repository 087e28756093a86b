"""The settings of the commands that run an engine: ``serve`` (one per pod, every flag
also read from ``LORAPLEX_<FLAG>``) and ``run`` (a manifest file on a local engine).

``COMMAND`` names the subcommand their argv starts with (settings/cli.to_argv);
``ENV`` whether a flag's variable is read; ``NOT_FLAGS`` the engine settings the
command does not offer (they keep their defaults, or the command sets them).
"""

from __future__ import annotations

from typing import Annotated, ClassVar

from loraplex_engine.settings import values as v
from loraplex_engine.settings.engine import ProcessSettings
from loraplex_engine.settings.tracking import TrackingSettings
from loraplex_engine.settings.values import Flag
from loraplex_engine.spec.api_types import DEFAULT_MAX_COMPLETION_TOKENS
from loraplex_engine.spec.tinker_limits import (
    DEFAULT_MAX_SESSIONS,
    FUTURE_TTL_S,
    FUTURES_PER_NAMESPACE,
    RECORDED_TOKENS_PER_NAMESPACE,
    RECORDED_TTL_S,
    RETRIEVED_GRACE_S,
)


class ServeSettings(ProcessSettings, TrackingSettings):
    """The HTTP server: where it listens, its token, its tenants' trust."""

    COMMAND: ClassVar[str] = "serve"
    ENV: ClassVar[bool] = True
    GROUP: ClassVar[str] = "server"
    NOT_FLAGS: ClassVar[frozenset[str]] = frozenset({"train_mode"})  # timesliced: bench only
    # Variables `serve` reads that set no flag.
    ENV_EXTRA: ClassVar[tuple[tuple[str, str], ...]] = (
        ("LORAPLEX_TOKEN", "the bearer token itself (instead of --token-file)"),
        ("LORAPLEX_VLLM_PYTHON", "python of the environment that holds vLLM (vllm backend)"),
        ("LORAPLEX_S3_ACCESS_KEY_ID", "object store access key (read once, then unset)"),
        ("LORAPLEX_S3_SECRET_ACCESS_KEY", "object store secret key (read once, then unset)"),
        ("LORAPLEX_S3_SESSION_TOKEN", "object store session token (read once, then unset)"),
    )

    host: Annotated[str, Flag("listen address")] = "0.0.0.0"
    port: Annotated[int, Flag("listen port (0: any free)", v.to_int)] = 8000
    token_file: Annotated[
        str | None, Flag("file holding the bearer token", default_text="none")
    ] = None
    insecure_no_auth: Annotated[
        bool, Flag("serve /v1 without a token (local experiments only)", action="switch")
    ] = False
    tinker_keys: Annotated[
        str | None,
        Flag(
            "serve the Tinker protocol under /api/v1 with these tenant API keys: a file of "
            "'<namespace> <tml-key>' lines, or a directory of files named by namespace, one "
            "key (or sha256:<hex>) per line; re-read when it changes",
            metavar="PATH",
            default_text="none: no /api/v1",
        ),
    ] = None
    served_model_name: Annotated[
        tuple[str, ...],
        Flag(
            "a name clients may call the base model by (Tinker's base_model, e.g. the hub id "
            "'Qwen/Qwen3-8B' a recipe names); repeatable or comma-separated, the first "
            "answered as the model's own",
            action="append",
            metavar="NAME",
            env_parse=v.split_on(","),
            env_help="--served-model-name names, separated by ','",
            default_text="the model's hub id (its config's _name_or_path, or the hub "
            "cache's folder), else the directory's name",
        ),
    ] = ()
    tinker_max_sessions: Annotated[
        int,
        Flag(
            "open Tinker sessions (ServiceClients) a namespace may hold at once; one more "
            "answers 429",
            v.positive_int,
        ),
    ] = DEFAULT_MAX_SESSIONS
    tinker_futures_per_namespace: Annotated[
        int,
        Flag(
            "Tinker futures one namespace may hold: beyond it its oldest finished one is "
            "dropped, and a call is refused (429) only while all of them are pending",
            v.positive_int,
        ),
    ] = FUTURES_PER_NAMESPACE
    tinker_future_ttl: Annotated[
        float,
        Flag("how long a finished Tinker future nobody retrieved is kept", v.seconds),
    ] = FUTURE_TTL_S
    tinker_retrieved_grace: Annotated[
        float,
        Flag(
            "how long a retrieved Tinker future is kept, for a poll whose answer was lost",
            v.seconds,
        ),
    ] = RETRIEVED_GRACE_S
    tinker_recorded_tokens: Annotated[
        int,
        Flag(
            "tokens a namespace's samples recorded for stable_reinforce (record_stability_info)"
            " may hold: beyond it the least recently used are dropped",
            v.positive_int,
        ),
    ] = RECORDED_TOKENS_PER_NAMESPACE
    tinker_recorded_ttl: Annotated[
        float,
        Flag("how long a recorded sample no training request uses is kept", v.seconds),
    ] = RECORDED_TTL_S
    threads: Annotated[int, Flag("torch CPU threads (0: torch's default)", v.to_int)] = 0
    max_completion_tokens: Annotated[
        int, Flag("largest max_tokens accepted by /v1/completions", v.to_int)
    ] = DEFAULT_MAX_COMPLETION_TOKENS
    no_checkpoint_on_shutdown: Annotated[
        bool,
        Flag("skip the final checkpoint of running experiments on SIGTERM", action="switch"),
    ] = False
    log_level: Annotated[str, Flag(f"one of {', '.join(v.LOG_LEVELS)}", v.log_level)] = "info"
    data_root: Annotated[
        tuple[str, ...],
        Flag(
            "directory of tenants' JSONL datasets, one subdirectory per namespace: "
            "task.dataset x.jsonl of namespace team-a is <DIR>/team-a/x.jsonl; repeatable. "
            "None given: jsonl datasets are refused",
            action="append",
            metavar="DIR",
            env_parse=v.split_on(":"),
            env_help="--data-root directories, separated by ':'",
            default_text="none",
        ),
    ] = ()
    allow_dataset_hard_links: Annotated[
        bool,
        Flag(
            "admit dataset files with more than one hard link (deduplicated or snapshot "
            "copies). Refused by default: a tenant that can hard-link another tenant's file "
            "into its own directory would read it; allow only where tenants cannot",
            action="switch",
        ),
    ] = False
    object_store_prefix: Annotated[
        tuple[str, ...],
        Flag(
            "object-storage prefix a namespace's datasets may be read from, holding "
            "{namespace} (s3://datasets/{namespace}/); repeatable. None given: s3:// and "
            "gs:// datasets are refused",
            action="append",
            metavar="URL",
            env_parse=v.split_on(","),
            env_help="--object-store-prefix templates, by ','",
            default_text="none",
        ),
    ] = ()
    object_store_endpoint: Annotated[
        str | None,
        Flag(
            "S3 API endpoint of --object-store-prefix's s3:// buckets (MinIO, Ceph, ...)",
            metavar="URL",
            default_text="AWS's",
        ),
    ] = None
    object_store_region: Annotated[
        str | None, Flag("region of the s3:// buckets", default_text="botocore's")
    ] = None
    allow_reward_host: Annotated[
        tuple[str, ...],
        Flag(
            "rewardUrl host and port allowed even on a loopback, link-local or this pod's "
            "own address (exact name or address; a bare HOST: every port); repeatable. "
            "Others must resolve elsewhere",
            action="append",
            metavar="HOST:PORT",
            env_parse=v.split_on(","),
            env_help="--allow-reward-host hosts, by ','",
            default_text="none",
        ),
    ] = ()
    allow_plugins: Annotated[
        tuple[str, ...],
        Flag(
            "plug-ins the namespaces may name: NAMESPACES=KIND:NAME,... (namespaces by ',' "
            "or *; kind reward or environment; *= grants nothing); repeatable. Any given: a "
            "namespace may name only the plug-ins granted to it",
            action="append",
            metavar="NAMESPACES=PLUGINS",
            env_parse=v.split_on(";"),
            env_help="--allow-plugins grants, by ';'",
            default_text="none: every namespace may name every installed plug-in",
        ),
    ] = ()


class RunSettings(ProcessSettings, TrackingSettings):
    """A manifest file's experiments, trained on one engine in this process."""

    COMMAND: ClassVar[str] = "run"
    ENV: ClassVar[bool] = False
    GROUP: ClassVar[str] = "run"
    # The server's budgets and trust; `run` checkpoints under --out.
    NOT_FLAGS: ClassVar[frozenset[str]] = frozenset(
        {
            "checkpoint_root",
            "checkpoint_keep_runs",
            "gradient_checkpointing",
            "lora_kernel",
            "device_memory",
            "memory_headroom",
            "max_step_tokens",
            "max_prompt_tokens",
            "reward_deadline",
            "vllm_options",
        }
    )

    manifests: Annotated[str, Flag("YAML file of LoRAExperiment manifests", positional=True)]
    model: Annotated[str, Flag("base model directory")]  # type: ignore[assignment]
    out: Annotated[str, Flag("output directory")] = "out/demo"
    data_root: Annotated[
        tuple[str, ...],
        Flag(
            "directory JSONL datasets must lie under (a relative dataset is taken from the "
            "first); repeatable",
            action="append",
            metavar="DIR",
            default_text="the manifest file's directory",
        ),
    ] = ()
    only: Annotated[
        tuple[str, ...],
        Flag(
            "train only the manifest document of this metadata.name; repeatable",
            action="append",
            metavar="NAME",
            default_text="every document",
        ),
    ] = ()
    overrides: Annotated[
        tuple[str, ...],
        Flag(
            "change a field of every document's spec (algorithm.maxSteps=4), or of one "
            "(NAME:algorithm.maxSteps=4), before validation; the value is read as YAML; "
            "repeatable",
            action="append",
            flag="--set",
            metavar="[NAME:]PATH=VALUE",
            default_text="none",
        ),
    ] = ()
    resume: Annotated[
        str | None,
        Flag(
            "go on from the checkpoints of a stopped run's output directory (its --out; "
            "give its manifests, --set and --only again)",
            metavar="OUT",
            default_text="none: a fresh run",
        ),
    ] = None

    @property
    def out_dir(self) -> str:
        """Where this run writes: --resume's directory, else --out."""
        return self.resume or self.out


COMMANDS: tuple[type[ProcessSettings], ...] = (ServeSettings, RunSettings)
