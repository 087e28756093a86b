"""Local runner: train the experiments of a manifest file on one in-process hot engine.

Drives the same engine object as the HTTP server (no HTTP in between), prints live
progress, and writes ``summary.json``, ``rewards.png`` and the final adapters.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import torch
from prometheus_client import CollectorRegistry

from loraplex_engine.local.checks import check_run, trust_of, with_targets
from loraplex_engine.local.manifests import Manifest
from loraplex_engine.local.pace import Pace
from loraplex_engine.local.resume import RunState, carry_over, fresh_state, resumed_state
from loraplex_engine.local.stop import StopRequest
from loraplex_engine.parallel.data_parallel import DataParallelTraining
from loraplex_engine.parallel.distributed import World
from loraplex_engine.parallel.launch import data_parallel
from loraplex_engine.server.flags import resolve_device
from loraplex_engine.settings.commands import RunSettings
from loraplex_engine.settings.generate import to_argv
from loraplex_engine.spec.api_types import AdapterSync, ExperimentStatus, TickReport
from loraplex_engine.spec.errors import ApiError, UsageError
from loraplex_engine.spec.eval_scores import EvalResult
from loraplex_engine.spec.service import TickingEngine
from loraplex_engine.store.checkpoint import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from loraplex_engine.tracking.hub import Tracking, build_trackers

if TYPE_CHECKING:
    from loraplex_engine.engine import Engine

FIRST_LAST_K = 5  # summary's reward_first / reward_last average this many steps


@dataclass
class Progress:
    """Per-experiment reward curve and token counts, collected from tick reports."""

    rewards: dict[str, list[float]] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    phase_seconds: dict[str, float] = field(default_factory=dict)
    # Per step, the off-policy gap (api_types.ExperimentTick.logprob_gap); vLLM only.
    logprob_gaps: dict[str, list[float]] = field(default_factory=dict)
    # Per step, the tokens sampled (its rows' completions: ExperimentTick.rollout_tokens).
    completion_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Per step with TIS (offPolicyCorrection: tis), the mean weight and the tokens it
    # weighted (every rank's under data parallelism: all of the step's completion tokens).
    tis_weight_means: dict[str, list[float]] = field(default_factory=dict)
    tis_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Per step, the adapter step whose weights sampled it (ExperimentTick.rollout_version).
    rollout_versions: dict[str, list[int]] = field(default_factory=dict)
    # Per tick that sent adapters to the sampler (vLLM), its weight sync.
    syncs: list[AdapterSync] = field(default_factory=list)
    # spec.eval: per eval, the step of the adapter it evaluated and its numbers.
    evals: dict[str, list[dict[str, float]]] = field(default_factory=dict)

    def record(self, report: TickReport) -> None:
        for exp in report.experiments:
            if exp.failed_reason is None and exp.eval is not None:
                self.evals.setdefault(exp.id, []).append(eval_point(exp.eval))
            if exp.eval_only:  # no step: the last adapter's eval alone
                continue
            if exp.failed_reason is None:
                self.rewards.setdefault(exp.id, []).append(exp.reward)
                self.completion_tokens.setdefault(exp.id, []).append(exp.rollout_tokens)
                self.rollout_versions.setdefault(exp.id, []).append(exp.rollout_version)
            if exp.failed_reason is None and exp.logprob_gap is not None:
                self.logprob_gaps.setdefault(exp.id, []).append(exp.logprob_gap)
            if exp.failed_reason is None and exp.tis_weight_mean is not None:
                self.tis_weight_means.setdefault(exp.id, []).append(exp.tis_weight_mean)
                self.tis_tokens.setdefault(exp.id, []).append(exp.tis_tokens)
            self.tokens[exp.id] = self.tokens.get(exp.id, 0) + exp.rollout_tokens
        for phase, seconds in report.phase_seconds.items():
            self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + seconds
        if report.adapter_sync is not None:
            self.syncs.append(report.adapter_sync)

    def sync_summary(self) -> dict[str, Any] | None:
        """summary.json's ``adapter_sync``: per tick that sent adapters, its seconds,
        adapters, bytes and transport, and their totals; None where nothing was synced."""
        if not self.syncs:
            return None
        seconds = [s.seconds for s in self.syncs]
        return {
            "transports": sorted({s.transport for s in self.syncs}),
            "ticks": len(seconds),
            "seconds_total": sum(seconds),
            "seconds_mean": sum(seconds) / len(seconds),
            "seconds_per_tick": seconds,
            "adapters_per_tick": [s.adapters for s in self.syncs],
            "bytes_total": sum(s.bytes for s in self.syncs),
        }


def eval_point(result: EvalResult) -> dict[str, float]:
    """summary.json's entry for one eval."""
    return {
        "step": result.step,
        "reward": result.reward,
        "pass_at_k": result.pass_at_k,
        "k": result.k,
        "tokens": result.tokens,
    }


def sync_line(sync: AdapterSync) -> str:
    """The latest tick's weight sync, for the progress output."""
    return (
        f"  adapter sync {sync.seconds * 1000:.1f} ms/tick: {sync.adapters} adapters, "
        f"{sync.bytes / 1e6:.2f} MB as {sync.transport}"
    )


def _mean(values: list[float]) -> float | None:
    # None (JSON null) for an experiment that failed before its first step: NaN would
    # make json.dumps write a bare NaN, which is not JSON.
    return sum(values) / len(values) if values else None


def progress_line(status: ExperimentStatus, tokens_per_s: float) -> str:
    reward = "   -  " if status.reward is None else f"{status.reward:6.3f}"
    limit = status.max_steps or "∞"
    line = f"  {status.name:<24} {status.phase:<9} step {status.step:>4}/{limit:<4} "
    line += f"reward {reward}  {tokens_per_s:7.1f} tok/s"
    if status.logprob_gap is not None:
        line += f"  gap {status.logprob_gap:.4f}"
    if status.tis_weight_mean is not None:
        line += f"  tis {status.tis_weight_mean:.4f}"
    if status.eval_reward is not None and status.eval_pass_at_k is not None:
        line += f"  eval@{status.eval_step} {status.eval_reward:.3f}"
        line += f" pass@{status.eval_k} {status.eval_pass_at_k:.3f}"
    return line


def run_until_done(
    engine: TickingEngine,
    ids: list[str],
    out: TextIO,
    progress: Progress,
    print_every_s: float = 2.0,
    on_tick: Callable[[TickReport], None] | None = None,
    stop: StopRequest | None = None,
) -> float:
    """Tick until every experiment has finished, or ``stop`` is requested (between
    ticks: a tick is never cut in half); returns wall seconds."""
    start = last_print = time.monotonic()
    pace = Pace(start)
    while True:
        report = engine.tick()
        stepped = report is not None and any(not e.eval_only for e in report.experiments)
        if report is not None:
            progress.record(report)
            if on_tick:
                on_tick(report)
        statuses = [engine.get_experiment(i) for i in ids]
        now = time.monotonic()
        if stepped:
            pace.stepped(now)
        done = all(s.phase != "Running" for s in statuses) or (stop is not None and stop.requested)
        first = stepped and pace.steps == 1  # the first step shows at once, then every few s
        if done or first or now - last_print >= print_every_s:
            last_print = now
            elapsed = max(now - start, 1e-9)
            sync = progress.syncs[-1] if progress.syncs else None
            head = f"[{elapsed:7.1f}s]{pace.line(statuses)}"
            out.write(f"{head}{sync_line(sync) if sync else ''}\n")
            for s in statuses:
                out.write(progress_line(s, progress.tokens.get(s.id, 0) / elapsed) + "\n")
            out.flush()
        if done:
            return now - start


def final_adapter(engine: TickingEngine, status: ExperimentStatus) -> str | None:
    """The checkpoint directory holding the experiment's final adapter.

    A finished experiment always has one: the engine checkpoints at its last step, and
    if that is missing (a custom engine), one is written now. A failed experiment keeps
    its last good checkpoint (written before the failure, so its weights are finite) or
    None when it failed before its first checkpoint: its weights at the failure (NaN,
    or the update that made them so) are not worth shipping.
    """
    if status.phase == "Failed" or status.adapter_path:
        return status.adapter_path
    return engine.checkpoint_experiment(status.id).path


def export_adapter(source: str | None, out_dir: Path, name: str) -> str | None:
    """Copy the PEFT adapter files of a checkpoint to ``out_dir/adapters/<name>``."""
    target = out_dir / "adapters" / name
    # Also when there is nothing to copy: a previous run's adapter left under this
    # name would pass for this run's.
    shutil.rmtree(target, ignore_errors=True)
    if source is None:
        return None
    # Only what PEFT reads: the optimiser and trainer state stay in the checkpoint.
    target.mkdir(parents=True)
    for file in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        shutil.copy2(Path(source) / file, target / file)
    return str(target)


def write_summary(
    engine: TickingEngine,
    ids: list[str],
    progress: Progress,
    wall: float,
    out_dir: Path,
    task_names: dict[str, str],
    state: RunState | None = None,
    interrupted: bool = False,
) -> dict[str, Any]:
    """summary.json + one PEFT adapter directory per experiment under ``out_dir``.

    Beside the issue's keys, each experiment carries its ``phase``, ``rewards`` curve,
    ``logprob_gaps`` curve (per step, the mean |sampler − trainer| log-prob gap; empty
    where the trainer samples itself), ``completion_tokens`` (per step, the tokens
    sampled), ``tis_weight_means`` and ``tis_tokens`` (per step, the mean TIS weight and
    how many tokens it weighted; empty without ``offPolicyCorrection: tis``), ``evals``
    (spec.eval: per eval, its adapter's step, reward, pass_at_k, k and tokens; empty
    without), ``rollout_versions`` (per step, the adapter step whose weights sampled it:
    docs/design/pipeline.md) and ``error``. A failed experiment has ``adapter_path`` null
    unless it checkpointed before failing, and null ``reward_first``/``reward_last`` if it
    never finished a step. With the vLLM rollout, ``adapter_sync`` measures each tick's
    weight sync (``Progress.sync_summary``).
    """
    experiments = []
    for exp_id in ids:
        status = engine.get_experiment(exp_id)
        curve = progress.rewards.get(exp_id, [])
        adapter = export_adapter(final_adapter(engine, status), out_dir, status.name)
        experiments.append(
            {
                "id": exp_id,
                "run_id": state.run_ids.get(exp_id) if state else None,
                "name": status.name,
                "task": task_names[exp_id],
                "phase": status.phase,
                "steps": status.step,
                "reward_first": _mean(curve[:FIRST_LAST_K]),
                "reward_last": _mean(curve[-FIRST_LAST_K:]),
                "rewards": curve,
                "logprob_gaps": progress.logprob_gaps.get(exp_id, []),
                "completion_tokens": progress.completion_tokens.get(exp_id, []),
                "tis_weight_means": progress.tis_weight_means.get(exp_id, []),
                "tis_tokens": progress.tis_tokens.get(exp_id, []),
                "evals": progress.evals.get(exp_id, []),
                "rollout_versions": progress.rollout_versions.get(exp_id, []),
                "adapter_path": adapter,
                "error": status.error,
            }
        )
    summary = {
        "interrupted": interrupted,  # stopped by a signal: `run --resume` goes on
        "wall_seconds": wall,
        "phase_seconds": progress.phase_seconds,
        "experiments": experiments,
    }
    sync = progress.sync_summary()
    if sync is not None:  # vLLM: how the trained adapters reached it, tick by tick
        summary["adapter_sync"] = sync
    # allow_nan=False: fail here rather than write a file JSON parsers reject.
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, allow_nan=False))
    return summary


def plot_rewards(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for exp in summary["experiments"]:
        ax.plot(range(1, len(exp["rewards"]) + 1), exp["rewards"], label=exp["name"])
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_title("loraplex: reward per experiment (one hot engine)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def make_out_dir(out_dir: str | Path) -> Path:
    path = Path(out_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"output directory {path}: {exc.strerror or exc}") from None
    return path


def run_file(
    settings: RunSettings,
    out: TextIO | None = None,
    stop: StopRequest | None = None,
    checked: bool = False,
) -> dict[str, Any] | None:
    """Validate every manifest up front (local/checks.py; ``checked``: the caller did, as
    the CLI does before it imports torch), then train them all on one hot engine.

    JSONL datasets must lie under ``settings.data_root`` (default: the manifest file's
    directory); a relative one is taken from the first. One user runs the runner: reward
    URLs go anywhere (the engine service's limits are in tenancy/trust.py).

    ``world_size`` > 1: data parallel (parallel/data_parallel.py); this process is rank 0 and
    starts the others as the command ``settings`` spell (settings/generate.to_argv,
    parallel/launch.py). A worker rank (``RANK`` set) follows rank 0 (its adds of the
    experiments, then its rollout and train phases, decoding and training its share) and
    returns None; only rank 0 scores, checkpoints and writes the summary. With the vllm
    rollout, rank 0's vLLM decodes every row and the workers only train. ``shard_base``:
    the base sharded over the ranks (parallel/sharding.py). ``device``: auto, cpu, cuda,
    cuda:N (server/flags.resolve_device): each rank on ``cuda:<LOCAL_RANK>`` with NCCL on
    CUDA, gloo on the CPU."""
    from loraplex_engine.engine import Engine

    out = out or sys.stdout
    if not checked:
        check_run(settings)
    manifests = with_targets(settings)
    rank_device = resolve_device(settings.device, settings.world_size)
    out_dir = make_out_dir(settings.out_dir)
    engine_settings = settings.engine().model_copy(
        update={"checkpoint_root": str(out_dir / "checkpoints")}
    )
    argv = to_argv(settings)  # a worker rank: this very command
    # Rank 0's trackers, before the model loads: a missing client is a usage error now.
    leader = os.environ.get("RANK", "0") == "0"
    tracking = start_local_tracking(settings, out_dir) if leader else None
    device = torch.device(rank_device)
    try:
        with data_parallel(settings.world_size, argv, device, settings.dist_timeout) as world:
            t0 = time.monotonic()
            engine = Engine(
                settings.model,
                engine_settings,
                device=rank_device,
                world=world,
                trust=trust_of(settings),
            )
            try:
                local = LocalRun(settings, manifests, out, out_dir, t0, world, stop)
                return _run(engine, local, tracking or Tracking([], CollectorRegistry(), 1, ""))
            finally:
                engine.close()  # the vLLM worker, the reward pool
                # Before the group is left: a sharded base's DTensors hold it
                # (distributed.leave).
                del engine
    finally:
        if tracking is not None:
            tracking.close()  # what was queued is flushed, also after an error


@dataclass
class LocalRun:
    """What `_run` trains, where it writes, and what stops it."""

    settings: RunSettings
    manifests: list[Manifest]
    out: TextIO
    out_dir: Path
    t0: float
    world: World | None
    stop: StopRequest | None


def _run(engine: Engine, run: LocalRun, tracking: Tracking) -> dict[str, Any] | None:
    """Train on a loaded engine; a worker rank follows rank 0 and returns None."""
    world, out, manifests = run.world, run.out, run.manifests
    if world is None or world.is_leader:
        ranks = f", data parallel over {world.size} ranks" if world else ""
        ranks += ", base sharded (FSDP2)" if engine.lockstep is not None else ""
        out.write(
            f"engine ready in {time.monotonic() - run.t0:.1f}s: {engine.model_name} in "
            f"{engine.capacity().dtype} on {engine.device}, {engine.rollout_backend} rollout, "
            f"{len(manifests)} experiments, {run.settings.train_mode} training{ranks} (micro-"
            f"batches of {engine.strategy.micro_batch_tokens} tokens; rollout micro-batches "
            f"of {engine.memory_plan.rollout_kv_tokens or 'vLLM-sized'} KV tokens)\n"
        )
    dp = engine.strategy if isinstance(engine.strategy, DataParallelTraining) else None
    if dp is not None and not dp.world.is_leader:
        dp.follow()  # rank 0's adds, then its train phases, until its stop()
        return None
    resume = run.settings.resume
    state = resumed_state(run.out_dir, manifests) if resume else fresh_state(manifests)
    state.write(run.out_dir)  # before the first step: a killed run can be resumed too
    for m in manifests:
        try:
            engine.put_experiment(m.id, m.spec, m.namespace, m.name, None, state.run_ids[m.id])
        except ApiError as e:
            source = run.settings.manifests
            raise UsageError(f"{source}: {m.name}: {e.field}: {e.message}") from None
    ids = [m.id for m in manifests]
    progress = Progress()
    if resume:
        steps = {i: engine.get_experiment(i).step for i in ids}
        carry_over(progress, state, steps)
        out.write(f"resumed {', '.join(f'{i} at step {n}' for i, n in steps.items())}\n")
    if run.stop is not None:
        run.stop.armed = True  # from here a signal stops after the tick, with checkpoints
    observe = tracking.observe_tick
    wall = run_until_done(engine, ids, out, progress, on_tick=observe, stop=run.stop)
    if dp is not None:
        dp.stop()
    # A signal during the last tick stops nothing: the run is done, not interrupted.
    running = any(engine.get_experiment(i).phase == "Running" for i in ids)
    stopped = run.stop is not None and run.stop.requested and running
    if stopped:
        checkpoint_running(engine, ids)
    tasks = {m.id: m.spec.task.name for m in manifests}
    summary = write_summary(engine, ids, progress, wall, run.out_dir, tasks, state, stopped)
    plot_rewards(summary, run.out_dir / "rewards.png")
    if stopped:
        steps = ", ".join(f"{e['name']} {e['steps']}" for e in summary["experiments"])
        out.write(
            f"stopped after {wall:.1f}s at steps {steps}: checkpointed; wrote "
            f"{run.out_dir / 'summary.json'}; go on with --resume {run.out_dir}\n"
        )
    else:
        out.write(f"done in {wall:.1f}s; wrote {run.out_dir / 'summary.json'} and rewards.png\n")
    return summary


def checkpoint_running(engine: TickingEngine, ids: list[str]) -> None:
    """A checkpoint of every running experiment at its step (unless it has one)."""
    for exp_id in ids:
        status = engine.get_experiment(exp_id)
        if status.phase != "Running":
            continue
        if status.checkpoint is None or status.checkpoint.step != status.step:
            engine.checkpoint_experiment(exp_id)


def start_local_tracking(settings: RunSettings, out_dir: Path) -> Tracking:
    """`run`'s trackers (--tracking-*), as serve's; pool ``local``."""
    trackers = build_trackers(settings, str(out_dir / "checkpoints"))
    return Tracking(trackers, CollectorRegistry(), settings.tracking_queue, "local")
