"""Measuring a model's memory without its memory: the config cut to its first layers,
and fake tensors that keep the values of small host-built index tensors. The planner and
the engine's capacity plan both measure this way."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

from torch._subclasses import fake_tensor
from transformers import PretrainedConfig

# Host-built index tensors (slot ids, token ids, scored positions) keep their values
# under FakeTensorMode up to this many elements, so the routing's host-side
# bookkeeping (``Routing.build``) runs for real.
CONSTANT_ELEMENTS = 1 << 22


def with_layers(config: PretrainedConfig, layers: int) -> PretrainedConfig:
    """A copy of ``config`` with its first ``layers`` decoder layers."""
    cut = copy.deepcopy(config)
    text = cut.get_text_config()
    text.num_hidden_layers = layers
    kinds = getattr(text, "layer_types", None)
    if isinstance(kinds, list):
        text.layer_types = kinds[:layers]
    return cut


@contextmanager
def keep_index_values() -> Iterator[None]:
    """Under FakeTensorMode, tensors made from host lists keep their values (see
    ``CONSTANT_ELEMENTS``); ops on them only run for real while they stay that small."""
    before = fake_tensor.CONSTANT_NUMEL_LIMIT
    fake_tensor.CONSTANT_NUMEL_LIMIT = CONSTANT_ELEMENTS
    try:
        yield
    finally:
        fake_tensor.CONSTANT_NUMEL_LIMIT = before
