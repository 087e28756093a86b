"""Real workloads the engine ships: GSM8K-style math word problems (a seeded generator),
their answer extraction, a ``math-verify`` reward plug-in, and a calculator-tool
environment for the multi-turn variant (docs/workloads.md).

The reward and the environment are first-party plug-ins (entry points in
trainer-image/pyproject.toml): they run in an experiment's plug-in worker, never in the
engine's process.
"""
