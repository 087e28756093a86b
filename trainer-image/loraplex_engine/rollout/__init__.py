"""Rollout backends: generate completions for many adapters in one batch."""
