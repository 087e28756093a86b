"""The shared-prompt-prefix forward of a causal LM, and the models it is exact for.

GRPO trains ``groupSize`` completions of one prompt: ``SharedForward`` runs each group's
prompt once, with gradient, expands its KV cache to the group's rows and runs their
completions on top of it (train/step.py packs and collates the micro-batches that use it,
and says why the gradients are the unshared ones up to rounding). Which model families
and attention settings reproduce the unshared forward exactly is checked here, once,
when the engine loads its base (``prefix_sharing_unsupported``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from loraplex_engine.lora.model import MultiLoRAModel

log = logging.getLogger("loraplex_engine.train.shared_prefix")

# (prefix ids [G,P], prefix mask [G,P], prefix slot_ids [G], group of each row [R],
#  input_ids [R,T], attention_mask [R,P+T], slot_ids [R], position_ids [R,T]) -> logits [R,T,V]
# Runs the G prefixes (right-padded, positions 0..), expands their KV cache to the R rows
# and runs the rows on top of it; see ``shared_prefix_forward``.
SharedForward = Callable[
    [
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
    ],
    torch.Tensor,
]

# Model families whose cached training forward has been checked exact against the
# unshared one (tests/engine/train/test_prefix_share.py, test_model_families.py). Others train
# unshared. Gemma 2 and 3 are not here for the reasons prefix_sharing_unsupported gives.
PREFIX_SHARING_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral", "phi3"})


def shared_forward_of(
    model: MultiLoRAModel, device: torch.device, wanted: bool
) -> SharedForward | None:
    """The engine's shared forward: training then computes each prompt group's prompt
    once per micro-batch; None (said in the log) when not ``wanted`` (asked off, or a
    sharded base) or when the model's cached forward is not known to be exact."""
    if not wanted:
        log.info("prompt-prefix sharing off (share_prompt_prefix=False or a sharded base)")
        return None
    why_not = prefix_sharing_unsupported(model.base_model)
    if why_not is not None:
        log.warning("prompt-prefix sharing off (%s): training recomputes prompts", why_not)
        return None
    return shared_prefix_forward(model, device)


def prefix_sharing_unsupported(base_model: torch.nn.Module) -> str | None:
    """Why ``shared_prefix_forward`` may not be exact for this model; None when it is.

    Checked: no attention logit soft-capping (Gemma 2: eager attention only, and the
    shared forward's mask path is not checked with it), full attention in every layer
    (a sliding-window cache drops old keys: Gemma 2/3's interleaved layers, Mistral
    v0.1's and Phi-3-4k's window on every layer), the model family (its cached forward
    is tested against the unshared one), an attention
    implementation whose mask follows the 2-D padding mask over cache + new tokens
    (sdpa, eager), and no gradient checkpointing (which turns the cache off in training).
    """
    config = getattr(base_model, "config", None)
    obstacle = _attention_obstacle(config)
    model_type = getattr(config, "model_type", None)
    if model_type not in PREFIX_SHARING_MODEL_TYPES:
        checked = ", ".join(sorted(PREFIX_SHARING_MODEL_TYPES))
        why = f"model type {model_type!r} is not among the checked ones ({checked})"
        return f"{why}; {obstacle}" if obstacle else why
    if obstacle:
        return obstacle
    attn = getattr(config, "_attn_implementation", None)
    if attn not in ("sdpa", "eager"):
        return f"attention implementation {attn!r} (sdpa and eager are supported)"
    checkpointing = getattr(base_model, "is_activation_checkpointing", None)  # transformers 5
    if checkpointing is None:
        checkpointing = getattr(base_model, "is_gradient_checkpointing", False)
    if checkpointing:
        return "gradient checkpointing disables the KV cache in training"
    return None


def _attention_obstacle(config: object) -> str | None:
    """An attention feature the shared forward does not reproduce, if the config has one."""
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None:
        return f"attention logits are soft-capped ({softcap})"
    layer_types = getattr(config, "layer_types", None)
    if set(layer_types or ["full_attention"]) != {"full_attention"}:
        return f"layer types {sorted(set(layer_types))}: only full attention is supported"
    window = getattr(config, "sliding_window", None)
    if not layer_types and window is not None:
        return f"a sliding window of {window} tokens on every layer"
    return None


def shared_prefix_forward(model: MultiLoRAModel, device: torch.device) -> SharedForward:
    """The ``SharedForward`` of a Hugging Face causal LM wrapped as a ``MultiLoRAModel``.

    1. The prefixes, right-padded, with their slots: positions default to 0.. (right
       padding keeps real tokens in place), ``use_cache`` keeps every layer's keys and
       values with their autograd graph; only the last position's logits are computed
       (``logits_to_keep=1``, unused).
    2. ``DynamicCache.batch_select_indices(row_group)`` expands the cache to the rows
       (an index: its backward sums the rows' gradients into each prefix).
    3. The rows with explicit ``position_ids`` (their prompt's length - 1 onward) and a
       2-D mask over cache + new tokens: transformers builds the causal mask from the
       cache length (queries sit after every cached key) and the padding mask, so a
       short prefix's padding is masked out and its rows see their own prompt only.
    """

    def forward(
        prefix_ids: torch.Tensor,
        prefix_attn: torch.Tensor,
        prefix_slots: torch.Tensor,
        row_group: torch.Tensor,
        ids: torch.Tensor,
        attn: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        prefix = model(
            input_ids=prefix_ids.to(device),
            attention_mask=prefix_attn.to(device),
            slot_ids=prefix_slots.to(device),
            use_cache=True,
            logits_to_keep=1,
        )
        cache = prefix.past_key_values
        cache.batch_select_indices(row_group.to(device))
        out = model(
            input_ids=ids.to(device),
            attention_mask=attn.to(device),
            slot_ids=slots.to(device),
            position_ids=positions.to(device),
            past_key_values=cache,
            use_cache=True,
        )
        return out.logits.float()

    return forward
