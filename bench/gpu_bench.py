"""The throughput benchmark on one CUDA GPU, with a ~0.5B random Llama and a FLOP floor.

    python bench/gpu_bench.py --out out/bench-gpu   (bench/gpu.sh wraps this)

1. Builds a random-weight Llama-style model of about 0.5B parameters (hidden 1536,
   MLP 4096, 20 layers, 12 heads / 4 KV heads) with the on-the-spot tokenizer: no
   downloads.
2. Measures the device's bf16 matmul rate (8192^3 GEMMs, median of 20).
3. Runs bench/throughput.py's three arms on it (CUDA, frozen base in bf16 under
   autocast, LoRA weights and Adam moments fp32).
4. For every run: training tokens/s = train_tokens / train-phase seconds, and the share
   of the device's bf16 rate that the FLOP floor ``(4P + 6P_L)·T`` of those tokens
   would use (P = frozen matmul parameters a token passes through, P_L = one adapter's
   LoRA parameters; the forward costs 2P + 2P_L per token, the backward 2P for input
   gradients plus 4P_L for the LoRA input and weight gradients, nothing for frozen
   weight gradients). Attention score FLOPs are left out (short sequences).

Writes ``gpu_results.json`` beside the usual results.json / plots.

``--dry-run`` runs the same pipeline on the CPU with a ~0.1M-parameter model of the same
layout, one experiment and one step: seconds, and it checks the plumbing (model build,
workers, result fields, the floor arithmetic) before a GPU slot is spent on it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput

SHAPE = {
    "hidden_size": 1536,
    "intermediate_size": 4096,
    "num_hidden_layers": 20,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
}


# Same layout (GQA 3:1, no tied embeddings), small enough for a CPU in seconds.
DRY_RUN_SHAPE = {
    "hidden_size": 48,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 3,
    "num_key_value_heads": 1,
}


def build_model(out: Path, shape: dict[str, int], device: str) -> Path:
    if (out / "config.json").exists():
        return out
    from loraplex_engine.dev.tiny_model import train_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = train_tokenizer(2048)
    config = LlamaConfig(
        vocab_size=len(tok),
        max_position_embeddings=1024,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
        **shape,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)  # init on the GPU: seconds, not minutes
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bf16_matmul_flops(device: str = "cuda", size: int = 8192, repeat: int = 20) -> float:
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(repeat):
        _sync(device)
        t = time.perf_counter()
        a @ b
        _sync(device)
        times.append(time.perf_counter() - t)
    return 2 * size**3 / statistics.median(times)


def lora_params_per_adapter(
    model: dict, rank: int, targets: list[str], shape: dict[str, int] = SHAPE
) -> int:
    h, i = model["hidden_size"], model["intermediate_size"]
    kv = h * shape["num_key_value_heads"] // shape["num_attention_heads"]
    dims = {
        "q_proj": (h, h),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (h, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }
    per_layer = sum(rank * sum(dims[t]) for t in targets if t in dims)
    head = rank * (h + model["vocab_size"]) if "lm_head" in targets else 0
    return model["layers"] * per_layer + head


MODEL_DIR = Path(".cache/models/gpu-0.5b-llama")
DRY_RUN_MODEL_DIR = Path(".cache/models/gpu-bench-dry-run")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("out/bench-gpu"))
    p.add_argument("--model-dir", type=Path, default=MODEL_DIR)
    p.add_argument("--ns", default="1,8")
    p.add_argument("--steps", default="10")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    p.add_argument("--micro-batch-tokens", type=int, default=16384)
    p.add_argument("--dry-run", action="store_true", help="tiny model on the CPU, 1 step")
    return p


def dry_run(args: argparse.Namespace) -> argparse.Namespace:
    """The CPU rehearsal: every size shrunk, everything else as on the GPU."""
    if args.model_dir == MODEL_DIR:
        args.model_dir = DRY_RUN_MODEL_DIR
    args.ns, args.steps, args.repeats, args.warmup = "1", "1", 1, 0
    args.group, args.prompts, args.max_new_tokens, args.rank = 2, 1, 4, 4
    args.micro_batch_tokens, args.matmul_size, args.threads = 1024, 256, 1
    return args


def without_plots_if_no_matplotlib() -> None:
    """Plots are a nicety; a GPU box without matplotlib must still write the numbers
    (throughput.main plots last, after results.json, and gpu_results.json comes after)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("gpu_bench: no matplotlib, skipping the plots", file=sys.stderr, flush=True)
        throughput.plot_throughput = lambda *a, **k: None
        throughput.plot_rewards = lambda *a, **k: None


def main() -> None:
    args = parse_args()
    args.warmup, args.matmul_size, args.threads = 1, 8192, 4  # the GPU run; dry_run shrinks
    if args.dry_run:
        args = dry_run(args)
    device = "cpu" if args.dry_run else "cuda"
    shape = DRY_RUN_SHAPE if args.dry_run else SHAPE
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_bench: torch sees no CUDA device (--dry-run rehearses on the CPU)")
    without_plots_if_no_matplotlib()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    model_dir = build_model(args.model_dir, shape, device)
    print(f"model ready in {time.time() - t0:.0f}s: {model_dir}", flush=True)
    rate = bf16_matmul_flops(device, args.matmul_size)
    print(f"measured bf16 matmul: {rate / 1e12:.3f} TFLOP/s", flush=True)
    results = throughput.main(
        [
            f"--model-dir={model_dir}",
            f"--ns={args.ns}",
            f"--steps={args.steps}",
            f"--repeats={args.repeats}",
            f"--warmup={args.warmup}",
            f"--threads={args.threads}",
            f"--group={args.group}",
            f"--prompts={args.prompts}",
            f"--max-new-tokens={args.max_new_tokens}",
            f"--rank={args.rank}",
            f"--targets={args.targets}",
            "--lr=0.001",
            f"--micro-batch-tokens={args.micro_batch_tokens}",
            f"--device={device}",
            "--autocast=bfloat16",
            f"--out={args.out}",
        ]
    )
    model = results["config"]["model"]
    p_frozen = model["linear_params"]
    p_lora = lora_params_per_adapter(model, args.rank, args.targets.split(","), shape)
    rows = []
    for run in results["runs"]:
        tokens, train_s = run["train_tokens"], run["phase_s"]["train"]
        floor = (4 * p_frozen + 6 * p_lora) * tokens
        rows.append(
            {
                **{k: run[k] for k in ("arm", "n", "steps", "repeat")},
                "train_tokens": tokens,
                "train_s": train_s,
                "train_tokens_per_s": tokens / train_s,
                "floor_flops": floor,
                "floor_fraction_of_bf16_peak": floor / train_s / rate,
                "makespan_s": run["makespan_s"],
            }
        )
    summary = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)",
        "dry_run": args.dry_run,
        "bf16_matmul_flops_per_s": rate,
        "frozen_matmul_params": p_frozen,
        "lora_params_per_adapter": p_lora,
        "runs": rows,
        "ratios": results["ratios"],
    }
    (args.out / "gpu_results.json").write_text(json.dumps(summary, indent=1))
    print(f"{'arm':<16} {'N':>3} {'train tok/s':>12} {'floor/peak':>10}")
    for arm in throughput.ARMS:
        for n in sorted({r["n"] for r in rows}):
            sel = [r for r in rows if (r["arm"], r["n"]) == (arm, n)]
            if sel:
                tps = statistics.median(r["train_tokens_per_s"] for r in sel)
                frac = statistics.median(r["floor_fraction_of_bf16_peak"] for r in sel)
                print(f"{arm:<16} {n:>3} {tps:>12.0f} {frac:>10.3f}")
    print(f"wrote {args.out}/gpu_results.json in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
