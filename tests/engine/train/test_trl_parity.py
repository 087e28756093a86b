"""Numerical parity with TRL's GRPO loss on the settings both have: the same per-token
log-probs, old and reference log-probs, advantages and masks give the same loss and the
same gradient through our fused step (train/step.py's weighting over micro-batches) as
through TRL's own ``GRPOTrainer._compute_loss`` (trl 1.16.0, a dev requirement).

TRL's method is called unbound on a host object holding what it reads of its trainer:
the settings (copied from a real ``GRPOConfig`` as ``GRPOTrainer.__init__`` copies them)
and single-process stand-ins for its accelerator and metrics. Its
``_get_per_token_logps_and_entropies`` (the model forward) is replaced by the given
log-probs: the loss maths under test is all TRL's own code; building a whole trainer
would add a model forward both sides share and compare nothing more.

Settings mapped (ours → TRL): ``lossAggregation`` seq-mean-token-mean / token-mean /
seq-mean-token-sum-norm → ``loss_type`` grpo / dapo / dr_grpo; ``clip``/``clipHigh`` →
``epsilon``/``epsilon_high``; ``importanceSamplingLevel`` → the same; ``klCoef`` (k3) →
``beta`` with ``use_bias_correction_kl=False`` (TRL's default multiplies the KL by the
ratio, DeepSeek-V3.2's correction, which we do not offer); TIS →
``vllm_importance_sampling_correction`` with its ratio given. The overlong
shaping is compared with TRL's ``get_soft_overlong_punishment``. Not compared: the
advantages with std scaling (TRL: sample std + 1e-4; ours: population std + 1e-6, on
purpose, docs/design/rl.md) and TRL's bnpo (a per-micro-batch mean we do not offer).

Tolerance: fp64 runs agree to 1e-12 relative (n ≤ 100 terms summed in another order:
n · 2^-53 ≈ 1e-14); fp32 to 1e-5 (n · 2^-24 ≈ 6e-6 for n = 100, the bound on a
reordered sum of same-sign terms).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
from loraplex_engine.spec.experiment import AlgorithmSpec
from loraplex_engine.train.algorithms import build_algorithm, tis_weights
from loraplex_engine.train.rows import TrainRow
from loraplex_engine.train.step import TrainStats, _micro_batch_loss

trl = pytest.importorskip("trl", minversion="1.16.0")
from trl import GRPOConfig  # noqa: E402
from trl.rewards import get_soft_overlong_punishment  # noqa: E402
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402

# GRPOConfig sets transformers' deprecated gradient_checkpointing field itself.
pytestmark = pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated")
B, T, MAX_NEW = 6, 12, 16
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


class _Accelerator:
    """One process: reductions and gathers are the identity."""

    num_processes = 1
    sync_gradients = True

    def reduce(self, t: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return t

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        return t

    gather_for_metrics = gather


class _TRLHost:
    """What ``GRPOTrainer._compute_loss`` reads of ``self``, set from a real GRPOConfig the
    way ``GRPOTrainer.__init__`` sets it."""

    def __init__(self, args: GRPOConfig, logprobs: torch.Tensor) -> None:
        self.args = args
        self.loss_type = args.loss_type
        self.epsilon_low = args.epsilon
        self.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
        self.beta = args.beta
        self.importance_sampling_level = args.importance_sampling_level
        self.max_completion_length = args.max_completion_length
        self.use_vllm = args.use_vllm
        self.vllm_importance_sampling_correction = args.vllm_importance_sampling_correction
        self.off_policy_mask_threshold = args.off_policy_mask_threshold
        self.top_entropy_quantile = args.top_entropy_quantile
        self._entropy_bonus_enabled = False
        self.aux_loss_enabled = False
        self.current_gradient_accumulation_steps = args.gradient_accumulation_steps
        self.accelerator = _Accelerator()
        self.model = torch.nn.Module()  # .training: True, TRL's "train" mode
        self._metrics: dict[str, Any] = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._logprobs = logprobs

    def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any) -> tuple:
        return self._logprobs, torch.zeros_like(self._logprobs), None


def _batch(dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """Off-policy on purpose (log-ratios up to ±0.4): both clip sides are active."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([T, 3, 7, 1, 12, 9])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(dtype)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64).to(dtype) * 3 - 0.1
    logp = old + (torch.rand(B, T, generator=g, dtype=torch.float64).to(dtype) - 0.5) * 0.8
    ref = old + (torch.rand(B, T, generator=g, dtype=torch.float64).to(dtype) - 0.5) * 0.6
    behaviour = old + (torch.rand(B, T, generator=g, dtype=torch.float64).to(dtype) - 0.5)
    adv = torch.tensor([1.2, -0.7, 0.4, -1.5, 0.9, -0.3], dtype=dtype)
    return {"mask": mask, "old": old, "logp": logp, "ref": ref, "behaviour": behaviour, "adv": adv}


def _trl(case: dict[str, Any], b: dict[str, torch.Tensor], tmp: Path) -> tuple:
    tis = case.get("offPolicyCorrection") == "tis"
    args = GRPOConfig(
        output_dir=str(tmp),
        report_to="none",
        loss_type=case["loss_type"],
        epsilon=case.get("clip", 0.2),
        epsilon_high=case.get("clipHigh"),
        beta=case.get("klCoef", 0.0),
        importance_sampling_level=case.get("importanceSamplingLevel", "token"),
        max_completion_length=MAX_NEW,
        use_bias_correction_kl=False,  # TRL's default since 1.x; ours is the plain k3 penalty
        use_cpu=True,
    )
    logp = b["logp"].clone().requires_grad_(True)
    host = _TRLHost(args, logp)
    host.use_vllm = tis  # TRL's TIS is its vLLM importance-sampling correction
    host.vllm_importance_sampling_correction = tis
    n = b["mask"].shape[0]
    inputs = {
        "prompt_ids": torch.zeros(n, 1, dtype=torch.long),
        "prompt_mask": torch.ones(n, 1, dtype=torch.long),
        "completion_ids": torch.zeros(n, T, dtype=torch.long),
        "completion_mask": b["mask"],
        "advantages": b["adv"],
        "old_per_token_logps": b["old"],
        "ref_per_token_logps": b["ref"],
        "num_items_in_batch": b["mask"].sum(),
        "importance_sampling_ratio": tis_weights(b["old"], b["behaviour"], case.get("tisCap", 2.0)),
    }
    loss = GRPOTrainer._compute_loss(host, None, inputs)
    loss.backward()
    return loss.detach(), logp.grad


def _ours(case: dict[str, Any], b: dict[str, torch.Tensor], splits: list[int]) -> tuple:
    """Our loss through train/step.py's per-micro-batch loss and 1/rows weighting, the
    batch cut into micro-batches at ``splits``; the gradient summed over them."""
    spec = {k: v for k, v in case.items() if k != "loss_type"}
    algorithm = build_algorithm(AlgorithmSpec.model_validate(spec), MAX_NEW)
    lengths = [int(x) for x in b["mask"].sum(dim=1)]
    loss_fn = algorithm.loss.for_step(lengths)
    logp = b["logp"].clone().requires_grad_(True)
    total = torch.zeros((), dtype=logp.dtype)
    n = logp.shape[0]
    for lo, hi in zip([0, *splits], [*splits, n], strict=True):
        rows = [TrainRow("e", 1, [0], [0] * lengths[i], [], 0.0, 1.0) for i in range(lo, hi)]
        batch = {
            "old": b["old"][lo:hi],
            "adv": b["adv"][lo:hi],
            "mask": b["mask"][lo:hi],
            "behaviour": b["behaviour"][lo:hi],
        }

        def logprobs_of(batch_: dict[str, torch.Tensor], lo: int = lo, hi: int = hi) -> Any:
            # The reference forward runs under no_grad with slot 0: the base's log-probs.
            return logp[lo:hi] if torch.is_grad_enabled() else b["ref"][lo:hi]

        stats = TrainStats()
        total = total + _micro_batch_loss(
            logprobs_of, rows, batch, {"e": loss_fn}, {"e": 1.0 / n}, stats
        )
    total.backward()
    return total.detach(), logp.grad


CASES = {
    "grpo": {"loss_type": "grpo"},
    "grpo-kl": {"loss_type": "grpo", "klCoef": 0.05},
    "dr_grpo": {"loss_type": "dr_grpo", "lossAggregation": "seq-mean-token-sum-norm"},
    "dapo": {
        "loss_type": "dapo",
        "lossAggregation": "token-mean",
        "clip": 0.2,
        "clipHigh": 0.28,
    },
    "gspo": {
        "loss_type": "grpo",
        "importanceSamplingLevel": "sequence",
        "clip": 0.03,
        "clipHigh": 0.04,
    },
    "gspo-token-mean-kl": {
        "loss_type": "dapo",
        "lossAggregation": "token-mean",
        "importanceSamplingLevel": "sequence",
        "clip": 0.05,
        "klCoef": 0.1,
    },
    "grpo-tis-kl": {
        "loss_type": "grpo",
        "offPolicyCorrection": "tis",
        "tisCap": 1.5,
        "klCoef": 0.02,
    },
    "dr_grpo-tis": {
        "loss_type": "dr_grpo",
        "lossAggregation": "seq-mean-token-sum-norm",
        "offPolicyCorrection": "tis",
    },
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("name", sorted(CASES))
def test_loss_and_gradient_match_trls(name: str, dtype: torch.dtype, tmp_path: Path) -> None:
    case = CASES[name]
    b = _batch(dtype, seed=sorted(CASES).index(name))
    want_loss, want_grad = _trl(case, b, tmp_path)
    for splits in ([], [2], [1, 4]):  # one micro-batch, or several: the same loss
        loss, grad = _ours(case, b, splits)
        tol = TOL[dtype]
        assert loss.item() == pytest.approx(want_loss.item(), rel=tol, abs=tol), splits
        scale = want_grad.abs().max().item()
        assert (grad - want_grad).abs().max().item() <= tol * scale, splits
    assert want_grad.abs().max() > 0  # the comparison is not of two zeros


def test_the_cases_clip_on_both_sides() -> None:
    """Guards the parity cases against a batch where the clip never acts."""
    b = _batch(torch.float64, seed=0)
    ratio = torch.exp(b["logp"] - b["old"])[b["mask"] > 0]
    assert (ratio > 1.28).any() and (ratio < 0.8).any()


def test_overlong_shaping_matches_trls_soft_punishment() -> None:
    algorithm = build_algorithm(
        AlgorithmSpec.model_validate({"overlong": {"bufferTokens": 5}}), MAX_NEW
    )
    lengths = list(range(0, MAX_NEW + 1))
    ours = algorithm.shaping.shaped(torch.zeros(len(lengths)), lengths)
    theirs = get_soft_overlong_punishment(MAX_NEW, 5)([[1] * n for n in lengths])
    assert ours.tolist() == pytest.approx(theirs, abs=1e-7)
    assert min(theirs) == -1.0 and max(theirs) == 0.0
