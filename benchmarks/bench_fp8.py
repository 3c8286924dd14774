#!/usr/bin/env python3
"""FP8 vs bf16 on the same model, data and initial weights, in one process (JSON).

    python benchmarks/bench_fp8.py --recipes bf16,blockwise,tensorwise,delayed --steps 200 --out R.json   # GPU
    python benchmarks/bench_fp8.py --smoke      # CPU: k3-tiny, bf16 (fp32 on CPU) + the FP8 refusal messages

For each recipe it builds the megatron K3 model (``--fp8-recipe`` path of the trainer: ``megatron_k3/
precision.py``), loads the same golden initial weights, and trains ``--steps`` AdamW steps on the same
batches, one micro-batch per step. The data (``--data``) is by default ``synthetic``: fresh tokens every
step from a fixed, learnable order-2 source (``synthetic_batches``), so nothing repeats, the loss at step k
is a held-out loss, and its floor (the source's entropy) is known; ``corpus`` takes random windows of the
embedded corpus instead (0.5 MB: 200 steps are ~8 epochs, so that loss measures memorisation and varies
~13% between two identical bf16 runs). A recipe named twice (``bf16,blockwise,bf16``) runs twice; the
second run is reported as ``bf16#2`` and gives the run-to-run spread the FP8 differences are judged against.
Per run: median step time after ``--warmup`` steps, tokens/s, the loss curve, the mean loss over the last
20 steps, and against the first ``bf16``: ``speedup_vs_bf16`` and ``final_loss_rel_diff_vs_bf16``.
A recipe the machine cannot run is recorded with the trainer's error message. The default model
(``FP8_MODEL``) is K3 at hidden 4096: 8 layers (KDA and MLA), 32 heads, 16 latent experts top-4, ~1.2B
parameters, which fits one GPU with AdamW.
"""
import argparse
import datetime
import json
import os
import statistics
import sys


import numpy as np  # noqa: E402
import torch  # noqa: E402

# K3 at hidden 4096 on top of k3-tiny (whose 512-token tokenizer ships with the embedded corpus)
FP8_MODEL = dict(hidden_size=4096, num_hidden_layers=8, kda_num_heads=32, kda_head_dim=128, kda_chunk_size=64,
                 num_attention_heads=32, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                 qk_rope_head_dim=64, v_head_dim=128, intermediate_size=11264, num_experts=16,
                 num_experts_per_token=4, num_shared_experts=1, moe_intermediate_size=1024,
                 routed_expert_hidden_size=1024, attn_res_block_size=4)


def windows(store: str, n: int, B: int, S: int, seed: int = 0):
    """``n`` batches (tokens, labels) [B, S] of random windows of the token store (the same for every recipe)."""
    from megatron_k3.data.store import open_store

    tokens, _, manifest = open_store(store)
    toks = np.asarray(tokens[:]).astype(np.int64)
    starts = np.random.default_rng(seed).integers(0, len(toks) - S - 1, size=(n, B))
    out = []
    for row in starts:
        w = torch.from_numpy(np.stack([toks[s:s + S + 1] for s in row]))
        out.append((w[:, :-1].contiguous(), w[:, 1:].contiguous()))
    return out


def synthetic_batches(vocab: int, n: int, B: int, S: int, device, seed: int = 0, dim: int = 16,
                      sharpness: float = 2.0):
    """``n`` batches [B, S] from the order-2 source p(x_t | x_{t-1}, x_{t-2}) = softmax(sharpness (U[x_{t-1}] +
    V[x_{t-2}]) W / sqrt(dim)) with U, V [vocab, dim] and W [dim, vocab] fixed N(0, 1) draws (``seed``), sampled
    by the Gumbel-max trick on ``device``. Returns the batches and the source's entropy in nats per token,
    averaged over the sampled positions (the loss a perfect model reaches)."""
    g = torch.Generator(device=device).manual_seed(seed)
    U, V, W = (torch.randn(*shape, generator=g, device=device) for shape in ((vocab, dim), (vocab, dim), (dim, vocab)))
    A, C = (sharpness * (M @ W) / dim ** 0.5 for M in (U, V))  # logits from x_{t-1} and from x_{t-2}
    x = torch.empty(n * B, S + 1, dtype=torch.long, device=device)
    x[:, :2] = torch.randint(0, vocab, (n * B, 2), generator=g, device=device)
    nats = torch.zeros((), dtype=torch.float64, device=device)
    for t in range(2, S + 1):
        logp = torch.log_softmax(A[x[:, t - 1]] + C[x[:, t - 2]], dim=-1)
        u = torch.rand(logp.shape, generator=g, device=device).clamp_(1e-20, 1.0)
        x[:, t] = (logp - torch.log(-torch.log(u))).argmax(-1)
        nats += -logp.gather(1, x[:, t:t + 1]).sum(dtype=torch.float64)
    entropy = float(nats) / (n * B * (S - 1))
    w = x.cpu().view(n, B, S + 1)
    return [(w[i, :, :-1].contiguous(), w[i, :, 1:].contiguous()) for i in range(n)], entropy


def run_recipe(recipe, cfg, batches, device, dtype, warmup, lr):
    from benchmark import megatron_step, time_steps

    from megatron_k3.parallel.layout import ParallelLayout
    from megatron_k3.parallel import adapter
    from megatron_k3.parallel.runtime import build_model_chunks, build_optimizer, make_forward_step
    from megatron_k3.parallel.runtime import wrap_ddp
    from megatron_k3.model import K3ForCausalLM
    from megatron_k3.parallel.precision import check_fp8_here, resolve

    fp8 = None if recipe == "bf16" else recipe
    check_fp8_here(fp8, None)
    chunks, tconfig = build_model_chunks(cfg, ParallelLayout(), params_dtype=dtype, device=device,
                                         **resolve(fp8, None))
    adapter.load_hf_state_dict(chunks[0], K3ForCausalLM(cfg, seed=0).state_dict(), 0)
    n_te = sum(type(m).__name__ == "TELinear" for m in chunks[0].modules())
    ddp = wrap_ddp(chunks, tconfig)
    opt = build_optimizer(ddp, lr=lr, bf16=dtype == torch.bfloat16)
    B, S = batches[0][0].shape
    step = megatron_step(ddp, opt, make_forward_step(), B, S)
    cuda = device.type == "cuda"
    times, outs, _ = time_steps(step, [[b] for b in batches], device, warmup)  # one micro-batch a step
    losses = [float(o[0]["lm_sum"]) / float(o[0]["n"]) for o in outs]
    if not all(np.isfinite(losses)):
        raise FloatingPointError(f"non-finite loss with {recipe}")
    med = statistics.median(times)
    res = {"median_step_s": med, "tokens_per_s": B * S / med, "te_linear_modules": n_te,
           "final_loss_mean_last20": float(np.mean(losses[-20:])), "loss_every_10": losses[::10],
           "peak_memory_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None}
    del step, opt, ddp, chunks
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipes", default="bf16,blockwise,tensorwise,delayed")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10, help="steps left out of the timing (they still train)")
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--seq-length", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--data", default="synthetic", choices=["synthetic", "corpus"],
                    help="fresh tokens from a learnable order-2 source (default) or windows of the embedded corpus")
    ap.add_argument("--smoke", action="store_true", help="CPU: k3-tiny, 6 steps, fp32")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29679"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    from benchmark import write_report
    from megatron.core import parallel_state as ps

    from megatron_k3.config import get_preset
    from megatron_k3.parallel.layout import ParallelLayout
    from megatron_k3.parallel.runtime import init_distributed
    from megatron_k3.train.pretrain import default_data, ensure_default_store
    from megatron_k3.parallel.precision import te_version

    if args.smoke:
        args.steps, args.warmup, args.micro_batch_size, args.seq_length = 6, 2, 2, 128
        cfg = get_preset("k3-tiny", seq_length=args.seq_length)
    else:
        cfg = get_preset("k3-tiny", seq_length=args.seq_length, **FP8_MODEL)
    device = init_distributed(ParallelLayout(), seed=0)
    cuda = device.type == "cuda"
    entropy = None
    if args.data == "corpus":
        store, tok = default_data(cfg)
        ensure_default_store(store, tok)
        batches = windows(store, args.steps, args.micro_batch_size, args.seq_length)
        data = "embedded corpus (data/corpus), random windows, seed 0, the same for every recipe"
    else:
        batches, entropy = synthetic_batches(cfg.vocab_size, args.steps, args.micro_batch_size, args.seq_length,
                                             device)
        data = ("synthetic order-2 source (synthetic_batches, seed 0): fresh tokens every step, the same for "
                "every recipe")
    dtype = torch.bfloat16 if cuda else torch.float32
    from megatron_k3.plan.model_info import model_info

    rep = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name(0) if cuda else "cpu",
           "command": " ".join(["python", "benchmarks/bench_fp8.py"] + sys.argv[1:]),
           "transformer_engine": te_version(), "dtype": str(dtype).replace("torch.", ""),
           "model": cfg.to_dict(), "params_total": model_info(cfg)["total_params"],
           "micro_batch_size": args.micro_batch_size, "seq_length": args.seq_length, "steps": args.steps,
           "data": data, "source_entropy_nats": entropy, "recipes": {}}
    recipes = args.recipes.split(",")
    for i, recipe in enumerate(recipes):
        n = recipes[:i].count(recipe)
        label = recipe if n == 0 else f"{recipe}#{n + 1}"
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            rep["recipes"][label] = run_recipe(recipe, cfg, batches, device, dtype, args.warmup, args.lr)
        except Exception as e:  # noqa: BLE001 - record (e.g. the refusal of a recipe this GPU cannot run)
            rep["recipes"][label] = {"error": f"{type(e).__name__}: {e}"[:600]}
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rep, f, indent=1)
    base = rep["recipes"].get("bf16", {})
    for name, r in rep["recipes"].items():
        if name != "bf16" and "median_step_s" in r and "median_step_s" in base:
            r["speedup_vs_bf16"] = base["median_step_s"] / r["median_step_s"]
            r["final_loss_rel_diff_vs_bf16"] = (r["final_loss_mean_last20"] / base["final_loss_mean_last20"]) - 1
    write_report(rep, args.out)
    ps.destroy_model_parallel()


if __name__ == "__main__":
    main()
