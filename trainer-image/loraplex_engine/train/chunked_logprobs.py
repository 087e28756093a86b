"""Log-probs of the sampled tokens, chunk by chunk from the final hidden states.

The plain path (``_logprobs`` in train/step.py) materialises ``[rows, tokens, vocab]``
logits, an fp32 copy, a temperature-scaled copy and the log-softmax; for Qwen3-4B
(vocab 151,936) that is 0.6 MB per token per copy. Here only the positions whose
log-prob the loss reads (completion tokens) go through the output head, ``chunk_tokens``
of them at a time, each chunk's logits in fp32, and nothing vocabulary-sized outlives
its chunk:

- a frozen ``nn.Linear`` head (the usual case): ``_FrozenHeadLogprobs`` computes, in the
  forward, each token's log-prob and its gradient with respect to the hidden state
  (``(onehot - softmax) W / T``; the head's weight needs none), so the backward is one
  ``[tokens, hidden]`` multiply: no logits are kept or recomputed;
- any other head (one with trainable weights, e.g. ``lm_head`` targeted by an adapter):
  each chunk is checkpointed, so its logits are recomputed in the backward. A multi-LoRA
  head is routed per token (each scored token carries its row's slot), inside the
  checkpointed function, so the recompute runs under the same routing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from loraplex_engine.lora.layers import MultiLoRALinear
from loraplex_engine.lora.model import MultiLoRAModel
from loraplex_engine.lora.routing import Router

DEFAULT_CHUNK_TOKENS = 1024

# Config fields of families whose head output is transformed before the softmax
# (Gemma 2 soft-capping, Cohere/Granite scaling): the chunked head would miss it.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


class _FrozenHeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        inv_temp: Tensor,
        chunk: int,
    ) -> Tensor:
        want_grad = ctx.needs_input_grad[0]  # type: ignore[attr-defined]
        out = hidden.new_empty(hidden.shape[0], dtype=torch.float32)
        grad = torch.empty_like(hidden) if want_grad else None
        for start in range(0, hidden.shape[0], chunk):
            part = slice(start, start + chunk)
            z = F.linear(hidden[part], weight, bias).float()
            z.mul_(inv_temp[part, None])
            lse = torch.logsumexp(z, dim=-1)
            out[part] = z.gather(1, targets[part, None]).squeeze(1) - lse
            if grad is not None:
                # d logp / d z = onehot - softmax; d z / d h = W / T.
                p = z.sub_(lse[:, None]).exp_()
                p.scatter_add_(1, targets[part, None], p.new_full((p.shape[0], 1), -1.0))
                p.mul_(-inv_temp[part, None])
                grad[part] = (p.to(weight.dtype) @ weight).to(hidden.dtype)
        ctx.save_for_backward(grad)
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, upstream: Tensor):  # type: ignore[override]
        (grad,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return (grad * upstream[:, None].to(grad.dtype), None, None, None, None, None)


def _chunk_logprobs(
    head: nn.Module, hidden: Tensor, targets: Tensor, inv_temp: Tensor, slots: Tensor | None
) -> Tensor:
    z = _routed_head(head, hidden, slots).float() * inv_temp[:, None]
    return z.gather(1, targets[:, None]).squeeze(1) - torch.logsumexp(z, dim=-1)


def _routed_head(head: nn.Module, hidden: Tensor, slots: Tensor | None) -> Tensor:
    """``head(hidden)``; a multi-LoRA head with one slot id per token of ``hidden``."""
    if slots is None or not isinstance(head, MultiLoRALinear):
        return head(hidden)
    previous, head.router = head.router, Router(slots, head.ranks())
    try:
        return head(hidden)
    finally:
        head.router = previous


def _adapts(head: MultiLoRALinear, slots: Tensor | None) -> bool:
    """Some row's adapter targets the multi-LoRA ``head`` (one host sync of ``B`` ids)."""
    return slots is not None and any(head.rank_of(s) for s in set(slots.tolist()))


def _is_frozen_linear(head: nn.Module) -> bool:
    return type(head) is nn.Linear and not any(p.requires_grad for p in head.parameters())


def chunked_token_logprobs(
    hidden: Tensor,
    head: nn.Module,
    targets: Tensor,
    inv_temp: Tensor,
    scored: Tensor,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    slots: Tensor | None = None,
) -> Tensor:
    """fp32 ``log softmax(head(hidden) / T)[target]`` at the ``scored`` positions, 0 elsewhere.

    ``hidden [B, T, H]``, ``targets [B, T]``, ``inv_temp [B]`` (1 / temperature per row),
    ``scored [N]``: flat indices into ``B * T`` (built on the host, so no data-dependent
    ``nonzero``), ``slots [B]``: each row's adapter slot, for a multi-LoRA head. Returns
    ``[B, T]``.
    """
    rows, width = targets.shape
    flat = hidden.reshape(rows * width, hidden.shape[-1])[scored]
    picked = targets.reshape(-1)[scored]
    row_of = torch.div(scored, width, rounding_mode="floor")
    temps = inv_temp.to(torch.float32)[row_of]
    token_slots = None if slots is None else slots[row_of]
    if isinstance(head, MultiLoRALinear) and not _adapts(head, slots):
        head, token_slots = head.base_layer, None  # no adapter here: the frozen path
    if _is_frozen_linear(head):
        lp = _FrozenHeadLogprobs.apply(
            flat, head.weight, head.bias, picked, temps, max(1, chunk_tokens)
        )
    else:
        parts = [
            checkpoint(
                _chunk_logprobs,
                head,
                flat[s : s + chunk_tokens],
                picked[s : s + chunk_tokens],
                temps[s : s + chunk_tokens],
                None if token_slots is None else token_slots[s : s + chunk_tokens],
                use_reentrant=False,
            )
            for s in range(0, flat.shape[0], max(1, chunk_tokens))
        ]
        lp = torch.cat(parts) if parts else flat.new_zeros(0, dtype=torch.float32)
    out = torch.zeros(rows * width, dtype=torch.float32, device=hidden.device)
    return out.index_copy(0, scored, lp).view(rows, width)


@dataclass
class HiddenStatesForward:
    """The policy's forward up to the final hidden states, plus its output head.

    Pass it to ``training.fused_backward`` in place of a logits-returning forward: the
    log-probs are then computed by ``chunked_token_logprobs``. Calls with ``use_cache``
    off: a training forward keeps no KV cache (with checkpointing, one would keep every
    layer's keys and values alive).
    """

    model: MultiLoRAModel
    device: torch.device
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS

    def __post_init__(self) -> None:
        config = getattr(self.model.base_model, "config", None)
        for name in _LOGIT_TRANSFORMS:
            if getattr(config, name, None) not in (None, 1, 1.0):
                raise ValueError(f"chunked log-probs: config.{name} is not supported")

    @property
    def head(self) -> nn.Module:
        return self.model.base_model.get_output_embeddings()

    def __call__(self, ids: Tensor, attn: Tensor, slots: Tensor) -> Tensor:
        decoder = self.model.base_model.base_model  # the causal LM's body (``.model``)
        with self.model.route(slots.to(self.device)):
            out = decoder(
                input_ids=ids.to(self.device), attention_mask=attn.to(self.device), use_cache=False
            )
        return out.last_hidden_state
