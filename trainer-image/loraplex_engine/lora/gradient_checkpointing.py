"""Gradient checkpointing of a ``MultiLoRAModel`` whose routing survives the recompute.

``MultiLoRAModel.route`` sets each multi-LoRA layer's router only for the duration of a
forward. A checkpointed decoder layer recomputes its forward during ``backward``, when no
router is set: the recompute would run the base alone and the gradient would be wrong
(torch's non-reentrant checkpoint notices the different saved tensors and raises).

So the routing travels with the activations: torch's non-reentrant checkpoint takes a
``context_fn`` called at each checkpointed forward, returning one context for the forward
and one for its recompute. Ours captures the router active at the forward and puts it
back on every layer around the recompute (and restores whatever was set before).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from loraplex_engine.lora.model import MultiLoRAModel
from loraplex_engine.lora.routing import Router


@contextmanager
def _routed(model: MultiLoRAModel, router: Router | None) -> Iterator[None]:
    layers = list(model.lora_layers.values())
    before = [layer.router for layer in layers]
    for layer in layers:
        layer.router = router
    try:
        yield
    finally:
        for layer, previous in zip(layers, before, strict=True):
            layer.router = previous


def routing_context_fn(
    model: MultiLoRAModel,
) -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
    """``context_fn`` for ``torch.utils.checkpoint``: (forward context, recompute context)."""
    # Every layer shares the one Router of the current ``route`` block.
    router = next(iter(model.lora_layers.values())).router
    return nullcontext(), _routed(model, router)


def _checkpoint_layers(base: nn.Module) -> list[nn.Module]:
    """The modules transformers checkpoints (its decoder layers)."""
    return [m for m in base.modules() if isinstance(m, GradientCheckpointingLayer)]


@contextmanager
def gradient_checkpointing(model: MultiLoRAModel, enabled: bool = True) -> Iterator[None]:
    """Within the block, every decoder layer of the base is checkpointed (non-reentrant).

    transformers checkpoints a layer only while that layer is in training mode; the
    engine keeps its model in eval mode (no dropout), so only the decoder layers' own
    ``training`` flag is set, not their children's (LoRA and attention dropout stay off).
    """
    if not enabled:
        yield
        return
    base = model.base_model
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(base).__name__} does not support gradient checkpointing")
    kwargs = {"use_reentrant": False, "context_fn": lambda: routing_context_fn(model)}
    enable = getattr(base, "activation_checkpointing_enable", None)
    if enable is not None:  # transformers >= 5.x names it so
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    # Input grads are for the reentrant variant only: they would add a backward through
    # the first layer's frozen weights for nothing.
    if hasattr(base, "disable_input_require_grads"):
        base.disable_input_require_grads()
    layers = _checkpoint_layers(base)
    modes = [layer.training for layer in layers]
    for layer in layers:
        layer.training = True
    try:
        yield
    finally:
        for layer, mode in zip(layers, modes, strict=True):
            layer.training = mode
        disable = getattr(base, "activation_checkpointing_disable", None)
        (disable or base.gradient_checkpointing_disable)()
