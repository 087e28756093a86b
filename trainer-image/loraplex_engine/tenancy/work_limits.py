"""What one experiment's step and one completion may cost, checked before either is
admitted (an experiment at PUT, a completion when its request arrives), so that one
tenant cannot stall the others: a step's rows, and a completion's, ride in one tick.
Every row's prompt is at most the prompt limit (the tick refuses longer ones), so a
step's cost is bounded before it runs. Pure: the limits are the engine's flags and its
base model's context."""

from __future__ import annotations

from dataclasses import dataclass

from loraplex_engine.spec.errors import InvalidRequestError, InvalidSpecError, TaskError
from loraplex_engine.spec.experiment import ExperimentSpec
from loraplex_engine.tokens import TokenCodec

# An expensive experiment takes about 1 / (1 + EXPENSIVE_YIELD) of a cheap co-tenant's
# ticks' time: 3 keeps the co-tenant near 75% of its pace alone (the target: 70%).
EXPENSIVE_YIELD = 3

# A prompt over this many characters per token of the prompt limit is refused before it is
# tokenised: tokenising a 20 MB line took 4.5 GB (issue 26). Tokens of over 32 characters
# are rare in any vocabulary, so no prompt that fits the limit is refused by it.
PROMPT_CHARS_PER_TOKEN = 32


@dataclass(frozen=True)
class WorkLimits:
    """The engine's limits (serve --max-prompt-tokens, --max-step-tokens) and its base
    model's context (``max_position_embeddings``; None: not stated)."""

    max_prompt_tokens: int
    max_step_tokens: int
    context_tokens: int | None

    def check_step(self, spec: ExperimentSpec) -> int:
        """A step's cost, prompts included, is bounded before it is admitted: every row's
        prompt is at most max_prompt_tokens and every row at most the context (the tick
        refuses longer ones). Returns that bound, its eval's rows included."""
        alg, new_tokens = spec.algorithm, spec.rollout.max_new_tokens
        if self.context_tokens is not None and new_tokens >= self.context_tokens:
            raise InvalidSpecError(
                f"maxNewTokens {new_tokens} leaves no room for a prompt in the base model's "
                f"context of {self.context_tokens} tokens",
                field="spec.rollout.maxNewTokens",
            )
        rows = alg.group_size * alg.prompts_per_step
        env = spec.task.environment  # an episode's row: its prompt and all its turns
        added = new_tokens if env is None else max(new_tokens, env.max_episode_tokens)
        # A row never outgrows the context: a longer prompt is refused at rollout.
        row = self.max_prompt_tokens + added
        if self.context_tokens is not None:
            row = min(row, self.context_tokens)
        if rows * row > self.max_step_tokens:
            raise InvalidSpecError(
                f"groupSize x promptsPerStep x (prompt limit {self.max_prompt_tokens} + "
                f"maxNewTokens or environment.maxEpisodeTokens, within the context) = "
                f"{rows * row} tokens per step exceeds "
                f"this engine's limit of {self.max_step_tokens} (serve --max-step-tokens); "
                "lower one of them",
                field="spec.algorithm.promptsPerStep",
            )
        ev = spec.evaluation
        # An eval's rows ride in the tick of a step (tick/tick.py): the two together are bounded.
        eval_rows = 0 if ev is None else ev.prompts * ev.samples
        if (rows + eval_rows) * row > self.max_step_tokens:
            raise InvalidSpecError(
                f"a step with its eval, (groupSize x promptsPerStep + eval.prompts x "
                f"eval.samples) x (prompt limit {self.max_prompt_tokens} + maxNewTokens, "
                f"within the context) = {(rows + eval_rows) * row} tokens, exceeds this "
                f"engine's limit of {self.max_step_tokens} (serve --max-step-tokens); "
                "lower one of them",
                field="spec.eval.prompts",
            )
        return (rows + eval_rows) * row

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


def prompt_ids(
    codec: TokenCodec,
    text: str,
    position: str | None,
    chat_template: bool,
    max_prompt_tokens: int,
    context_tokens: int | None,
    new_tokens: int,
) -> list[int]:
    """A task prompt's tokens (the tick's); one over the engine's prompt limit (or the
    model's context) fails its experiment: truncating it would train on a prompt the data
    does not hold, and a row past the context would fail the shared rollout batch.
    ``position``: where in its dataset it is ("line 3", "row 3"), for the message."""
    where = f"dataset {position}" if position else "a prompt"
    max_chars = max_prompt_tokens * PROMPT_CHARS_PER_TOKEN
    if len(text) > max_chars:
        raise TaskError(
            "spec.task.dataset",
            f"{where} has {len(text)} characters, over the {max_chars} a prompt within this "
            f"engine's limit of {max_prompt_tokens} tokens may have (serve --max-prompt-tokens)",
        )
    ids = codec.encode_prompt(text, chat_template)
    if len(ids) > max_prompt_tokens:
        raise TaskError(
            "spec.task.dataset",
            f"{where} has {len(ids)} prompt tokens, over this engine's limit of "
            f"{max_prompt_tokens} (serve --max-prompt-tokens)",
        )
    if context_tokens is not None and len(ids) + new_tokens > context_tokens:
        raise TaskError(
            "spec.task.dataset",
            f"{where} has {len(ids)} prompt tokens: with maxNewTokens {new_tokens} that "
            f"is over the base model's context of {context_tokens}",
        )
    return ids
