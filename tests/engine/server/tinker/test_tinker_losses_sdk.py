"""The official tinker SDK against a real ``loraplex-engine serve --tinker-keys``: the
``gspo`` loss (its outputs against Tinker's documented GSPO-token formula, computed here
from the log-probs the engine returns; its inputs checked field by field) and the Dimuon
optimiser, refused with the field named.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from tests.support.server_process import EngineServer, tinker_engine_fixture
from tests.support.tinker_clients import service_client

pytestmark = pytest.mark.slow

KEY = "tml-team-a-0123456789abcdef"
PROMPT = [1, 40, 41, 42]
SAMPLED = [100, 101, 102, 103]


server = tinker_engine_fixture("tinker-losses", {"team-a": KEY})


@pytest.fixture
def client(server: EngineServer) -> Iterator[tinker.ServiceClient]:
    c = service_client(server.url, KEY)
    yield c
    c.close("success").result()


@pytest.fixture(scope="module")
def base(server: EngineServer) -> str:
    r = httpx.get(f"{server.url}/api/v1/get_server_capabilities", headers={"X-API-Key": KEY})
    return r.json()["supported_models"][0]["model_name"]


def rl_datum(sampling_lp: list[float], advantage: float, mask: list[float] | None) -> types.Datum:
    """The cookbook's rl_loop datum: prompt then sampled tokens, zero-padded inputs on the
    prompt, and (for gspo) the sequence ratio over the sampled tokens."""
    ob = len(PROMPT) - 1
    seq = PROMPT + SAMPLED
    inputs = {
        "target_tokens": np.array(seq[1:], np.int64),
        "logprobs": np.array([0.0] * ob + sampling_lp, np.float32),
        "advantages": np.array([0.0] * ob + [advantage] * len(SAMPLED), np.float32),
    }
    if mask is not None:
        inputs["sequence_ratio_mask"] = np.array(mask, np.float32)
    return types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]), loss_fn_inputs=inputs)


def gspo_reference(
    logp: np.ndarray, sampling: np.ndarray, adv: np.ndarray, mask: np.ndarray
) -> np.ndarray:
    """Tinker's GSPO-token value per token (its docs): s = exp(mean over the masked tokens
    of logp - q), loss_t = -min(s A_t, clip(s, 0.8, 1.2) A_t)."""
    s = np.exp(np.mean((logp - sampling)[mask != 0], dtype=np.float64))
    return -np.minimum(s * adv, np.clip(s, 0.8, 1.2) * adv)


def test_gspo_through_the_sdk_matches_the_documented_formula(client, base) -> None:
    tc = client.create_lora_training_client(base_model=base, rank=4, seed=0).result()
    ob = len(PROMPT) - 1
    mask = [0.0] * ob + [1.0] * len(SAMPLED)
    # Off-policy enough that the sequence ratio leaves [0.8, 1.2] for the second datum.
    data = [
        rl_datum([-4.0, -4.1, -3.9, -4.2], 1.5, mask),
        rl_datum([-9.0, -9.5, -8.0, -9.2], -0.7, mask),
    ]
    out = tc.forward(data, "gspo").result()
    for datum, got in zip(data, out.loss_fn_outputs, strict=True):
        logp = got["logprobs"].to_numpy()
        ref = gspo_reference(
            logp,
            datum.loss_fn_inputs["logprobs"].to_numpy(),
            datum.loss_fn_inputs["advantages"].to_numpy(),
            datum.loss_fn_inputs["sequence_ratio_mask"].to_numpy(),
        )
        np.testing.assert_allclose(got["elementwise_loss"].to_numpy(), ref, rtol=1e-5, atol=1e-6)
    # And it trains: forward_backward then optim_step answer.
    tc.forward_backward(data, "gspo").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()


@pytest.mark.parametrize("mask", [None, [0.0] * 7], ids=["absent", "marks-none"])
def test_gspo_names_a_missing_or_empty_sequence_ratio_mask(client, base, mask) -> None:
    tc = client.create_lora_training_client(base_model=base, rank=4, seed=0).result()
    with pytest.raises(
        (tinker.UnprocessableEntityError, tinker.RequestFailedError),
        match=r"data\[0\]\.loss_fn_inputs\.sequence_ratio_mask",
    ):
        tc.forward_backward([rl_datum([-1.0] * 4, 1.0, mask)], "gspo").result()


def test_dimuon_is_refused_naming_the_field_and_why(client, base) -> None:
    with pytest.raises(
        (tinker.UnprocessableEntityError, tinker.RequestFailedError),
        match=r"optimizer_config\.type.*update rule|update rule.*optimizer_config\.type",
    ):
        client.create_lora_training_client(
            base_model=base, rank=4, optimizer=types.DimuonOptimizerConfig()
        ).result()
    tc = client.create_lora_training_client(base_model=base, rank=4, seed=0).result()
    with pytest.raises(
        (tinker.UnprocessableEntityError, tinker.RequestFailedError),
        match=r"optim_params\.type.*update rule|update rule.*optim_params\.type",
    ):
        tc.optim_step(types.DimuonParams(learning_rate=1e-3)).result()
