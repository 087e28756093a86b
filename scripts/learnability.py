"""Learnability check: GRPO with plain transformers + peft LoRA on the tiny model.

Shows that each built-in task's reward rises in a few tens of steps on CPU, which
sets the defaults in samples/local/demo.yaml. Not used by the engine.

    .venv/bin/python scripts/learnability.py --task target-token --params target=yes
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from loraplex_engine.base_model import default_lora_targets, lora_targets_of
from loraplex_engine.local.manifests import load_manifests
from loraplex_engine.spec.experiment import ExperimentSpec
from loraplex_engine.tasks import build_task
from loraplex_engine.train.algorithms import group_advantages, grpo_loss, token_logprobs
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=".cache/models/tiny-llama")
    p.add_argument("--task", default="target-token")
    p.add_argument("--params", nargs="*", default=[], help="key=value")
    p.add_argument("--dataset", help="JSONL file (task jsonl)")
    p.add_argument("--reward", default="default", help="default or a built-in reward name")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=2e-2)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16)
    p.add_argument("--targets", default="all", help="all or comma list")
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--head-std", type=float, default=0.0, help="re-init lm_head with this std")
    p.add_argument("--manifest", help="run every experiment of this YAML with its own settings")
    return p.parse_args()


def args_from_manifest(args: argparse.Namespace, spec: ExperimentSpec) -> argparse.Namespace:
    a, lora = spec.algorithm, spec.lora
    return argparse.Namespace(
        **{
            **vars(args),
            "task": spec.task.name,
            "params": [f"{k}={v}" for k, v in spec.task.params.items()],
            "dataset": spec.task.dataset,
            "reward": spec.task.reward or "default",
            "steps": a.max_steps,
            "lr": a.learning_rate,
            "rank": lora.rank,
            "alpha": lora.alpha,
            # Unset: the family default the engine would give (base_model.py).
            "targets": ",".join(
                lora.target_modules or default_lora_targets(lora_targets_of(args.model)) or ()
            ),
            "group": a.group_size,
            "prompts": a.prompts_per_step,
            "new_tokens": spec.rollout.max_new_tokens,
            "temperature": spec.rollout.temperature,
            "seed": a.seed,
        }
    )


def main() -> None:
    args = parse_args()
    if args.manifest:
        for m in load_manifests(args.manifest):
            print(f"== {m.id}")
            run(args_from_manifest(args, m.spec))
    else:
        run(args)


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    params = dict(kv.split("=", 1) for kv in args.params)
    task = build_task(args.task, params, dataset=args.dataset, reward=args.reward)
    tok = AutoTokenizer.from_pretrained(args.model)
    tok.padding_side = "left"
    base = AutoModelForCausalLM.from_pretrained(args.model)
    if args.head_std:  # what-if: a base whose output head is not near-uniform
        g = torch.Generator().manual_seed(1234)
        w = base.get_output_embeddings().weight
        w.data = torch.randn(w.shape, generator=g) * args.head_std
    targets = ALL_LINEARS if args.targets == "all" else args.targets.split(",")
    cfg = LoraConfig(r=args.rank, lora_alpha=args.alpha, target_modules=targets)
    model = get_peft_model(base, cfg)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    curve: list[float] = []
    t0 = time.time()
    for step in range(args.steps):
        prompts = [p for p in task.sample_prompts(args.prompts, rng) for _ in range(args.group)]
        enc = tok([p.text for p in prompts], return_tensors="pt", padding=True)
        model.eval()
        with torch.no_grad():
            out = model.generate(
                **enc,
                do_sample=args.temperature > 0,
                temperature=args.temperature or None,
                top_k=0,
                max_new_tokens=args.new_tokens,
                pad_token_id=tok.pad_token_id,
            )
        plen = enc.input_ids.shape[1]
        gen = out[:, plen:]
        # Completion mask: tokens up to and including the first eos.
        is_eos = gen == tok.eos_token_id
        after_eos = (is_eos.cumsum(1) - is_eos.long()) > 0
        comp_mask = ~after_eos & (gen != tok.pad_token_id) | is_eos
        completions = tok.batch_decode(gen, skip_special_tokens=True)
        rewards = torch.tensor(task.score(prompts, completions))
        adv = group_advantages(rewards, args.group)
        model.train()
        attn = torch.cat([enc.attention_mask, comp_mask.long()], dim=1)
        logits = model(input_ids=out, attention_mask=attn).logits[:, plen - 1 : -1]
        logp = token_logprobs(logits, gen)
        res = grpo_loss(logp, logp.detach(), None, adv, comp_mask, clip=0.2, kl_coef=0.0)
        loss = res.seq_loss.mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        curve.append(rewards.mean().item())
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:3d} reward {curve[-1]:.3f} sample {completions[0]!r}", flush=True)
    k = 5
    start, end = sum(curve[:k]) / k, sum(curve[-k:]) / k
    print(
        f"RESULT task={args.task} params={params} reward={args.reward} dataset={args.dataset} "
        f"lr={args.lr} rank={args.rank} "
        f"group={args.group} prompts={args.prompts} new_tokens={args.new_tokens} "
        f"steps={args.steps} targets={args.targets} head_std={args.head_std} "
        f"start={start:.3f} end={end:.3f} time={time.time() - t0:.1f}s"
    )


if __name__ == "__main__":
    main()
