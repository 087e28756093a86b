"""A verifiers environment whose episode never returns after the policy's first turn
(its ``Env.run`` sleeps): the engine's --plugin-timeout stops it."""

import time

import verifiers.v1 as vf


class HangsTaskset(vf.Taskset[vf.Task]):
    def load(self):
        yield vf.Task(vf.TaskData(prompt="anything"))


class HangsConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()


class HangsEnv(vf.Env[HangsConfig]):
    async def run(self, task, agents) -> None:
        await agents.agent.run(task)
        time.sleep(3600)  # blocks the worker's event loop: nothing answers


__all__ = ["HangsEnv", "HangsTaskset"]
