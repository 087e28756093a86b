"""loraplex hot engine: one frozen base model, many LoRA adapters trained at once."""

__version__ = "0.1.0"
