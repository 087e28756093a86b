"""The official tinker SDK for tests: its ServiceClient, closed when the test ends
(tests/conftest.py: an open client keeps a heartbeat thread and its event loop alive for
the rest of the pytest process, logging into closed streams once its server is gone), and
the SDK's usual supervised datum."""

from __future__ import annotations

import contextlib

import numpy as np
import tinker
from tinker import types

OPEN: list[tinker.ServiceClient] = []


def service_client(url: str, key: str | None = None) -> tinker.ServiceClient:
    client = tinker.ServiceClient(base_url=url, api_key=key)
    OPEN.append(client)
    return client


def close_all() -> None:
    """Close every client a test opened (a closed or unreachable one is fine)."""
    while OPEN:
        client = OPEN.pop()
        with contextlib.suppress(Exception):
            client.close("success").result(timeout=10)


def sft(prompt: list[int], answer: list[int]) -> types.Datum:
    """Next-token training on ``answer`` after ``prompt``: the SDK's usual datum."""
    seq = prompt + answer
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)
    return types.Datum(
        model_input=types.ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={
            "target_tokens": np.array(seq[1:], dtype=np.int64),
            "weights": np.array(weights, dtype=np.float32),
        },
    )
