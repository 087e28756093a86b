"""The experiment spec's ``algorithm`` block: the RL update (the GRPO family's settings)
and the run's length. Kept apart from spec/experiment.py (which imports it) so each stays small;
free of torch and I/O like it. The loss and estimators these settings select are in
train/algorithms/ (built by its ``build_algorithm``).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from loraplex_engine.spec.api_types import MAX_NEW_TOKENS
from loraplex_engine.spec.schema import CelRule, Int32, Int64, SpecModel

# The learning-rate schedules a spec may name (train/lr_schedule.py computes them).
LRScheduleName = Literal["constant", "cosine"]
LR_SCHEDULES: tuple[LRScheduleName, ...] = ("constant", "cosine")

AlgorithmName = Literal["grpo"]
OffPolicyCorrection = Literal["none", "tis"]
# Kept equal to train/algorithms' tuples of the same (tested): those import torch.
AdvantageEstimatorName = Literal["grpo", "rloo"]
ScaleRewards = Literal["group", "batch", "none"]
LossAggregation = Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"]
KLEstimator = Literal["k1", "k3"]
ImportanceSamplingLevel = Literal["token", "sequence"]
# Most completions one step may sample (groupSize × promptsPerStep).
MAX_COMPLETIONS_PER_STEP = 8192


class OverlongSpec(SpecModel):
    """DAPO's soft overlong punishment (TRL get_soft_overlong_punishment, verl
    overlong_buffer): a completion of L tokens loses penalty × (L - (maxNewTokens -
    bufferTokens)) / bufferTokens once it is within bufferTokens of rollout.maxNewTokens,
    so the whole penalty at the limit (a truncated completion)."""

    buffer_tokens: Int32 = Field(
        ge=1,
        le=MAX_NEW_TOKENS,
        alias="bufferTokens",
        description="Length of the punished zone before rollout.maxNewTokens, in tokens "
        "(DAPO: 4096 of 20480); at most maxNewTokens.",
    )
    penalty: float = Field(
        1.0,
        gt=0,
        le=10,
        description="Reward lost at maxNewTokens (linear from 0 at the zone's start).",
    )


class AlgorithmSpec(SpecModel):
    """The RL update and the run's length."""

    CEL_RULES: ClassVar = (
        CelRule(
            "!has(self.groupSize) || !has(self.promptsPerStep) || "
            f"self.groupSize * self.promptsPerStep <= {MAX_COMPLETIONS_PER_STEP}",
            "algorithm.groupSize × algorithm.promptsPerStep (completions per step) must be at "
            f"most {MAX_COMPLETIONS_PER_STEP}",
            "promptsPerStep",
            lambda alg: alg.group_size * alg.prompts_per_step <= MAX_COMPLETIONS_PER_STEP,
        ),
        CelRule(
            "!has(self.lrSchedule) || self.lrSchedule != 'cosine' || !has(self.maxSteps) || "
            "self.maxSteps > 0",
            "algorithm.lrSchedule cosine decays over algorithm.maxSteps, so it needs "
            "maxSteps > 0 (a continual run, maxSteps 0, has no end to decay to): use constant",
            "lrSchedule",
            lambda alg: alg.lr_schedule != "cosine" or alg.max_steps > 0,
        ),
        CelRule(
            "!has(self.lrSchedule) || self.lrSchedule != 'cosine' || !has(self.maxSteps) || "
            "self.maxSteps == 0 || !has(self.warmupSteps) || self.warmupSteps < self.maxSteps",
            "algorithm.warmupSteps must be less than algorithm.maxSteps when lrSchedule is "
            "cosine (the decay needs at least one step after the warmup)",
            "warmupSteps",
            lambda alg: (
                alg.lr_schedule != "cosine"
                or alg.max_steps == 0
                or alg.warmup_steps < alg.max_steps
            ),
        ),
        CelRule(
            "!has(self.clipHigh) || self.clipHigh >= self.clip",
            "algorithm.clipHigh must be at least algorithm.clip (clip-higher widens the "
            "ratio's upper bound; both are ε, not 1 + ε)",
            "clipHigh",
            lambda alg: alg.clip_high is None or alg.clip_high >= alg.clip,
        ),
    )

    name: AlgorithmName = Field(
        "grpo",
        description="The RL algorithm: grpo, the group relative policy optimisation family. "
        "Dr. GRPO, DAPO, GSPO and RLOO are its settings below (recipes: docs/algorithms.md).",
    )
    group_size: Int32 = Field(
        8,
        ge=2,
        le=256,
        alias="groupSize",
        description="Completions sampled per prompt. GRPO's advantage of a completion is its "
        "reward minus its group's mean, divided by the group's standard deviation.",
    )
    prompts_per_step: Int32 = Field(
        4,
        ge=1,
        le=1024,
        alias="promptsPerStep",
        description="Prompts per optimiser step; a step trains on groupSize × promptsPerStep "
        f"completions (at most {MAX_COMPLETIONS_PER_STEP}).",
    )
    learning_rate: float = Field(
        5e-4,
        gt=0,
        le=1,
        alias="learningRate",
        description="Adam learning rate of the adapter: the rate after the warmup, where "
        "lrSchedule starts from.",
    )
    lr_schedule: LRScheduleName = Field(
        "constant",
        alias="lrSchedule",
        description="How the learning rate moves over the run, driven by this experiment's "
        "own optimiser steps (restored from its checkpoint on resume, whatever the other "
        "tenants do): constant = learningRate after the warmup; cosine = after the warmup, a "
        "half cosine from learningRate towards 0 over the remaining maxSteps - warmupSteps "
        "steps. cosine needs maxSteps > 0 (not continual).",
    )
    warmup_steps: Int64 = Field(
        0,
        ge=0,
        alias="warmupSteps",
        description="Optimiser steps over which the learning rate ramps linearly up to "
        "learningRate (step k of the warmup uses k/warmupSteps of it); 0 = no warmup. "
        "Applies to both schedules; with cosine it must be less than maxSteps.",
    )
    max_grad_norm: float | None = Field(
        None,
        gt=0,
        alias="maxGradNorm",
        description="Clip the adapter's gradient to this 2-norm before each step, on this "
        "adapter's own gradient alone (as torch.nn.utils.clip_grad_norm_ over its "
        "parameters), so another tenant's gradient never scales this update. "
        "Absent = no clipping.",
    )
    kl_coef: float = Field(
        0.0,
        ge=0,
        alias="klCoef",
        description="Weight of the per-token KL penalty towards the base model (the reference "
        "policy); 0 = no penalty.",
    )
    clip: float = Field(
        0.2,
        gt=0,
        le=1,
        description="PPO-style clip ε: the policy ratio is clipped to [1 - ε, 1 + ε].",
    )
    off_policy_correction: OffPolicyCorrection = Field(
        "none",
        alias="offPolicyCorrection",
        description="Correction for the gap between the sampler's and the trainer's "
        "log-probs (a vLLM rollout samples with other kernels and precision than the "
        "trainer; the trainer recomputes the old log-probs itself either way): none, or "
        "tis = truncated importance sampling, each token's policy-gradient term weighted by "
        "min(exp(logp_trainer_old - logp_sampler), tisCap). The torch rollout samples with "
        "the trainer's own model, so there the weight is 1.",
    )
    tis_cap: float = Field(
        2.0,
        ge=1,
        le=100,
        alias="tisCap",
        description="Upper bound C of the TIS weight min(ratio, C) when offPolicyCorrection "
        "is tis: a larger C corrects larger gaps at the cost of variance. Ignored otherwise.",
    )
    clip_high: float | None = Field(
        None,
        gt=0,
        le=1,
        alias="clipHigh",
        description="Upper clip ε_high: the ratio is clipped to [1 - clip, 1 + clipHigh] "
        "(DAPO's clip-higher, e.g. 0.28 with clip 0.2; TRL epsilon_high, verl "
        "clip_ratio_high). At least clip. Absent = clip (symmetric).",
    )
    importance_sampling_level: ImportanceSamplingLevel = Field(
        "token",
        alias="importanceSamplingLevel",
        description="token = one PPO ratio per token (GRPO); sequence = one per completion, "
        "exp of the mean token log-ratio, clipped as a whole (GSPO; TRL "
        "importance_sampling_level). GSPO's paper clips far tighter (clip 0.0003, clipHigh "
        "0.0004).",
    )
    advantage_estimator: AdvantageEstimatorName = Field(
        "grpo",
        alias="advantageEstimator",
        description="Baseline of a completion's reward: grpo = its group's mean; rloo = the "
        "mean of the group's other completions (leave-one-out; verl adv_estimator rloo). "
        "scaleRewards applies to either.",
    )
    scale_rewards: ScaleRewards = Field(
        "group",
        alias="scaleRewards",
        description="What the centred reward is divided by (TRL scale_rewards): group = the "
        "group's standard deviation (GRPO), batch = the whole step's, none = nothing "
        "(Dr. GRPO, and classic RLOO).",
    )
    loss_aggregation: LossAggregation = Field(
        "seq-mean-token-mean",
        alias="lossAggregation",
        description="How token losses make the experiment's loss (verl loss_agg_mode): "
        "seq-mean-token-mean = mean over each completion's tokens, then over completions "
        "(GRPO; TRL loss_type grpo); token-mean = mean over every token of the step "
        "(DAPO; TRL dapo); seq-mean-token-sum-norm = each completion's token sum over "
        "rollout.maxNewTokens, then the mean over completions (Dr. GRPO; TRL dr_grpo).",
    )
    kl_estimator: KLEstimator = Field(
        "k3",
        alias="klEstimator",
        description="Per-token estimator of the KL penalty (klCoef > 0): k3 = exp(ref - "
        "logp) - (ref - logp) - 1, never negative (TRL's; verl low_var_kl); k1 = logp - "
        "ref (verl kl). Ignored when klCoef is 0.",
    )
    dynamic_sampling: bool = Field(
        False,
        alias="dynamicSampling",
        description="DAPO's dynamic-sampling filter: a group whose rewards (after overlong "
        "shaping) are all equal is dropped from the update, which then trains on the "
        "remaining groups (no prompts are resampled to refill the step). A step with every "
        "group dropped counts as a step but updates nothing, and is reported "
        "(status skippedUpdates, loraplex_engine_updates_skipped_total).",
    )
    overlong: OverlongSpec | None = Field(
        None,
        description="DAPO's soft overlong punishment, added to each completion's reward "
        "before the advantages; absent = off.",
    )
    max_staleness: Int32 = Field(
        0,
        ge=0,
        le=16,
        alias="maxStaleness",
        description="Under the engine's pipelined schedule: how many optimiser steps "
        "behind the adapter the weights that sample a rollout may be. 0 = strictly "
        "on-policy (the next rollout waits for the update); k above 0: the next rollout "
        "may start while up to k of the experiment's updates have not landed (the one "
        "being made, rollouts waiting for their rewards or their turn), corrected by the "
        "PPO ratio against the sampler's log-probs (torch rollout) or by "
        "offPolicyCorrection tis (vLLM). Ignored by the sync schedule.",
    )
    max_steps: Int64 = Field(
        50,
        ge=0,
        alias="maxSteps",
        description="Optimiser steps to run, after which the experiment is Succeeded; "
        "0 = continual (train until suspended or deleted).",
    )
    seed: Int64 = Field(
        0,
        ge=0,
        description="Seed of the adapter's initial weights, the prompt order and the "
        "rollouts' sampling: the same spec and seed give the same run.",
    )
