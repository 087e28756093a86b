"""Every error the engine raises on purpose: one hierarchy under :class:`LoraplexError`.

Two branches:

- **core errors** (specs, tasks, rewards, manifests, adapters, routing, checkpoints, the
  vLLM worker) say what went wrong inside the engine; adapter and checkpoint errors are
  raised *before* anything changes, so a caller can report them and carry on. They
  carry no API code: the same core error means different things to a client depending on
  the call (an unknown adapter is an invalid spec in a PUT, an unknown model in a
  completion), so the engine translates them into API errors where it knows the call.
- **API errors** (:class:`ApiError`) are what a client caused: a stable ``code``
  (docs/engine-api.md), a ``message`` and the ``field`` at fault. Their HTTP status is
  chosen in one place, ``server_errors.HTTP_STATUS``; this module knows nothing of HTTP.
  A core error that reaches the server untranslated is an engine bug and answers 500.
"""

from __future__ import annotations

import signal


class LoraplexError(Exception):
    """Root of every loraplex engine error."""


# --- core errors ----------------------------------------------------------------------


class FieldError(LoraplexError, ValueError):
    """A bad value at one path of the spec: ``str(e)`` is ``"<field>: <message>"``."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class SpecError(FieldError):
    """An invalid spec; ``field`` is the path, e.g. ``spec.lora.rank``."""


class TaskError(FieldError):
    """Bad task settings or data; ``field`` is the spec path (``spec.task.params.x``)."""


class DataReadError(LoraplexError):
    """Why the dataset reader process (data/child.py) cannot read a dataset: one line,
    naming where; the engine turns it into a TaskError on spec.task.dataset."""


class DataFileMissing(DataReadError):
    """A file or object the dataset reader asked for is not there."""


class ParamError(LoraplexError, ValueError):
    """A plug-in environment's bad ``task.environment.params`` entry: ``param`` names it
    (the engine's 422 says ``spec.task.environment.params.<param>``). Plug-ins import it
    from ``loraplex_engine.environments.base``."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class CalcError(LoraplexError, ValueError):
    """Why the GSM8K calculator refuses an expression (workloads/calculator.py): shown to
    the policy as the tool's result."""


class ManifestError(LoraplexError, ValueError):
    """One or more bad manifest documents; ``problems`` lists one line per problem."""

    def __init__(self, source: str, problems: list[str]):
        super().__init__(f"{source}: {len(problems)} problem(s):\n  " + "\n  ".join(problems))
        self.problems = problems


class RewardError(LoraplexError, RuntimeError):
    """A reward could not be computed (service down, bad answer, non-finite score)."""


class PluginError(RewardError):
    """An installed plug-in (a reward, an environment) raised, hung past its bound, or
    answered wrongly: its experiment fails, nothing else (plugins/host.py)."""


class VLLMWorkerError(LoraplexError, RuntimeError):
    """The vLLM worker failed a request, or died."""


class AdapterError(LoraplexError, ValueError):
    """A bad adapter request (config, name, slot)."""


class RankTooLargeError(AdapterError):
    """The adapter's rank exceeds the engine's max rank."""


class UnknownTargetModuleError(AdapterError):
    """The adapter targets a module the engine did not wrap."""


class NoFreeSlotError(AdapterError):
    """All adapter slots are taken."""


class DuplicateAdapterError(AdapterError):
    """An adapter with that name is already loaded."""


class UnknownAdapterError(AdapterError):
    """No adapter with that name is loaded."""


class RoutingError(LoraplexError, ValueError):
    """Slot ids that do not fit the batch or name an empty slot."""


class CheckpointError(LoraplexError, ValueError):
    """A checkpoint that is missing, corrupt, or does not fit the model."""


class UsageError(LoraplexError, ValueError):
    """A mistake on the command line outside any spec: a file or model directory that is
    not there, a flag out of range. ``loraplex-engine`` prints it on one line, exit 2."""


class Interrupted(LoraplexError):
    """A signal that stops a command now (``run``: nothing to checkpoint yet, or asked
    twice); its exit status is the shell's for a signal, 128 + its number."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


class CapacityError(UsageError):
    """The engine's configuration does not fit its device's memory (memory/capacity_plan.py)."""


class RankFailed(LoraplexError, RuntimeError):
    """A worker rank exited, or would not start or stop, while rank 0 needed it
    (parallel/launch.py)."""


# --- API errors -----------------------------------------------------------------------


class ApiError(LoraplexError):
    """An error a client caused: a stable ``code``, a message and the field at fault."""

    code = "invalid_request"

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class UnauthorizedError(ApiError):
    """Missing or wrong bearer token."""

    code = "unauthorized"


class NotFoundError(ApiError):
    """Unknown experiment or model."""

    code = "not_found"


class ConflictError(ApiError):
    """A different spec for a loaded id, or a checkpoint of a failed experiment."""

    code = "conflict"


class NoCapacityError(ApiError):
    """No free adapter slot."""

    code = "no_capacity"


class NamespaceShareError(NoCapacityError):
    """A namespace holds its share of the engine's slots for client models
    (clients/share.py): refused, not waited for, so its client learns the limit."""

    code = "namespace_share"


class BodyTooLargeError(ApiError):
    """A request body over the server's limit."""

    code = "too_large"


class InvalidRequestError(ApiError):
    """A field of the request outside ``spec`` is invalid (``runId``, say)."""

    code = "invalid_request"


class InvalidSpecError(ApiError):
    """A spec the engine cannot take; ``field`` names the spec path."""

    code = "invalid_spec"


class BadCheckpointError(ApiError):
    """``resumeFrom`` is not a usable checkpoint (or belongs to another run than
    ``runId``), or ``runId``'s checkpoints are there but none loads."""

    code = "bad_checkpoint"


class UnavailableError(ApiError):
    """The engine is still loading (or its loop has stopped)."""

    code = "unavailable"


class CheckpointQuotaError(CheckpointError):
    """A checkpoint would take a namespace past its share of the checkpoint volume: the
    experiment writing it fails, its neighbours do not."""


class StorageFullError(CheckpointError):
    """The checkpoint volume itself is full (ENOSPC) for a namespace within its quota:
    the engine's condition, not the tenant's fault; the write is retried."""


class ExchangeError(LoraplexError):
    """Why a reward exchange failed (tenancy/reward_exchange.py), in words that carry
    nothing of the answer; tasks/rewards.py reports it as the experiment's RewardError."""


# --- the Tinker protocol's own errors (server/tinker/): statuses outside the engine API -------


class ProtocolError(LoraplexError):
    """An error only the Tinker routes answer (/api/v1, server/tinker/errors.py), with its own
    HTTP ``status``: not an :class:`ApiError`, so the engine API's documented codes and
    statuses stay as they are."""

    status = 400
    code = "invalid_request"

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class TooManyRequests(ProtocolError):
    """The Tinker future table is full: 429, which the SDK backs off from and retries."""

    status = 429
    code = "too_many_requests"


class SessionGone(ProtocolError):
    """A Tinker session that was closed, or expired without heartbeats: 410, on which the
    SDK stops its heartbeat."""

    status = 410
    code = "gone"


class KeyFileError(LoraplexError, ValueError):
    """A --tinker-keys source that does not parse: every problem, one per line."""
