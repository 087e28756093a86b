"""Runs and checkpoints on disk."""
