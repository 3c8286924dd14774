"""Run by tests/parallel/test_patches.py in a child process: k3-tiny in bf16 with megatron's fp32-master optimizer,
once as megatron builds it and once with ``coalesce_float16_params`` (the bf16 parameters and fp32 masters
in two flat buffers, one copy kernel per step). Three steps on the same data give bit-identical parameters,
masters and losses, and the coalesced copy is one ``copy_`` of the flat buffers. Then torch's fused AdamW (its
CPU kernel; what ``fuse_torch_adamw`` switches to on CUDA) stepped by ``patches.foreach_kernels.LeanFusedAdamWStep`` equals the
same kernel stepped by torch, bit for bit."""
import os
import sys

import torch

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1] if len(sys.argv) > 1 else "29741", RANK="0",
                  WORLD_SIZE="1", LOCAL_RANK="0")

from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402

from megatron_k3 import compat, perf  # noqa: E402
from megatron_k3.patches import foreach_kernels  # noqa: E402
from megatron_k3.config import get_preset  # noqa: E402
from megatron_k3.parallel.layout import ParallelLayout  # noqa: E402
from megatron_k3.parallel import adapter  # noqa: E402
from megatron_k3.parallel.runtime import (build_model_chunks, build_optimizer,  # noqa: E402
                                          init_distributed, make_forward_step, wrap_ddp)
from megatron_k3.model import K3ForCausalLM  # noqa: E402

cfg = get_preset("k3-tiny")
device = init_distributed(ParallelLayout(), seed=0)
golden = K3ForCausalLM(cfg, seed=0).state_dict()
batches = [{"tokens": t[:, :-1], "labels": t[:, 1:]} for t in
           torch.randint(0, cfg.vocab_size, (3, 2, 33), generator=torch.Generator().manual_seed(0))]


def train(coalesce: bool, fused: str | None = None):
    chunks, tconfig = build_model_chunks(cfg, ParallelLayout(), params_dtype=torch.bfloat16, device=device)
    adapter.load_hf_state_dict(chunks[0], golden, 0)
    ddp = wrap_ddp(chunks, tconfig)
    opt = build_optimizer(ddp, lr=1e-2, bf16=True, coalesce=coalesce)
    if fused:  # torch's fused AdamW as on CUDA (its CPU kernel), stepped by torch or by LeanFusedAdamWStep
        perf.configure(lean_adamw=fused == "lean")
        assert foreach_kernels.fuse_torch_adamw(opt, device_types=("cpu",)) == 1
        step = opt.chained_optimizers[0].optimizer.step
        assert isinstance(step, foreach_kernels.LeanFusedAdamWStep) == (fused == "lean")
    inners = getattr(opt, "chained_optimizers", [opt])  # megatron chains dense and expert parameters
    flats = [getattr(o, "k3_flat_params", None) for o in inners]
    assert all((f is not None) == coalesce for f in flats), flats
    if coalesce:
        for o, flat in zip(inners, flats):
            bf16 = [p for g in o.float16_groups for p in g]
            assert len(bf16) > 10 and all(p.untyped_storage().data_ptr() == flat[0].untyped_storage().data_ptr()
                                          for p in bf16)
            copies = []
            orig = torch.Tensor.copy_
            torch.Tensor.copy_ = lambda self, src, *a, **k: copies.append(self.numel()) or orig(self, src, *a, **k)
            o._copy_main_params_to_model_params()
            torch.Tensor.copy_ = orig
            assert copies == [flat[0].numel()], copies
    fb = get_forward_backward_func()
    start = {n: p.detach().clone() for n, p in chunks[0].named_parameters()}
    losses = []
    for b in batches:
        ddp[0].zero_grad_buffer()
        opt.zero_grad()
        out = fb(forward_step_func=make_forward_step(), data_iterator=iter([b]), model=ddp[0], num_microbatches=1,
                 seq_length=32, micro_batch_size=2, forward_only=False)
        losses.append(float(out[0]["lm_sum"]))
        ok, _, _ = opt.step()
        assert ok
    if fused == "lean":
        assert opt.chained_optimizers[0].optimizer.step.lean_steps == len(batches) - 1  # all but the first
    mains = [p.detach().clone() for o in inners for g in o.fp32_from_float16_groups for p in g]
    end = {n: p.detach().clone() for n, p in chunks[0].named_parameters()}
    assert sum(not torch.equal(start[n], end[n]) for n in end) > len(end) // 2  # the steps moved the weights
    return losses, end, mains


la, pa, ma = train(False)
lb, pb, mb = train(True)
assert la == lb, (la, lb)
assert pa.keys() == pb.keys()
for n in pa:
    assert torch.equal(pa[n], pb[n]), n
assert len(ma) == len(mb) and all(torch.equal(a, b) for a, b in zip(ma, mb))
# torch's fused AdamW kernel driven by LeanFusedAdamWStep: bit-identical to torch's own fused step
lc, pc, mc = train(True, fused="torch")
ld, pd, md = train(True, fused="lean")
assert lc == ld and all(torch.equal(pc[n], pd[n]) for n in pc) and all(torch.equal(a, b) for a, b in zip(mc, md))
print("lean fused AdamW: bit-identical over", len(batches), "steps")
print("coalesce check OK", len(pa), "params, losses", la)
