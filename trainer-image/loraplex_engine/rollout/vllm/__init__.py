"""The vLLM rollout: a worker process in vLLM's environment, its config, placement, requests and
weight sync.
"""
