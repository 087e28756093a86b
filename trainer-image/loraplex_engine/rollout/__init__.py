"""Rollout backends: generate completions for many adapters in one batch.

Empty on purpose: rollout/preflight.py is imported before torch (the CLI's fast errors).
"""
