"""A verifiers environment whose reward raises: its experiment fails, naming it."""

import verifiers.v1 as vf


class RaisesTask(vf.Task):
    @vf.reward
    async def broken(self, task, trace) -> float:
        raise ValueError("this reward is broken")


class RaisesTaskset(vf.Taskset[RaisesTask]):
    def load(self):
        yield RaisesTask(vf.TaskData(prompt="anything"))


__all__ = ["RaisesTaskset"]
