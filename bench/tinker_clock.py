"""The Tinker clock cycle: N official-SDK clients each running the same supervised loop at
once, fused into shared ticks vs run one model at a time on the same engine (issue 28).
A benchmark, not a test: it prints and writes numbers.

    .venv/bin/python bench/tinker_clock.py [--ns 1,2,4,8] [--rows 1,4] [--steps 20]
        [--repeats 2] [--prompt-tokens 8] [--completion-tokens 24] [--lr 0.005]
        [--threads 1] [--out bench/results/tinker-clock.json]  (and its -losses.png)

Two real ``loraplex-engine serve --tinker-keys`` processes with the tiny model (tests'
fixture), up at once, 8 slots, torch at ``--threads``, everything else at the engine's
defaults; the cells run interleaved (each (rows, N) on one arm, then the other, the
order reversed every other repeat), so the load of a shared machine drifts alike over
both arms, and each cell waits until its models are unloaded (closing a session retires
them in the background) before the next starts:

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
the other arm's, under the tolerances of the engine's dtype (bench/tinker_clock_report.py
derives them: float32 on the CPU, bfloat16 on CUDA); ``parity_verdict`` sums them up.

Where it runs (bench/gpu_tinker.py, the lent GPU's stage, sets these):
``--device cuda`` (serve's and ``engine_only``'s; serve plans both arms against the same
``--device-memory``), ``--model`` tiny (the tests' fixture) or qwen3-0.6b (Qwen3-0.6B's
shapes, random bf16 weights, gpu_common.build_family_model; qwen3-dry-run: its 2-layer
rehearsal), ``--engine-cpus``/``--client-cpus`` (the serve processes and ``engine_only``
on one set of cores, the SDK clients on another: no contention between them),
``--budget-s`` (no cell but the first starts past it; the JSON is rewritten after every
cell, with ``complete`` false until the end).
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
sys.path.insert(0, str(REPO))  # the test helpers, as tests.support

from loraplex_engine.clients.saved import engine_name  # noqa: E402
from tinker_clock_engine import RANK, SEED0, engine_only  # noqa: E402
from tinker_clock_report import (  # noqa: E402
    TOLERANCES,
    engine_dtype,
    plot,
    print_table,
    ratio_by_rows,
    summarise,
    verdict,
)

from tests.support.server_process import EngineServer  # noqa: E402
from tests.support.tiny_models import tiny_model  # noqa: E402

MODELS = {
    "tiny": "tiny-llama (tests' fixture: 2 layers, hidden 64, vocab 473)",
    "qwen3-0.6b": "Qwen3-0.6B's shapes (bench/configs/qwen3-0.6b.json), random bf16 weights, "
    "a trained byte-level vocabulary (gpu_common.build_family_model)",
    "qwen3-dry-run": "Qwen3's layout at 2 layers, hidden 64 (gpu_common's dry-run shape)",
}
# On CUDA both serve processes share the GPU, up at once: each plans against this much
# (not "what is free", which the one started first would change for the other).
DEVICE_MEMORY = "30GiB"
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


FINAL = engine_name("final")  # the engine's own save as it unloads a model


def retired(srv: EngineServer, models: dict[int, str], timeout: float = 120.0) -> None:
    """Wait until the cell's models are unloaded: closing a session retires its models in
    the background (each saved once, then unloaded), and that work must not run during
    the next cell, which is the other arm's (it charged 8 models' retirement to the
    fused arm's lone-client cells that follow a per_model N=8 cell)."""
    finals = [
        srv.checkpoint_root / f"ns{i}" / "_tinker" / model_id / "weights" / FINAL
        for i, model_id in models.items()
    ]
    deadline = time.monotonic() + timeout
    while not all(f.is_dir() for f in finals):
        if time.monotonic() > deadline:
            raise TimeoutError("the cell's models were never unloaded")
        time.sleep(0.05)
    time.sleep(0.2)  # each unload's last step (its slot freed) after its final save


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
                                                   args.completion_tokens, args.vocab))
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
    models = {}
    for c in clients:
        models[c.i] = c.finish(name)
        ckpt = srv.checkpoint_root / f"ns{c.i}" / "_tinker" / models[c.i] / "weights"
        adapters[str(c.i)] = str(ckpt / name)
    retired(srv, models)
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


def cpu_list(text: str) -> set[int] | None:
    """``0-1,4`` -> {0, 1, 4}; empty: None (no pinning)."""
    cpus: set[int] = set()
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus or None


def pin(cpus: set[int] | None) -> None:
    """Every thread of this process, and what it starts from now on, onto ``cpus``."""
    if cpus is None:
        return
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cpus)


def model_dir(name: str, device: str) -> Path:
    """The model's directory, built when missing (no downloads)."""
    if name == "tiny":
        return tiny_model()
    from gpu_common import FAMILY_MODEL_DIRS, build_family_model

    dry_run = name == "qwen3-dry-run"
    return build_family_model(FAMILY_MODEL_DIRS[dry_run], dry_run, device)


def start_servers(stack: contextlib.ExitStack, model: Path, work: Path, args) -> dict:
    """Both arms' serve processes, started at once (their imports and model loads
    overlap), each killed when ``stack`` closes."""
    from concurrent.futures import ThreadPoolExecutor

    keys = work / "keys.txt"
    keys.write_text("".join(f"ns{i} {key_of(i)}\n" for i in range(max(args.ns))))
    device = ["--device", args.device]
    if args.device.startswith("cuda"):
        device += ["--device-memory", DEVICE_MEMORY]
    servers = {
        arm: EngineServer(
            model, work / arm / "ckpt", max_adapters=max(args.ns), max_rank=16,
            threads=args.threads, workdir=work / arm,
            # the module, not the console script: the lent machine has no console script
            command=[sys.executable, "-m", "loraplex_engine.cli"],
            extra_args=["--tinker-keys", str(keys), *device, *flags],
        )
        for arm, flags in ARMS.items()
    }  # fmt: skip
    for srv in servers.values():
        stack.callback(srv.kill)
    with ThreadPoolExecutor(len(servers)) as pool:
        for future in [pool.submit(srv.start) for srv in servers.values()]:
            future.result()
    return servers


class Run:
    """What a run has measured so far, and its JSON, rewritten after every cell."""

    def __init__(self, args, model: Path, t_start: float) -> None:
        self.args, self.model = args, model
        self.dtype = engine_dtype(args.device, None)
        self.t_start, self.load_start = t_start, os.getloadavg()[0]
        self.runs: list[dict] = []
        self.ceiling: list[dict] = []
        self.skipped: list[dict] = []
        self.affinity: dict[str, list[int]] = {}

    def past_budget(self, what: str) -> bool:
        """Whether ``what`` should not start; the first cell always does (a budget spent
        on start-up alone would leave nothing to read)."""
        spent = time.time() - self.t_start
        if self.args.budget_s is None or spent < self.args.budget_s or not self.runs:
            return False
        self.skipped.append({"what": what, "why": f"time budget: {spent:.0f}s of "
                             f"{self.args.budget_s:.0f}s spent"})  # fmt: skip
        print(f"skipped {what}: past the {self.args.budget_s:.0f}s budget", flush=True)
        return True

    def report(self, complete: bool) -> dict:
        args = self.args
        tol = TOLERANCES[self.dtype]
        ratios, parities = summarise(self.runs, args.lr, args.steps, tol)
        return {
            "complete": complete,
            "config": {
                "command": " ".join(["bench/tinker_clock.py", *sys.argv[1:]]),
                "model": MODELS[args.model], "model_dir": str(self.model),
                "vocab": args.vocab, "device": args.device, "dtype": self.dtype,
                "lora": f"rank {RANK}, Tinker's defaults: attention, MLP and unembed",
                "ns": args.ns, "rows_per_step": args.rows,
                "prompt_tokens": args.prompt_tokens,
                "completion_tokens": args.completion_tokens, "steps": args.steps,
                "lr": args.lr, "repeats": args.repeats, "threads": args.threads,
                "arms": {a: " ".join(f) or "(serve defaults)" for a, f in ARMS.items()},
                "device_memory": DEVICE_MEMORY if args.device.startswith("cuda") else None,
                "engine_cpus": sorted(args.engine_cpus or []),
                "client_cpus": sorted(args.client_cpus or []),
                "affinity": self.affinity, "budget_s": args.budget_s,
                "tolerance": tol,
                "machine": {"platform": platform.platform(),
                            "python": platform.python_version(), "nproc": os.cpu_count(),
                            "loadavg_1m_start_end": [self.load_start, os.getloadavg()[0]]},
                "wall_s": round(time.time() - self.t_start, 1),
            },
            "ratios": ratios, "ratio_by_rows": ratio_by_rows(ratios),
            "parity_verdict": verdict(parities, self.dtype),
            "engine_only": self.ceiling, "skipped": self.skipped,
            "parity": parities, "runs": self.runs,
        }  # fmt: skip

    def write(self, complete: bool = False) -> dict:
        report = self.report(complete)
        out = self.args.out
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")  # a reader never sees half a file
        tmp.write_text(json.dumps(report, indent=2) + "\n")
        tmp.replace(out)
        return report


def ceiling(run: Run, model: Path, work: Path) -> None:
    """engine_only for every batch size, in this process on the engine's cores (the
    clients' threads too, idle meanwhile), then back on the clients' cores."""
    args = run.args
    pin(args.engine_cpus)
    for rows in args.rows if args.engine_only else []:
        if not run.past_budget(f"engine_only rows {rows}"):
            c = engine_only(model, work, rows, max(args.ns), args)
            print(f"engine only rows={c['rows']} N={c['n']}: tick s {c['tick_s']}, "
                  f"ratio {c['ratio']}", flush=True)  # fmt: skip
            run.ceiling.append(c)
            run.write()
    pin(args.client_cpus)


def in_turn(servers: dict[str, Any], rep: int) -> list[tuple[str, Any]]:
    """The arms in the order a repeat runs them: reversed every other repeat, so that
    neither always runs first of its pair (after the other arm's previous cell, the
    first cell of the run included)."""
    arms = list(servers.items())
    return arms[::-1] if rep % 2 else arms


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    t_start = time.time()  # the budget counts the model's build too
    model = model_dir(args.model, args.device)
    args.vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    run = Run(args, model, t_start)
    work = Path(tempfile.mkdtemp(prefix="tinker-clock-"))
    pin(args.engine_cpus)  # the serve processes inherit it
    with contextlib.ExitStack() as stack:
        servers = start_servers(stack, model, work, args)
        assert all(srv.proc is not None for srv in servers.values())
        run.affinity = {arm: sorted(os.sched_getaffinity(srv.proc.pid))  # type: ignore[union-attr]
                        for arm, srv in servers.items()}  # fmt: skip
        pin(args.client_cpus)  # the SDK clients' threads start after this
        run.affinity["clients"] = sorted(os.sched_getaffinity(0))
        # Interleaved: every arm's cell of a (rows, N) back to back, so that the load of a
        # shared machine drifts alike over the arms.
        for rep in range(args.repeats):
            for rows in args.rows:
                for n in args.ns:
                    if run.past_budget(f"rows {rows} N {n} repeat {rep}"):
                        continue
                    for arm, srv in in_turn(servers, rep):
                        run.runs.append(run_cell(srv, arm, n, rows, rep, args))
                    run.write()
            if rep + 1 == args.engine_only_after:  # the servers idle meanwhile
                ceiling(run, model, work)
    if args.engine_only_after is None:
        ceiling(run, model, work)
    report = run.write(complete=True)
    if args.plot:
        plot(report, args.out.with_name(args.out.stem + "-losses.png"))
    print_table(report["ratios"], report["parity_verdict"])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
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
    p.add_argument("--device", default="cpu", help="serve's and engine_only's: cpu, cuda")
    p.add_argument("--model", choices=sorted(MODELS), default="tiny")
    p.add_argument(
        "--engine-cpus",
        type=cpu_list,
        default=None,
        help="cores of the serve processes and engine_only, e.g. 0-1",
    )
    p.add_argument(
        "--client-cpus",
        type=cpu_list,
        default=None,
        help="cores of the SDK clients (this process), e.g. 2-15",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="no cell (nor engine_only) starts past this many seconds",
    )
    p.add_argument("--no-engine-only", dest="engine_only", action="store_false")
    p.add_argument("--engine-only-after", type=int, default=None, metavar="REPEATS",
                   help="engine_only after this many repeats, the servers up and idle "
                   "(default: after all, the servers stopped)")  # fmt: skip
    p.add_argument(
        "--no-plot", dest="plot", action="store_false", help="no -losses.png beside the JSON"
    )
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "tinker-clock.json")
    args = p.parse_args(argv)
    if (args.engine_cpus is None) != (args.client_cpus is None):
        p.error("--engine-cpus and --client-cpus go together")
    args.ns = [int(x) for x in args.ns.split(",")]
    args.rows = [int(x) for x in args.rows.split(",")]
    return args


if __name__ == "__main__":
    main()
