#!/usr/bin/env python3
"""Micro-benchmarks of the fast paths on the GPU, each against the form it replaced (device time).

Parts (``--parts``, default all):

- ``attention``: the MLA core at K3's head shapes (``d_qk = nope + rope`` > ``d_v``; k3-mini 96/64, k3-full
  192/128). ``sdpa`` is what the model calls (``F.scaled_dot_product_attention``, backend chosen by
  PyTorch); ``efficient`` / ``cudnn`` restrict SDPA to one backend; ``flash_pad_v`` zero-pads v to d_qk for
  the flash kernel (its output columns past d_v are exactly zero, so the math is unchanged).
- ``attn_res``: the Attention-Residual mixer (``attn_res.attn_res_mix_reference``, torch.compile'd as the
  model runs it) at k3-mini's [4, 4096, 1024] bf16 with N = 2..5 candidates, against the earlier einsum
  form of the same formula (``einsum_mix`` below) and the Triton kernels (``attn_res_triton.py``,
  ``--attn-res-impl triton``).
- ``ce``: cross-entropy of one [4096, 163840] bf16 logits chunk (the LM head's chunk at k3-mini):
  ``k3.cross_entropy_sum`` compiled against the eager ``F.cross_entropy(logits.float())``.

- ``ce_chunk``: one chunk of the LM head's fast CE (``linear_cross_entropy``'s ``chunk_fn``: loss sum and d logits
  of [4096, 163840] bf16 logits): ``ce_sum_and_grad`` torch.compile'd (``--cross-entropy-impl compiled``) against
  the Triton kernel (``ce_triton.py``, the default), device time of the kernels and the two results' differences.

- ``short_conv``: KDA's depthwise causal conv + SiLU at k3-mini's [8, 4096, 1024] bf16, reading a column
  slice of the fused projection output as the model does: fla's Triton ``causal_conv1d`` (what CUDA runs
  now) and this project's kernels (``short_conv_triton``, ``--short-conv-impl triton``: no forward recomputed in
  backward) against ``causal_conv1d_shifted`` compiled (what it ran before), all against the F.conv1d
  reference.
- ``linear_ce``: the LM head + CE of one micro-batch at k3-mini (32768 tokens, hidden 1024, vocabulary
  163840, bf16): ``linear_cross_entropy`` (gradients formed in forward, no recomputation; what the
  megatron model runs; at TP 1 here) against ``chunked_cross_entropy`` (each chunk recomputed in backward).

Each is timed forward + backward with CUDA events (median of ``--iters`` after warm-up and compilation;
``attn_res``, ``short_conv`` and ``linear_ce`` also report ``kernels_s``, the profiled device time of the kernels alone, which
is what the op costs inside the layers' CUDA graphs where launch time is hidden) and
checked against an fp32/fp64 reference (relative Frobenius error of the output and input gradients).

    source .gpu/bin/on_device.sh --no-te && python3 benchmarks/bench_ops.py --out $OUT/bench_ops.json
"""
import argparse
import datetime
import statistics


import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from benchmark import command_line, kernel_device_us, write_report  # noqa: E402
from gpu_check import reference_short_conv, rel  # noqa: E402


def time_fwd_bwd(fn, inputs, dy, iters, warmup=5):
    """Median seconds of ``fn(*inputs).backward(dy)``; returns (seconds, output, input grads)."""
    times = []
    for i in range(iters + warmup):
        for t in inputs:
            t.grad = None
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        y = fn(*inputs)
        y.backward(dy)
        b.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times), y.detach(), [t.grad for t in inputs]


def kernel_time_fwd_bwd(fn, inputs, dy, iters=5):
    """Device time of the kernels of one ``fn(*inputs).backward(dy)`` (profiler, summed, mean of ``iters``):
    what the op costs inside a CUDA graph, where the host's launch time is hidden. Call after warm-up."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            for t in inputs:
                t.grad = None
            fn(*inputs).backward(dy)
        torch.cuda.synchronize()
    return sum(kernel_device_us(e) for e in prof.key_averages()) / 1e6 / iters


# ---------------------------------------------------------------------------------------------- attention
def part_attention(iters):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def plain(q, k, v, scale):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

    def only(backend):
        def f(q, k, v, scale):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return f

    def flash_pad_v(q, k, v, scale):
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            o = F.scaled_dot_product_attention(q, k, F.pad(v, (0, q.shape[-1] - v.shape[-1])), is_causal=True,
                                               scale=scale)
        return o[..., :v.shape[-1]]

    variants = {"sdpa": plain, "efficient": only(SDPBackend.EFFICIENT_ATTENTION),
                "cudnn": only(SDPBackend.CUDNN_ATTENTION), "flash_pad_v": flash_pad_v}
    shapes = {"k3-mini [4, 4096, 16 heads, 96/64]": (4, 4096, 16, 96, 64),
              "k3-full head dims [1, 4096, 16 heads, 192/128]": (1, 4096, 16, 192, 128)}
    out = {}
    for sname, (B, T, H, dqk, dv) in shapes.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        q0, k0 = (torch.randn(B, H, T, dqk, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
        v0 = torch.randn(B, H, T, dv, device="cuda", generator=g, dtype=torch.bfloat16)
        dy = torch.randn(B, H, T, dv, device="cuda", generator=g, dtype=torch.bfloat16)
        scale = dqk ** -0.5
        qr, kr, vr = (t[:1].float().requires_grad_() for t in (q0, k0, v0))  # fp32 math reference, batch 0
        with sdpa_kernel([SDPBackend.MATH]):
            ref = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True, scale=scale)
        ref.backward(dy[:1].float())
        refs = (ref.detach(), qr.grad, kr.grad, vr.grad)
        flops = 3 * 2 * B * H * (T * T / 2) * (dqk + dv)  # 3x the causal forward
        res = {}
        for name, fn in variants.items():
            ins = [t.clone().requires_grad_() for t in (q0, k0, v0)]
            try:
                s, y, grads = time_fwd_bwd(lambda q, k, v: fn(q, k, v, scale), ins, dy, iters)
            except Exception as e:  # noqa: BLE001 - the backend refuses these shapes
                res[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
                continue
            res[name] = {"fwd_bwd_s": s, "tflops_3x_fwd": flops / s / 1e12,
                         "rel_err_vs_fp32": [rel(a[:1], b) for a, b in zip([y] + grads, refs)]}
        out[sname] = res
    return out


# ----------------------------------------------------------------------------------------------- attn_res
def einsum_mix(prefix, blocks, query, norm_weight, eps):
    """The mixer as first written (the same formula; its contractions as einsums)."""
    V = torch.stack(list(blocks) + [prefix], dim=0).float()
    K = V * torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + eps)
    s = torch.einsum("n...d,d->n...", K, norm_weight.float() * query.float())
    p = torch.softmax(s, dim=0)
    return torch.einsum("n...,n...d->...d", p, V).to(prefix.dtype)


def part_attn_res(iters):
    from megatron_k3.model.attn_res import attn_res_mix_reference
    from megatron_k3.model.attn_res_triton import attn_res_mix_triton
    from megatron_k3.model.common import compiled

    B, T, D = 4, 4096, 1024
    out = {}
    g = torch.Generator(device="cuda").manual_seed(0)
    for n in (2, 3, 4, 5):
        cands = [torch.randn(B, T, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(n)]
        q = torch.randn(D, device="cuda", generator=g) * 0.1
        w = torch.rand(D, device="cuda", generator=g) + 0.5
        dy = torch.randn(B, T, D, device="cuda", generator=g, dtype=torch.bfloat16)
        ref_in = [c.double().requires_grad_() for c in cands]
        ref = attn_res_mix_reference(ref_in[-1], ref_in[:-1], q.double(), w.double(), 1e-6)
        ref.backward(dy.double())
        refs = [ref.detach()] + [t.grad for t in ref_in]
        res = {}
        forms = (("einsum_compiled", compiled(einsum_mix)), ("now_compiled", compiled(attn_res_mix_reference)),
                 ("triton", attn_res_mix_triton))
        for name, fn in forms:
            ins = [c.clone().requires_grad_() for c in cands]
            mix = lambda *xs, fn=fn: fn(xs[-1], list(xs[:-1]), q, w, 1e-6)  # noqa: E731
            s, y, grads = time_fwd_bwd(mix, ins, dy, iters)
            nbytes = 2 * B * T * D * (n + 1) * 2  # fwd: read n, write 1; bwd: ~ the same again (bf16 floor)
            res[name] = {"fwd_bwd_s": s, "kernels_s": kernel_time_fwd_bwd(mix, ins, dy, 3),
                         "bytes_floor_s": nbytes / 4.3e12,
                         "rel_err_vs_fp64": [rel(a, b) for a, b in zip([y] + grads, refs)]}
        res["speedup"] = res["einsum_compiled"]["fwd_bwd_s"] / res["now_compiled"]["fwd_bwd_s"]
        res["speedup_triton_kernels"] = res["now_compiled"]["kernels_s"] / res["triton"]["kernels_s"]
        out[f"N={n}"] = res
    return out


# ------------------------------------------------------------------------------------------------------ ce
def ce_chunk_inputs(N: int = 4096, V: int = 163840):
    """One LM-head logits chunk at k3-mini ([N, V] bf16, N(0, 2) values) and its targets, every 17th ignored."""
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(N, V, device="cuda", generator=g) * 2).to(torch.bfloat16)
    tgt = torch.randint(0, V, (N,), device="cuda", generator=g)
    tgt[::17] = -100
    return logits, tgt


def part_ce(iters):
    from megatron_k3.model.common import compiled
    from megatron_k3.model.k3 import cross_entropy_sum

    logits0, tgt = ce_chunk_inputs()
    dy = torch.ones((), device="cuda")
    lr = logits0[:256].double().requires_grad_()
    ref = F.cross_entropy(lr, tgt[:256], ignore_index=-100, reduction="sum")
    ref.backward()
    ref_loss = float(ref)  # the first 256 rows' loss in fp64
    res = {}

    def eager(x):
        return F.cross_entropy(x.float(), tgt, ignore_index=-100, reduction="sum")

    fast = compiled(cross_entropy_sum)
    for name, fn in (("eager_fp32_logits", eager), ("compiled", lambda x: fast(x, tgt, -100))):
        x = logits0.clone().requires_grad_()
        s, y, (gx,) = time_fwd_bwd(fn, [x], dy, iters)
        res[name] = {"fwd_bwd_s": s, "peak_gib": torch.cuda.max_memory_allocated() / 2 ** 30,
                     "grad_rel_err_vs_fp64_rows0-255": rel(gx[:256], lr.grad), "loss": float(y),
                     "first_256_rows_loss_fp64": ref_loss}
        torch.cuda.reset_peak_memory_stats()
    res["speedup"] = res["eager_fp32_logits"]["fwd_bwd_s"] / res["compiled"]["fwd_bwd_s"]
    res["loss_rel_diff"] = abs(res["compiled"]["loss"] / res["eager_fp32_logits"]["loss"] - 1)
    return res


# ----------------------------------------------------------------------------------------------- ce_chunk
def part_ce_chunk(iters):
    from torch.profiler import ProfilerActivity, profile

    from megatron_k3.model.ce_triton import ce_sum_and_grad_triton
    from megatron_k3.model.common import compiled
    from megatron_k3.model.k3 import ce_sum_and_grad

    logits, tgt = ce_chunk_inputs()
    N, V = logits.shape
    res = {"bytes_floor_s": 3 * N * V * 2 / 3.35e12,  # two reads and one write at the H100's 3.35 TB/s
           "shape": [N, V]}
    outs = {}
    for name, fn in (("compiled", compiled(ce_sum_and_grad)), ("triton", ce_sum_and_grad_triton)):
        for _ in range(3):
            fn(logits, tgt, -100)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                out = fn(logits, tgt, -100)
            torch.cuda.synchronize()
        outs[name] = out
        res[name] = {"kernels_s": sum(kernel_device_us(e) for e in prof.key_averages()) / 1e6 / iters,
                     "loss": float(out[0])}
    (la, ga), (lb, gb) = outs["compiled"], outs["triton"]
    res["loss_rel_diff"] = abs(float(lb) / float(la) - 1)
    res["grad_rel_err"] = rel(gb, ga)
    res["grad_elements_differing"] = int((ga != gb).sum())
    res["speedup_kernels"] = res["compiled"]["kernels_s"] / res["triton"]["kernels_s"]
    return res


# ---------------------------------------------------------------------------------------------- short_conv
def part_short_conv(iters):
    from megatron_k3.model import kda

    B, T, C, K = 8, 4096, 1024, 4
    g = torch.Generator(device="cuda").manual_seed(0)
    proj = torch.randn(B, T, 3 * C, device="cuda", generator=g, dtype=torch.bfloat16)  # fused q/k/v output
    w0 = torch.randn(C, 1, K, device="cuda", generator=g) * 0.5
    dy = torch.randn(B, T, C, device="cuda", generator=g, dtype=torch.bfloat16)
    xr = proj[:1, :, :C].double().requires_grad_()                 # fp64 reference on batch 0
    wr = w0.double().requires_grad_()
    with reference_short_conv():
        yr = kda.causal_conv1d(xr, wr, True)
        yr.backward(dy[:1].double())
    fla = kda._fla_causal_conv1d()
    variants = {"compiled_shifted": kda.compiled(kda.causal_conv1d_shifted)}
    if fla is not None:
        variants["fla_triton"] = lambda x, w, act: fla(x, w.reshape(C, K), activation="silu", backend="triton")[0]
    from megatron_k3.model.short_conv_triton import short_conv_triton

    variants["k3_triton"] = short_conv_triton  # --short-conv-impl triton: no forward recomputed in backward
    res = {"bytes_floor_s": 5 * B * T * C * 2 / 4.3e12,  # fwd: read x, write y; bwd: read x and dy, write dx
           "impl_the_model_runs": kda.short_conv_impl(proj)}
    for name, fn in variants.items():
        x = proj[..., :C].detach().requires_grad_()                # a strided leaf, as the q slice is
        w = w0.clone().requires_grad_()
        s, y, (gx, gw) = time_fwd_bwd(lambda a, b: fn(a, b, True), [x, w], dy, iters)
        kernels_s = kernel_time_fwd_bwd(lambda a, b: fn(a, b, True), [x, w], dy)
        # the weight gradient sums all 8 sequences: batch 0's is compared through a call on batch 0 alone
        x1, w1 = proj[:1, :, :C].detach().requires_grad_(), w0.clone().requires_grad_()
        fn(x1, w1, True).backward(dy[:1])
        res[name] = {"fwd_bwd_s": s, "kernels_s": kernels_s, "rel_err_vs_fp64_batch0": {
            "y": rel(y[:1], yr.detach()), "dx": rel(gx[:1], xr.grad), "dw": rel(w1.grad, wr.grad)}}
    if "fla_triton" in res:  # fwd_bwd_s includes the host's launch time (fla's Python wrappers), kernels_s not
        res["speedup_fwd_bwd"] = res["compiled_shifted"]["fwd_bwd_s"] / res["fla_triton"]["fwd_bwd_s"]
        res["speedup_kernels"] = res["compiled_shifted"]["kernels_s"] / res["fla_triton"]["kernels_s"]
        res["k3_triton_vs_fla_kernels"] = res["fla_triton"]["kernels_s"] / res["k3_triton"]["kernels_s"]
    return res


# ----------------------------------------------------------------------------------------------- linear_ce
def part_linear_ce(iters):
    from megatron_k3.model.k3 import chunked_cross_entropy, linear_cross_entropy

    N, D, V = 32768, 1024, 163840
    g = torch.Generator(device="cuda").manual_seed(0)
    h0 = torch.randn(N, D, device="cuda", generator=g, dtype=torch.bfloat16)
    w0 = (torch.randn(V, D, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    tgt = torch.randint(0, V, (N,), device="cuda", generator=g)
    tgt[::17] = -100
    dy = torch.ones((), device="cuda")
    variants = {"recompute_chunked": lambda h, w: chunked_cross_entropy(h, w, tgt)[0],
                "fused_linear_ce": lambda h, w: linear_cross_entropy(h, w, tgt)}
    res, outs = {}, {}
    for name, fn in variants.items():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        ins = [h0.clone().requires_grad_(), w0.clone().requires_grad_()]
        base = torch.cuda.memory_allocated()
        s, y, grads = time_fwd_bwd(fn, ins, dy, iters, warmup=3)
        outs[name] = (y, grads)
        res[name] = {"fwd_bwd_s": s, "kernels_s": kernel_time_fwd_bwd(fn, ins, dy, 3),
                     "peak_extra_gib": (torch.cuda.max_memory_allocated() - base) / 2 ** 30, "loss": float(y)}
    (ya, ga), (yb, gb) = outs["recompute_chunked"], outs["fused_linear_ce"]
    res["fused_vs_recompute"] = {"loss_rel": abs(float(yb) / float(ya) - 1), "dh_rel": rel(gb[0], ga[0]),
                                 "dw_rel": rel(gb[1], ga[1])}
    res["speedup"] = res["recompute_chunked"]["fwd_bwd_s"] / res["fused_linear_ce"]["fwd_bwd_s"]
    res["flops_floor_s"] = 3 * 2 * N * D * V / 989e12  # logits, d hidden, d weight at the dense bf16 peak
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="attention,attn_res,ce,ce_chunk,short_conv,linear_ce")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rep = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "command": command_line("benchmarks/bench_ops.py"),
           "note": "fwd+bwd device time (CUDA events, median after warm-up)"}
    parts = {"attention": part_attention, "attn_res": part_attn_res, "ce": part_ce, "ce_chunk": part_ce_chunk,
             "short_conv": part_short_conv,
             "linear_ce": part_linear_ce}
    for p in args.parts.split(","):
        try:
            rep[p] = parts[p](args.iters)
        except Exception as e:  # noqa: BLE001 - keep the other parts
            rep[p] = {"error": f"{type(e).__name__}: {e}"[:600]}
        torch.cuda.empty_cache()
    write_report(rep, args.out)


if __name__ == "__main__":
    main()
