"""Rollout backends: generate completions for many adapters in one batch."""

from loraplex_engine.rollout.base import Completion, RolloutRequest

__all__ = ["Completion", "RolloutRequest"]
