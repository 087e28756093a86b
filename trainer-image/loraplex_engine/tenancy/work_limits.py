"""What one experiment's step and one completion may cost, checked before either is
admitted (an experiment at PUT, a completion when its request arrives), so that one
tenant cannot stall the others: a step's rows, and a completion's, ride in one tick.
Every row's prompt is at most the prompt limit (the tick refuses longer ones), so a
step's cost is bounded before it runs. Pure: the limits are the engine's flags and its
base model's context."""

from __future__ import annotations

from dataclasses import dataclass

from loraplex_engine.errors import InvalidRequestError, InvalidSpecError
from loraplex_engine.spec import ExperimentSpec


@dataclass(frozen=True)
class WorkLimits:
    """The engine's limits (serve --max-prompt-tokens, --max-step-tokens) and its base
    model's context (``max_position_embeddings``; None: not stated)."""

    max_prompt_tokens: int
    max_step_tokens: int
    context_tokens: int | None

    def check_step(self, spec: ExperimentSpec) -> None:
        """A step's cost, prompts included, is bounded before it is admitted: every row's
        prompt is at most max_prompt_tokens (the tick refuses longer ones)."""
        alg, new_tokens = spec.algorithm, spec.rollout.max_new_tokens
        if self.context_tokens is not None and new_tokens >= self.context_tokens:
            raise InvalidSpecError(
                f"maxNewTokens {new_tokens} leaves no room for a prompt in the base model's "
                f"context of {self.context_tokens} tokens",
                field="spec.rollout.maxNewTokens",
            )
        rows = alg.group_size * alg.prompts_per_step
        work = rows * (self.max_prompt_tokens + new_tokens)
        if work > self.max_step_tokens:
            raise InvalidSpecError(
                f"groupSize x promptsPerStep x (prompt limit {self.max_prompt_tokens} + "
                f"maxNewTokens) = {work} tokens per step exceeds this engine's limit of "
                f"{self.max_step_tokens} (serve --max-step-tokens); lower one of them",
                field="spec.algorithm.promptsPerStep",
            )

    def check_completion(self, prompt_tokens: int, max_tokens: int, n: int) -> None:
        """A completion rides in a tick's rollout batch: the same limits as a step."""
        if prompt_tokens > self.max_prompt_tokens:
            raise InvalidRequestError(
                f"prompt has {prompt_tokens} tokens, over this engine's limit of "
                f"{self.max_prompt_tokens} (serve --max-prompt-tokens)",
                field="prompt",
            )
        if self.context_tokens is not None and prompt_tokens + max_tokens > self.context_tokens:
            raise InvalidRequestError(
                f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the base "
                f"model's context of {self.context_tokens} tokens",
                field="max_tokens",
            )
        work = n * (prompt_tokens + max_tokens)
        if work > self.max_step_tokens:
            raise InvalidRequestError(
                f"n x (prompt + max_tokens) = {work} tokens exceeds this engine's limit of "
                f"{self.max_step_tokens} (serve --max-step-tokens)",
                field="n",
            )
