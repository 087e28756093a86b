"""A model call submitted to the engine (spec/training_service.py's typed calls), checked
and turned into the op its queue holds (clients/ops.py): its kind and payload. A refused
call raises here, naming its field, before anything is queued."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from loraplex_engine.clients import saved
from loraplex_engine.clients.checkpoints import check_ttl
from loraplex_engine.clients.inputs import Limits, check_data, check_loss
from loraplex_engine.clients.ops import OpKind
from loraplex_engine.spec.errors import AdapterError, InvalidRequestError
from loraplex_engine.spec.training_service import (
    Forward,
    LoadState,
    ModelCall,
    OptimStep,
    SaveState,
)
from loraplex_engine.train.optim import AdamWSettings


def queued_call(
    call: ModelCall, limits: Limits, state_of: Callable[[saved.StatePath], object]
) -> tuple[OpKind, Any]:
    """The op's kind and payload; ``state_of`` finds a saved state of the caller's
    namespace (``NotFoundError`` otherwise)."""
    if isinstance(call, Forward):
        token_loss = check_loss(call.loss)
        checked = check_data(call.data, token_loss, limits)
        kind: OpKind = "forward_backward" if call.backward else "forward"
        return kind, (checked, token_loss, call.backward)
    if isinstance(call, OptimStep):
        return "optim_step", adam_settings(call)
    if isinstance(call, SaveState):
        if not saved.valid_name(call.name):
            raise InvalidRequestError(f"{call.name!r} is not a valid name", field="path")
        if call.kind not in saved.KINDS:
            raise InvalidRequestError(f"kind must be one of {list(saved.KINDS)}", field="kind")
        return "save_state", (call.name, call.kind, check_ttl(call.ttl_s))
    if isinstance(call, LoadState):
        state_of(saved.parse_path(call.path))
        return "load_state", (call.path, call.with_optimizer)
    return "unload", call.save


def adam_settings(call: OptimStep) -> AdamWSettings:
    adam = call.adam
    try:
        return AdamWSettings(
            lr=adam.learning_rate,
            betas=(adam.beta1, adam.beta2),
            eps=adam.eps,
            weight_decay=adam.weight_decay,
            max_grad_norm=adam.grad_clip_norm if adam.grad_clip_norm > 0 else None,
        )
    except AdapterError as e:
        raise InvalidRequestError(str(e), field="adam_params") from e
