"""The Tinker clock cycle: N official-SDK clients each running the same supervised loop at
once, fused into shared ticks vs run one model at a time on the same engine (issue 28).
A benchmark, not a test: it prints and writes numbers.

    .venv/bin/python bench/tinker_clock.py [--ns 1,2,4,8] [--rows 1,4] [--steps 20]
        [--repeats 2] [--prompt-tokens 8] [--completion-tokens 24] [--lr 0.005]
        [--threads 1] [--out bench/results/tinker-clock.json]  (and its -losses.png)

Two real ``loraplex-engine serve --tinker-keys`` processes with the tiny model (tests'
fixture), up at once, 8 slots, torch at ``--threads``, everything else at the engine's
defaults; the cells run interleaved (each (rows, N) on one arm, then the other), so
the load of a shared machine drifts alike over both arms:

- ``fused``: the engine as shipped. A tick takes one segment (forward_backward +
  optim_step) of every model with a call waiting and runs all of their data in one
  fused forward/backward (clients/ticking.py).
- ``per_model``: ``--client-models-per-tick 1``: a tick takes one model's segment, in
  turn (SkyRL's ``per_model`` execution). The clients still run concurrently, so their
  HTTP and SDK work overlaps the engine's ticks exactly as in ``fused``: only the
  engine's execution differs. (Running the clients one after another instead would also
  charge the baseline every client's round trips while the engine idles, which is not
  what ``per_model`` costs.)

Client i (its own namespace, key, ``ServiceClient`` and ``TrainingClient``, LoRA rank 8,
``seed=1000+i``) trains ``--rows`` fixed rows of random tokens (prompt, then a
completion weighted 1) with ``forward_backward(cross_entropy)`` + ``optim_step`` (AdamW,
``--lr``), both sent before either is awaited (the SDK's pipelining), ``--steps``
times. One ``forward`` per client first (no state change) warms the path; the clock runs
from a barrier to the last client's last step. Throughput: train tokens (each datum's
input tokens) and optimiser steps per second over all clients. Profile: the engine's
tick count and seconds (``/metrics``) against the wall clock, the CPU seconds of the
serve process and of the clients' process, each client's step latency; and
``engine_only``: the same data on an in-process Engine, no HTTP and no SDK, fused vs
one model a tick: the ratio's ceiling on this machine for each batch size.

Parity: every client's per-token loss at every step in ``fused`` against
``per_model`` (same seeds, same data), and its final adapter (``save_state``) against
the other arm's with the tolerances of tests/engine/adapter_parity.py. The loss
tolerance at step k (weights after k optimiser steps) is derived there too:
``LOSS_RTOL * |L_k| + STEP_MAX_TOL * |L_0 - L_k|``: the forward's own rounding
(fp32 sums of ~100 tokens: sqrt(n) * 2^-24 ~ 6e-7, bounded by 1e-5) plus a weight gap of
at most STEP_MAX_TOL Adam steps per element, whose first-order effect on the loss is at
most that share of what the k steps moved it (Adam moves every element by up to one
step against its gradient's sign, so |L_0 - L_k| ~ sum |grad| * lr * k).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests" / "engine"), str(REPO / "tests")]

from adapter_parity import STEP_MAX_TOL, adapter_gap_of_files  # noqa: E402
from server_process import EngineServer  # noqa: E402

LOSS_RTOL = 1e-5
RANK = 8
SEED0 = 1000
VOCAB = 473  # tiny-llama's; token ids are drawn below it
ARMS = {
    "fused": [],
    "per_model": ["--client-models-per-tick", "1"],
}


def key_of(i: int) -> str:
    return f"tml-bench{i:02d}" + "x" * 16


def client_rows(i: int, rows: int, prompt: int, completion: int, vocab: int) -> list[Any]:
    """Client i's fixed rows: random prompt and completion tokens (its own generator)."""
    from tinker import types

    rng = np.random.default_rng(SEED0 + i)
    data = []
    for _ in range(rows):
        seq = rng.integers(3, vocab, prompt + completion).tolist()
        weights = np.array([0.0] * (prompt - 1) + [1.0] * completion, dtype=np.float32)
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(seq[:-1]),
                loss_fn_inputs={
                    "target_tokens": types.TensorData.from_numpy(np.array(seq[1:])),
                    "weights": types.TensorData.from_numpy(weights),
                },
            )
        )
    return data


class Client:
    """One SDK client: its own ServiceClient, TrainingClient and data."""

    def __init__(self, url: str, i: int, base: str, data: list[Any]) -> None:
        import tinker

        self.i, self.data = i, data
        self.service = tinker.ServiceClient(base_url=url, api_key=key_of(i))
        self.tc = self.service.create_lora_training_client(
            base_model=base, rank=RANK, seed=SEED0 + i
        ).result()
        self.tc.forward(data, "cross_entropy").result()  # warm: no state change
        self.losses: list[float] = []
        self.step_s: list[float] = []
        self.tokens = sum(d.model_input.length for d in data)
        self.weighted = sum(float(d.loss_fn_inputs["weights"].to_numpy().sum()) for d in data)
        self.error: BaseException | None = None

    def run(self, steps: int, lr: float, start: threading.Barrier) -> None:
        from tinker import types

        adam = types.AdamParams(learning_rate=lr)
        try:
            start.wait()
            for _ in range(steps):
                t0 = time.perf_counter()
                fb = self.tc.forward_backward(self.data, "cross_entropy")
                opt = self.tc.optim_step(adam)
                loss = fb.result().metrics["loss:sum"]
                opt.result()
                self.step_s.append(time.perf_counter() - t0)
                self.losses.append(loss / self.weighted)
        except BaseException as e:  # reported by the main thread
            self.error = e

    def finish(self, name: str) -> str:
        """Save the final adapter, end the session (its model is unloaded); the model id."""
        self.tc.save_state(name).result()
        self.service.close("success").result()
        return self.tc.model_id


def engine_seconds(srv: EngineServer) -> dict[str, float]:
    """Tick count and seconds, train-phase seconds, from the engine's /metrics."""
    import httpx

    text = httpx.get(f"{srv.url}/metrics", headers=srv.headers, timeout=30).text
    out = {}
    for key, pattern in (
        ("ticks", r"^loraplex_engine_tick_seconds_count (\S+)"),
        ("tick_s", r"^loraplex_engine_tick_seconds_sum (\S+)"),
        ("train_s", r'^loraplex_engine_phase_seconds_sum\{phase="train"\} (\S+)'),
    ):
        m = re.search(pattern, text, re.M)
        out[key] = float(m.group(1)) if m else 0.0
    return out


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU seconds, all its threads (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_cell(srv: EngineServer, arm: str, n: int, rows: int, rep: int, args) -> dict:
    import tinker

    rest = tinker.RestClient(base_url=srv.url, api_key=key_of(0))
    model_name = rest.get_server_capabilities().result().supported_models[0].model_name
    clients = [
        Client(srv.url, i, model_name, client_rows(i, rows, args.prompt_tokens,
                                                   args.completion_tokens, VOCAB))
        for i in range(n)
    ]  # fmt: skip
    start = threading.Barrier(n + 1)
    threads = [
        threading.Thread(target=c.run, args=(args.steps, args.lr, start), daemon=True)
        for c in clients
    ]
    for t in threads:
        t.start()
    assert srv.proc is not None
    before = engine_seconds(srv)
    cpu0 = (cpu_seconds(srv.proc.pid), time.process_time())
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    cpu1 = (cpu_seconds(srv.proc.pid), time.process_time())
    after = engine_seconds(srv)
    for c in clients:
        if c.error is not None:
            raise RuntimeError(f"client {c.i} failed") from c.error
    name = f"bench-r{rows}-n{n}-{rep}"
    adapters = {}
    for c in clients:
        model_id = c.finish(name)
        ckpt = srv.checkpoint_root
        adapters[str(c.i)] = str(ckpt / f"ns{c.i}" / "_tinker" / model_id / "weights" / name)
    tokens = sum(c.tokens for c in clients) * args.steps
    engine = {k: round(after[k] - before[k], 4) for k in after}
    latencies = [s for c in clients for s in c.step_s]
    row = {
        "arm": arm, "rows": rows, "n": n, "repeat": rep,
        "wall_s": round(wall, 3),
        "train_tokens": tokens,
        "optim_steps": n * args.steps,
        "train_tokens_per_s": round(tokens / wall, 1),
        "steps_per_s": round(n * args.steps / wall, 3),
        "engine": engine,  # ticks, tick_s (their seconds), train_s: over the clock
        "engine_busy_share": round(engine["tick_s"] / wall, 3),
        # CPU seconds over the clock: the serve process (its ticks and its HTTP/protocol
        # threads) and this one (the N SDK clients).
        "cpu_s": {"server": round(cpu1[0] - cpu0[0], 2), "clients": round(cpu1[1] - cpu0[1], 2)},
        "step_latency_s": {"median": round(float(np.median(latencies)), 4),
                           "max": round(max(latencies), 4)},
        "loadavg_1m": os.getloadavg()[0],
        "losses": {str(c.i): [round(x, 7) for x in c.losses] for c in clients},
        "adapters": adapters,
    }  # fmt: skip
    print(
        f"{arm:12s} rows={rows} N={n} #{rep}: {wall:6.2f} s, "
        f"{row['train_tokens_per_s']:8.1f} tok/s, {row['steps_per_s']:6.2f} steps/s, "
        f"ticks {engine['ticks']:.0f} ({engine['tick_s']:.2f} s), cpu server "
        f"{row['cpu_s']['server']} s clients {row['cpu_s']['clients']} s, "
        f"load {row['loadavg_1m']:.1f}",
        flush=True,
    )
    return row


def parity(fused: dict, per_model: dict, lr: float, steps: int) -> dict:
    """Each client's losses and final adapter, a fused arm vs per_model."""
    out = {}
    for i, ref in per_model["losses"].items():
        got = fused["losses"][i]
        tol = [LOSS_RTOL * abs(r) + STEP_MAX_TOL * abs(ref[0] - r) for r in ref]
        diff = [abs(a - b) for a, b in zip(ref, got, strict=True)]
        gap = adapter_gap_of_files(
            Path(per_model["adapters"][i]), Path(fused["adapters"][i]), lr, steps
        )
        out[i] = {
            "max_abs_loss_diff": max(diff),
            "max_rel_loss_diff": max(d / abs(r) for d, r in zip(diff, ref, strict=True)),
            "losses_within_tolerance": all(d <= t for d, t in zip(diff, tol, strict=True)),
            "adapter_gap_rms_steps": gap.rms,
            "adapter_gap_max_steps": gap.worst,
        }
    return out


class _Ticks:
    """The engine as client_driver.drive sees it, summing its ticks' own seconds."""

    def __init__(self, eng: Any) -> None:
        self.eng, self.clients, self.seconds, self.count = eng, eng.clients, 0.0, 0

    def tick(self) -> Any:
        report = self.eng.tick()
        if report is not None:
            self.seconds += report.seconds
            self.count += 1
        return report


def engine_only(model: Path, work: Path, rows: int, n: int, args) -> dict:
    """No HTTP, no SDK: the same data on an in-process Engine (torch at --threads),
    each step's forward_backward + optim_step of all n models queued before one tick
    (fused) or one model's per tick (per_model). The tick seconds are what the engine
    alone costs: the ratio's ceiling on this machine for this batch size."""
    import torch
    from client_driver import drive, sft_datum
    from engine_builders import engine
    from loraplex_engine.training_service import AdamStep, ClientLora, LossCall

    torch.set_num_threads(args.threads)
    # Every call is queued before its tick here: nothing is on its way to gather.
    eng = engine(
        model, work / f"inproc-{rows}-{n}", max_adapters=n, max_rank=16, client_tick_gather=0
    )
    ce, adam = LossCall("cross_entropy"), AdamStep(learning_rate=args.lr)
    data = {}
    for i in range(n):
        rng = np.random.default_rng(SEED0 + i)
        split = args.prompt_tokens
        seqs = [
            rng.integers(3, VOCAB, split + args.completion_tokens).tolist() for _ in range(rows)
        ]
        data[f"m{i}"] = [sft_datum(q[:split], q[split:]) for q in seqs]
        eng.create_model("bench", f"m{i}", ClientLora(rank=RANK, seed=SEED0 + i))
    ticks = _Ticks(eng)

    def step(models: list[str]) -> None:
        calls = []
        for m in models:
            calls.append(lambda m=m: eng.forward_backward("bench", m, data[m], ce))
            calls.append(lambda m=m: eng.optim_step("bench", m, adam))
        drive(ticks, *calls)

    out = {}
    try:
        step(list(data))  # warm
        for arm in ("fused", "per_model", "fused", "per_model"):
            ticks.seconds, ticks.count = 0.0, 0
            for _ in range(args.steps):
                for group in [list(data)] if arm == "fused" else [[m] for m in data]:
                    step(group)
            out.setdefault(arm, []).append(round(ticks.seconds, 4))
    finally:
        eng.close()
    best = {arm: min(v) for arm, v in out.items()}
    return {"rows": rows, "n": n, "tick_s": out,
            "ratio": round(best["per_model"] / best["fused"], 3)}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ns", default="1,2,4,8")
    p.add_argument("--rows", default="1,4", help="rows per client step, a list")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=8)
    p.add_argument("--completion-tokens", type=int, default=24)
    p.add_argument("--lr", type=float, default=0.005)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "tinker-clock.json")
    args = p.parse_args()
    ns = [int(x) for x in args.ns.split(",")]
    row_sizes = [int(x) for x in args.rows.split(",")]
    model = REPO / ".cache" / "models" / "tiny-llama"
    if not (model / "config.json").exists():
        from loraplex_engine.dev.tiny_model import build_model

        build_model(model)
    t_start, load_start = time.time(), os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="tinker-clock-"))
    keys = work / "keys.txt"
    keys.write_text("".join(f"ns{i} {key_of(i)}\n" for i in range(max(ns))))
    runs: list[dict] = []
    with contextlib.ExitStack() as stack:
        servers = {
            arm: stack.enter_context(EngineServer(
                model, work / arm / "ckpt", max_adapters=max(ns), max_rank=16,
                threads=args.threads, workdir=work / arm,
                extra_args=["--tinker-keys", str(keys), *flags],
            ))
            for arm, flags in ARMS.items()
        }  # fmt: skip
        # Interleaved: every arm's cell of a (rows, N) back to back, so that the load of a
        # shared machine drifts alike over the arms.
        for rep in range(args.repeats):
            for rows in row_sizes:
                for n in ns:
                    for arm, srv in servers.items():
                        runs.append(run_cell(srv, arm, n, rows, rep, args))
    ceiling = [engine_only(model, work, rows, max(ns), args) for rows in row_sizes]
    for c in ceiling:
        print(f"engine only rows={c['rows']} N={c['n']}: tick s {c['tick_s']}, ratio {c['ratio']}")
    ratios, parities = summarise(runs, args)
    report = {
        "config": {
            "command": " ".join(["bench/tinker_clock.py", *sys.argv[1:]]),
            "model": "tiny-llama (tests' fixture: 2 layers, hidden 64, vocab 473)",
            "lora": f"rank {RANK}, Tinker's defaults: attention, MLP and unembed",
            "rows_per_step": row_sizes, "prompt_tokens": args.prompt_tokens,
            "completion_tokens": args.completion_tokens, "steps": args.steps, "lr": args.lr,
            "repeats": args.repeats, "threads": args.threads,
            "arms": {a: " ".join(f) or "(serve defaults)" for a, f in ARMS.items()},
            "loss_tolerance": "LOSS_RTOL*|L_k| + STEP_MAX_TOL*|L_0-L_k|",
            "LOSS_RTOL": LOSS_RTOL, "STEP_MAX_TOL": STEP_MAX_TOL,
            "machine": {"platform": platform.platform(), "python": platform.python_version(),
                        "nproc": os.cpu_count(),
                        "loadavg_1m_start_end": [load_start, os.getloadavg()[0]]},
            "wall_s": round(time.time() - t_start, 1),
        },
        "ratios": ratios, "engine_only": ceiling, "parity": parities, "runs": runs,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out.with_name(args.out.stem + "-losses.png"))
    print_table(ratios, parities)


def summarise(runs: list[dict], args) -> tuple[list[dict], dict]:
    """Per (rows, N): each arm's median throughput over the repeats and fused / per_model;
    per (rows, N, repeat, fused arm): every client's parity with per_model."""
    cells: dict[tuple[int, int], dict[str, list[dict]]] = {}
    for r in runs:
        cells.setdefault((r["rows"], r["n"]), {}).setdefault(r["arm"], []).append(r)
    ratios, parities = [], {}
    for (rows, n), arms in cells.items():
        med = {
            a: {
                k: float(np.median([r[k] for r in rs]))
                for k in ("train_tokens_per_s", "steps_per_s")
            }
            for a, rs in arms.items()
        }
        entry = {"rows": rows, "n": n, "median": med}
        for arm in arms:
            if arm != "per_model":
                ratio = med[arm]["train_tokens_per_s"] / med["per_model"]["train_tokens_per_s"]
                entry[f"{arm}_vs_per_model"] = round(ratio, 3)
                for f, s in zip(arms[arm], arms["per_model"], strict=True):
                    key = f"rows{rows}-n{n}-{f['repeat']}-{arm}"
                    parities[key] = parity(f, s, args.lr, args.steps)
        ratios.append(entry)  # fmt: skip
    return ratios, parities


def print_table(ratios: list[dict], parities: dict) -> None:
    print(
        "\n| rows | N | fused tok/s | fused steps/s | per_model tok/s | per_model steps/s "
        "| fused / per_model |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in ratios:
        f, s = r["median"]["fused"], r["median"]["per_model"]
        print(
            f"| {r['rows']} | {r['n']} | {f['train_tokens_per_s']:.0f} | "
            f"{f['steps_per_s']:.1f} | {s['train_tokens_per_s']:.0f} | "
            f"{s['steps_per_s']:.1f} | {r['fused_vs_per_model']} |"
        )
    every = [v for per in parities.values() for v in per.values()]
    print(f"parity: {sum(v['losses_within_tolerance'] for v in every)}/{len(every)} client runs "
          f"within the loss tolerance; max rel loss diff "
          f"{max(v['max_rel_loss_diff'] for v in every):.1e}; adapter gap max "
          f"{max(v['adapter_gap_max_steps'] for v in every):.1e} Adam steps")  # fmt: skip


def plot(report: dict, path: Path) -> None:
    """Every client's loss curve at the largest N, per batch size (repeat 0): fused solid,
    per_model dashed on top of it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(r["n"] for r in report["runs"])
    rows = sorted({r["rows"] for r in report["runs"]})
    fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 3.8), squeeze=False)
    for ax, size in zip(axes[0], rows, strict=True):
        for run in report["runs"]:
            if (run["n"], run["rows"], run["repeat"]) != (n, size, 0):
                continue
            style = "-" if run["arm"] == "fused" else "--"
            for i, losses in run["losses"].items():
                ax.plot(range(len(losses)), losses, style, color=f"C{int(i)}",
                        label=f"client {i}" if run["arm"] == "fused" else None)  # fmt: skip
        ax.set_title(f"N={n}, {size} row(s) of 31 tokens a step")
        ax.set_xlabel("step")
        ax.set_ylabel("loss per weighted token")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, ncol=2)
    fig.suptitle("Tinker SDK clients' losses: fused (solid) vs per_model (dashed, identical)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    main()
