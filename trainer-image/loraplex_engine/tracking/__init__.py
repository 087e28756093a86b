"""Experiment tracking: every experiment's step metrics recorded to the pool's MLflow,
Weights & Biases and TensorBoard, off the training path (docs/tracking.md)."""
