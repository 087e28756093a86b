"""The Tinker protocol (``/api/v1``) over :mod:`loraplex_engine.spec.training_service`: the
official ``tinker`` SDK trains, saves and samples LoRA adapters on this engine unchanged
(docs/design/tinker-protocol.md)."""
