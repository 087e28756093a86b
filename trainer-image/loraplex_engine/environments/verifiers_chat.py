"""The verifiers harness loraplex pins on every seat of a verifiers environment it runs:
one chat call per harness segment, made in-process through the rollout's interception
endpoint (verifiers' own contract: "a harness may run its loop in-process ... as long as
every model call goes through endpoint + secret").

Why not the environment's own harness: verifiers' harnesses (``bash``, ``null``, coding
agents) launch a program in a runtime that ``uv`` provisions from PyPI at the rollout's
start, or in a container or a remote sandbox: none of which an engine pod has or should
have. The model's turns stay the engine's either way (verifiers_env.py's client); what
this harness drops is tool execution by a program (the policy's text is its turn).
Multi-turn episodes come from the environment (``Env.run`` driving an
``interaction()``: user turns, feedback), each segment one call on the whole
conversation (``SUPPORTS_RESUME``). Runs in the plug-in worker only (imports verifiers).
"""

from __future__ import annotations

from openai import AsyncOpenAI
from verifiers.v1.configs.harness import HarnessConfig
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harness import Harness
from verifiers.v1.runtimes import ProgramResult

# The name verifiers' loader imports this harness by (a top-level module: its loader
# cannot import a dotted id); verifiers_env.py registers this module under it.
HARNESS_ID = "loraplex_verifiers_chat"

__all__ = ["ChatHarness"]


class ChatHarness(Harness[HarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True  # the system prompt as a message, not folded in
    SUPPORTS_RESUME = True  # a later segment relaunches on the whole conversation
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(
        self,
        ctx,
        trace,
        runtime,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data,
        tool_interception_url: str | None = None,
    ) -> ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages: list[dict] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt is not None:
            messages += [message_to_wire(m) for m in prompt]
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            reply = await client.chat.completions.create(model=ctx.model, messages=messages)
        return ProgramResult(0, reply.choices[0].message.content or "", "")
