"""A reward function installed as a plug-in (entry-point group ``loraplex.rewards``).

TRL's convention, so a function written for TRL works unchanged::

    def reward(prompts, completions, **columns) -> list[float | None]

``columns`` are the task's columns by name: ``answer`` (every task's), and a dataset
row's others where the task has them. ``None`` means the function has no score for that
completion (TRL's convention for a function that does not apply): it counts as 0. The
call runs in the experiment's plug-in worker with a wall-clock bound (host.py); a
raise, a hang, a wrong count, a non-number or a non-finite score fails the experiment.
"""

from __future__ import annotations

from collections.abc import Sequence

from loraplex_engine.plugins.host import PluginHost
from loraplex_engine.spec.errors import RewardError
from loraplex_engine.tasks.rewards import RewardItem, check_score


class PluginReward:
    def __init__(self, name: str, host: PluginHost) -> None:
        self.name, self.host = name, host

    def score(self, items: Sequence[RewardItem]) -> list[float]:
        if not items:
            return []
        columns: dict[str, list[str]] = {"answer": [it.answer for it in items]}
        for key in sorted({k for it in items for k in it.columns}):
            columns.setdefault(key, [it.columns.get(key, "") for it in items])
        request = {
            "op": "reward",
            "name": self.name,
            "prompts": [it.prompt for it in items],
            "completions": [it.completion for it in items],
            "columns": columns,
        }
        scores = self.host.call(f"reward plug-in {self.name}", request)["scores"]
        if len(scores) != len(items):
            raise RewardError(
                f"reward plug-in {self.name}: {len(scores)} scores for {len(items)} completions"
            )
        where = f"plug-in {self.name}"
        return [0.0 if s is None else check_score(s, i, where) for i, s in enumerate(scores)]

    def close(self) -> None:
        self.host.close()
