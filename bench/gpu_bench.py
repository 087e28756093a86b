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


def build_half_billion(out: Path) -> Path:
    if (out / "config.json").exists():
        return out
    from loraplex_engine.tiny_model import train_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = train_tokenizer(2048)
    config = LlamaConfig(
        vocab_size=len(tok),
        max_position_embeddings=1024,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
        **SHAPE,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config)  # init on the GPU: seconds, not minutes
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    del model
    torch.cuda.empty_cache()
    return out


def bf16_matmul_flops(size: int = 8192, repeat: int = 20) -> float:
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t = time.perf_counter()
        a @ b
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return 2 * size**3 / statistics.median(times)


def lora_params_per_adapter(model: dict, rank: int, targets: list[str]) -> int:
    h, i = model["hidden_size"], model["intermediate_size"]
    kv = h * SHAPE["num_key_value_heads"] // SHAPE["num_attention_heads"]
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("out/bench-gpu"))
    p.add_argument("--model-dir", type=Path, default=Path(".cache/models/gpu-0.5b-llama"))
    p.add_argument("--ns", default="1,8")
    p.add_argument("--steps", default="10")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    p.add_argument("--micro-batch-tokens", type=int, default=16384)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_bench: torch sees no CUDA device")
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    model_dir = build_half_billion(args.model_dir)
    print(f"model ready in {time.time() - t0:.0f}s: {model_dir}", flush=True)
    rate = bf16_matmul_flops()
    print(f"measured bf16 matmul: {rate / 1e12:.1f} TFLOP/s", flush=True)
    results = throughput.main(
        [
            f"--model-dir={model_dir}",
            f"--ns={args.ns}",
            f"--steps={args.steps}",
            f"--repeats={args.repeats}",
            "--warmup=1",
            "--threads=4",
            f"--group={args.group}",
            f"--prompts={args.prompts}",
            f"--max-new-tokens={args.max_new_tokens}",
            f"--rank={args.rank}",
            f"--targets={args.targets}",
            "--lr=0.001",
            f"--micro-batch-tokens={args.micro_batch_tokens}",
            "--device=cuda",
            "--autocast=bfloat16",
            f"--out={args.out}",
        ]
    )
    model = results["config"]["model"]
    p_frozen = model["linear_params"]
    p_lora = lora_params_per_adapter(model, args.rank, args.targets.split(","))
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
        "device": torch.cuda.get_device_name(),
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
