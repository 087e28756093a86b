"""The torch rollout: decoding with the trainer's own model, sampling, KV packing."""
