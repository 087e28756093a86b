"""A multi-turn verifiers environment: the policy answers, the environment (its
``Env.run``, the user's seat) says "wrong, try again" as a user turn until the answer
is right or three turns are played; the task's ``@reward`` scores the last reply.
Params: ``feedback`` (the user's words, a field of the taskset's config)."""

import verifiers.v1 as vf


class GuessData(vf.TaskData):
    answer: str = ""


class GuessTask(vf.Task[GuessData]):
    @vf.reward
    async def says_answer(self, task, trace) -> float:
        return 1.0 if task.answer and task.answer in trace.last_reply else 0.0


class GuessTasksetConfig(vf.TasksetConfig):
    feedback: str = "wrong, try again:"


class GuessTaskset(vf.Taskset[GuessTask, GuessTasksetConfig]):
    def load(self):
        for i, answer in enumerate(["yes", "no", "maybe"]):
            yield GuessTask(GuessData(prompt=f"row {i}: say {answer}", answer=answer))


class GuessConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()


class GuessEnv(vf.Env[GuessConfig]):
    async def run(self, task, agents) -> None:
        async with agents.agent.interaction(task) as chat:
            segment = await chat.turn()
            for _ in range(2):
                if segment.terminated or task.data.answer in segment.last_reply:
                    break
                segment = await chat.turn(self.taskset.config.feedback)


__all__ = ["GuessEnv", "GuessTaskset"]
