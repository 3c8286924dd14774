"""Run by tests/test_moe.py in a child process: at EP x TP = 1 the K3 MoE layers use
``LocalAlltoAllDispatcher`` (no device-to-host copy or sync, no identity split/cat sort) and give bit-identical
loss and gradients to megatron's stock all-to-all dispatcher, which does copy/sync/sort."""
import os
import sys

import torch

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1] if len(sys.argv) > 1 else "29731", RANK="0",
                  WORLD_SIZE="1", LOCAL_RANK="0")

from megatron.core.transformer.moe import token_dispatcher as td  # noqa: E402

from megatron_k3.config import get_preset  # noqa: E402
from megatron_k3.layout import ParallelLayout  # noqa: E402
from megatron_k3.megatron import adapter  # noqa: E402
from megatron_k3.megatron.experts import LocalAlltoAllDispatcher  # noqa: E402
from megatron_k3.megatron.runtime import build_model_chunks, init_distributed  # noqa: E402
from megatron_k3.model import K3ForCausalLM  # noqa: E402

calls = {"dtoh": 0, "sort": 0}
orig_dtoh = td.MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize
orig_sort = td.sort_chunks_by_idxs


def counting_dtoh(self, point, tokens_per_expert=None):
    calls["dtoh"] += 1
    return orig_dtoh(self, point, tokens_per_expert)


def counting_sort(*a, **k):
    calls["sort"] += 1
    return orig_sort(*a, **k)


td.MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = counting_dtoh
td.sort_chunks_by_idxs = counting_sort

cfg = get_preset("k3-tiny")
device = init_distributed(ParallelLayout(), seed=0)
chunks, _ = build_model_chunks(cfg, ParallelLayout(), device=device)
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
assert local_calls == {"dtoh": 0, "sort": 0}, local_calls
assert stock_calls["dtoh"] > 0 and stock_calls["sort"] > 0, stock_calls
assert torch.equal(local[0], stock[0]), (local[0], stock[0])
assert local[1].keys() == stock[1].keys() and len(local[1]) > 0
for n in local[1]:
    assert torch.equal(local[1][n], stock[1][n]), n
print("dispatch check OK", float(local[0]), len(dispatchers), "MoE layers", stock_calls)
