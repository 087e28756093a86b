"""Real workloads the engine ships as plug-ins: a ``math-verify`` reward and a
calculator-tool environment for the multi-turn variant (docs/workloads.md). The GSM8K-style
problems they score (a seeded generator, tasks/gsm8k_problems.py) and their answer
extraction (tasks/math_answer.py) are the ``gsm8k`` task's, below them.

The reward and the environment are first-party plug-ins (entry points in
trainer-image/pyproject.toml): they run in an experiment's plug-in worker, never in the
engine's process.
"""
