"""The multi-LoRA layer, its grouped kernel and routing, the wrapped model, precision and gradient
checkpointing.
"""
