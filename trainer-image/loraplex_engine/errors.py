"""Engine error types.

Every error is raised *before* anything changes, so a caller can report it and carry on.
``code`` is the HTTP API error code (docs/engine-api.md) the server should answer with.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class of all loraplex engine errors."""

    code = "invalid_request"


class AdapterError(EngineError, ValueError):
    """A bad adapter request (config, name, slot)."""

    code = "invalid_spec"


class RankTooLargeError(AdapterError):
    """The adapter's rank exceeds the engine's max rank."""


class UnknownTargetModuleError(AdapterError):
    """The adapter targets a module the engine did not wrap."""


class NoFreeSlotError(AdapterError):
    """All adapter slots are taken."""

    code = "no_capacity"


class DuplicateAdapterError(AdapterError):
    """An adapter with that name is already loaded."""

    code = "conflict"


class UnknownAdapterError(AdapterError):
    """No adapter with that name is loaded."""

    code = "not_found"


class RoutingError(EngineError, ValueError):
    """Slot ids that do not fit the batch or name an empty slot."""


class CheckpointError(EngineError, ValueError):
    """A checkpoint that is missing, corrupt, or does not fit the model."""

    code = "bad_checkpoint"
