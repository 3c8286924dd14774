"""Run by tests/model/test_moe.py in a child process: at EP x TP = 1 the K3 MoE layers use
``LocalAlltoAllDispatcher`` (no device-to-host copy or sync, no identity split/cat sort, the atomic-free gather
permutation instead of megatron's permute/unpermute) and give bit-identical
loss and gradients to megatron's stock all-to-all dispatcher, which does copy/sync/sort. Then, through
megatron's DDP: the grouped experts' fused weight-gradient accumulation (one add into the stacked
``main_grad`` view per projection, no ``.grad``) gives the same ``main_grad`` over two accumulated
micro-batches as DDP's per-parameter hooks, and as the plain gradients."""
import os
import sys

import torch

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1] if len(sys.argv) > 1 else "29731", RANK="0",
                  WORLD_SIZE="1", LOCAL_RANK="0")

from megatron.core.transformer.moe import token_dispatcher as td  # noqa: E402

from megatron_k3.config import get_preset  # noqa: E402
from megatron_k3.parallel.layout import ParallelLayout  # noqa: E402
from megatron_k3.parallel import adapter  # noqa: E402
from megatron_k3.patches.local_dispatcher import LocalAlltoAllDispatcher  # noqa: E402
from megatron_k3.parallel.runtime import build_model_chunks, init_distributed  # noqa: E402
from megatron_k3.model import K3ForCausalLM  # noqa: E402

calls = {"dtoh": 0, "sort": 0, "permute": 0}
orig_dtoh = td.MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize
orig_sort = td.sort_chunks_by_idxs
orig_permute, orig_unpermute = td.permute, td.unpermute


def counting_dtoh(self, point, tokens_per_expert=None):
    calls["dtoh"] += 1
    return orig_dtoh(self, point, tokens_per_expert)


def counting_sort(*a, **k):
    calls["sort"] += 1
    return orig_sort(*a, **k)


def counting(orig):
    def f(*a, **k):
        calls["permute"] += 1
        return orig(*a, **k)
    return f


td.MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = counting_dtoh
td.sort_chunks_by_idxs = counting_sort
td.permute, td.unpermute = counting(orig_permute), counting(orig_unpermute)

cfg = get_preset("k3-tiny")
device = init_distributed(ParallelLayout(), seed=0)
chunks, tconfig = build_model_chunks(cfg, ParallelLayout(), device=device)
model = chunks[0]
adapter.load_hf_state_dict(model, K3ForCausalLM(cfg, seed=0).state_dict(), 0)
dispatchers = [m.token_dispatcher for m in model.modules() if hasattr(m, "token_dispatcher")]
assert dispatchers and all(isinstance(d, LocalAlltoAllDispatcher) and d.k3_local for d in dispatchers)
ids = torch.randint(0, cfg.vocab_size, (2, 65), generator=torch.Generator().manual_seed(0))


def run():
    model.zero_grad(set_to_none=True)
    loss, _ = model(input_ids=ids[:, :-1], labels=ids[:, 1:])
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


local = run()
local_calls = dict(calls)
for d in dispatchers:  # megatron's own dispatcher, same state
    d.__class__ = td.MoEAlltoAllTokenDispatcher
stock = run()
stock_calls = {k: calls[k] - local_calls[k] for k in calls}
assert local_calls == {"dtoh": 0, "sort": 0, "permute": 0}, local_calls  # the gather permutation instead
assert stock_calls["dtoh"] > 0 and stock_calls["sort"] > 0 and stock_calls["permute"] > 0, stock_calls
assert torch.equal(local[0], stock[0]), (local[0], stock[0])
assert local[1].keys() == stock[1].keys() and len(local[1]) > 0
for n in local[1]:
    assert torch.equal(local[1][n], stock[1][n]), n
print("dispatch check OK", float(local[0]), len(dispatchers), "MoE layers", stock_calls)

# ---- weight-gradient accumulation fusion of the grouped experts, through megatron's DDP
from megatron_k3.parallel.experts import GroupedExperts  # noqa: E402
from megatron_k3.parallel.runtime import wrap_ddp  # noqa: E402
from megatron_k3.model.moe import stacked_main_grad  # noqa: E402

for d in dispatchers:
    d.__class__ = LocalAlltoAllDispatcher
model.zero_grad(set_to_none=True)  # DDP's hooks would add a stale .grad to main_grad
ddp = wrap_ddp(chunks, tconfig)
groups = [m for m in model.modules() if isinstance(m, GroupedExperts)]
experts = [p for m in groups for p in m.parameters()]
assert groups and all(p.k3_fuse_wgrad for p in experts)
for m in groups:  # megatron's buffer layout is the evenly spaced one the fusion needs
    for k in ("linear_fc1", "linear_fc2"):
        ws = [getattr(e, k).weight for e in m.local_experts]
        view, reverse = stacked_main_grad(ws)
        for e, w in enumerate(ws):
            assert view[len(ws) - 1 - e if reverse else e].data_ptr() == w.main_grad.data_ptr()


def run_ddp():
    ddp[0].zero_grad_buffer()
    for mb in range(2):  # two micro-batches accumulate into main_grad
        loss, _ = ddp[0](input_ids=ids[:, :-1], labels=ids[:, 1:])
        loss.backward()
    assert all(p.grad is None for p in model.parameters())
    return {n: p.main_grad.clone() for n, p in model.named_parameters() if p.requires_grad}


import megatron_k3.model.moe as moe_mod  # noqa: E402

fusions = []
moe_mod.stacked_main_grad = lambda ws: fusions.append(stacked_main_grad(ws)) or fusions[-1]
fused = run_ddp()
assert len(fusions) == 2 * 2 * len(groups) and all(f is not None for f in fusions), len(fusions)  # 2 mb x fc1/fc2
for p in experts:
    p.k3_fuse_wgrad = False
fusions.clear()
hooks = run_ddp()
assert fusions and all(f is None for f in fusions)
assert fused.keys() == hooks.keys()
for n in fused:
    assert torch.equal(fused[n], hooks[n]), n
for n, g in local[1].items():  # = twice the plain gradient of one micro-batch
    assert torch.equal(fused[n], 2 * g), n
expert_names = [n for n in fused if ".experts." in n]
assert expert_names and all(fused[n].abs().sum() > 0 for n in expert_names)
print("wgrad fusion check OK", len(groups), "expert groups,", len(expert_names), "expert weights")
