"""Smoke pretraining of the golden (plain-PyTorch) K3 on generated data, on CPU.

This is the README's main job until the megatron-core trainer lands: it builds a preset, generates a
token stream from a fixed random Markov chain (so there is something learnable; its entropy rate is the
loss floor and is printed), trains with AdamW and warmup given as a fraction of the steps, and writes
``metrics.jsonl`` in the run directory. It exits non-zero if the loss is not finite or did not fall.

    python -m megatron_k3.smoke --preset k3-tiny --steps 150 --out runs/smoke
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

from .cli import UsageError, friendly_errors
from .config import PRESETS, get_preset, load_config


def markov_stream(vocab: int, n_tokens: int, seed: int, branching: int = 4):
    """Tokens from a random sparse Markov chain: each token has ``branching`` successors with random
    probabilities. Returns (tokens [n], entropy rate in nats/token of the chain's transitions)."""
    g = torch.Generator().manual_seed(seed)
    succ = torch.randint(0, vocab, (vocab, branching), generator=g)
    probs = torch.softmax(torch.randn(vocab, branching, generator=g) * 1.5, dim=-1)
    choice = torch.multinomial(probs, n_tokens, replacement=True, generator=g)  # [vocab, n] pre-drawn choices
    toks = torch.empty(n_tokens, dtype=torch.long)
    cur = int(torch.randint(0, vocab, (1,), generator=g))
    for i in range(n_tokens):
        toks[i] = cur
        cur = int(succ[cur, choice[cur, i]])
    ent = float(-(probs * probs.log()).sum(-1).mean())
    return toks, ent


def lr_at(step: int, total: int, lr: float, min_lr: float, warmup_fraction: float) -> float:
    warm = max(1, round(warmup_fraction * total))
    if step < warm:
        return lr * (step + 1) / warm
    t = (step - warm) / max(1, total - warm)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * t))


@friendly_errors
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="k3-tiny", help=f"one of: {', '.join(PRESETS)}")
    ap.add_argument("--config", help="model config file instead of --preset")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--seq-length", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr", type=float, default=3e-4)
    ap.add_argument("--lr-warmup-fraction", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default="runs/smoke")
    args = ap.parse_args(argv)
    if args.steps < 2 or args.micro_batch_size < 1 or args.seq_length < 2:
        raise UsageError("--steps must be >= 2, --micro-batch-size >= 1, --seq-length >= 2")
    if not 0 <= args.lr_warmup_fraction < 1:
        raise UsageError("--lr-warmup-fraction must be in [0, 1)")
    cfg = load_config(args.config) if args.config else get_preset(args.preset)
    from .model import K3ForCausalLM

    torch.manual_seed(args.seed)
    model = K3ForCausalLM(cfg, seed=args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    B, T = args.micro_batch_size, args.seq_length
    stream, floor = markov_stream(cfg.vocab_size, args.steps * B * (T + 1) + 1, args.seed)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    os.makedirs(args.out, exist_ok=True)
    mpath = os.path.join(args.out, "metrics.jsonl")
    print(f"[smoke] {cfg.name}: {n_params:,} parameters, {cfg.num_hidden_layers} layers "
          f"({cfg.layer_kinds.count('kda')} KDA + {cfg.layer_kinds.count('mla')} MLA), batch {B}x{T}, "
          f"{args.steps} steps; data: Markov chain, entropy floor {floor:.3f} nats/token")
    losses = []
    t0 = time.time()
    with open(mpath, "w") as mf:
        for step in range(args.steps):
            lr = lr_at(step, args.steps, args.lr, args.min_lr, args.lr_warmup_fraction)
            for grp in opt.param_groups:
                grp["lr"] = lr
            chunk = stream[step * B * (T + 1):(step + 1) * B * (T + 1)].view(B, T + 1)
            out = model(chunk[:, :-1], chunk[:, 1:])
            loss = out["loss"]
            if not torch.isfinite(loss):
                raise SystemExit(f"[smoke] non-finite loss at step {step}: {loss.item()}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
            opt.step()
            losses.append(loss.item())
            rec = {"step": step + 1, "loss": losses[-1], "lr": lr, "grad_norm": gnorm,
                   "tokens": (step + 1) * B * T, "elapsed_s": round(time.time() - t0, 3)}
            mf.write(json.dumps(rec) + "\n")
            if step % 10 == 0 or step == args.steps - 1:
                print(f"step {step + 1:5d}/{args.steps}  loss {losses[-1]:.4f}  lr {lr:.2e}  grad_norm {gnorm:.3f}  "
                      f"{(step + 1) * B * T / (time.time() - t0):.0f} tok/s", flush=True)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    print(f"[smoke] loss {first:.3f} -> {last:.3f} (ratio {last / first:.2f}); metrics: {mpath}")
    if not last < 0.8 * first:
        raise SystemExit("[smoke] FAILED: loss did not fall below 0.8x its initial value")
    print("[smoke] OK")


if __name__ == "__main__":
    main()
