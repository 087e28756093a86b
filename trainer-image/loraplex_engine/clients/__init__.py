"""Models a client trains itself (the Tinker protocol, spec/training_service.py), on the
engine's own slots, tick and run store: docs/design/client-training.md."""
