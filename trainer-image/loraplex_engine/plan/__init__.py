"""An experiment's spec compiled once against the engine's limits (plan/experiment.py):
every engine-side check of a spec in one place, and the typed plan the engine builds from."""
