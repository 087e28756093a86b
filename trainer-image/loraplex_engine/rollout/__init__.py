"""Rollout backends: generate completions for many adapters in one batch."""

from loraplex_engine.rollout.types import Completion, RolloutRequest

__all__ = ["Completion", "RolloutRequest"]
