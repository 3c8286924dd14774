"""Run by tests/parallel/test_patches.py in a child process: patch 8 (patches/router_walks.py) (megatron's per-step router walks over a
cached list of each chunk's router-state modules) and the cached ``runtime.moe_routers`` give what the
unpatched walks give. k3-tiny with MTP on megatron's DDP, after a training forward (non-zero token counts):
megatron's expert-bias update gives bit-identical biases through the patched and the original function, and
the patched reset zeroes every router's counts."""
import importlib
import os
import sys

import torch

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1] if len(sys.argv) > 1 else "29747", RANK="0",
                  WORLD_SIZE="1", LOCAL_RANK="0")

from megatron.core.transformer.moe.router import TopKRouter  # noqa: E402

from megatron_k3.config import get_preset  # noqa: E402
from megatron_k3.parallel.layout import ParallelLayout  # noqa: E402
from megatron_k3.parallel import adapter  # noqa: E402
from megatron_k3.parallel.runtime import build_model_chunks, init_distributed, moe_routers, wrap_ddp  # noqa: E402
from megatron_k3.model import K3ForCausalLM  # noqa: E402

cfg = get_preset("k3-tiny", num_nextn_predict_layers=1)
layout = ParallelLayout()
device = init_distributed(layout, seed=0)
fmg = importlib.import_module("megatron.core.distributed.finalize_model_grads")
assert fmg.k3_cached_router_walks  # installed by setup_device
chunks, tconfig = build_model_chunks(cfg, layout, device=device, moe_router_bias_update_rate=1e-2)
adapter.load_hf_state_dict(chunks[0], K3ForCausalLM(cfg, seed=0).state_dict(), 0)
ddp = wrap_ddp(chunks, tconfig)
every = [m for m in chunks[0].modules() if isinstance(m, TopKRouter)]
assert len(every) == 8  # 7 MoE layers + the MTP layer

# runtime.moe_routers: cached, and equal to a fresh walk
first = moe_routers(ddp)
assert [r for _, r in first] == every and moe_routers(ddp) == first
assert [k for k, _ in first] == [str(i) for i in range(1, 8)] + ["mtp0"], [k for k, _ in first]

ids = torch.randint(0, cfg.vocab_size, (2, 34), generator=torch.Generator().manual_seed(0))
ddp[0](input_ids=ids[:, :32], labels=ids[:, 1:33], mtp_input_ids=[ids[:, 1:33]], mtp_labels=[ids[:, 2:]])
counts = [r.local_tokens_per_expert.clone() for r in every]
bias0 = [r.expert_bias.clone() for r in every]
assert all(c.sum() > 0 for c in counts)


def restore():
    with torch.no_grad():
        for r, c, b in zip(every, counts, bias0):
            r.local_tokens_per_expert.copy_(c)
            r.expert_bias.copy_(b)


fmg.k3_unpatched["_update_router_expert_bias"](ddp, tconfig)
want = [r.expert_bias.clone() for r in every]
restore()
fmg._update_router_expert_bias(ddp, tconfig)
got = [r.expert_bias.clone() for r in every]
assert all(not torch.equal(w, b) for w, b in zip(want, bias0))  # the update moved every bias
assert all(torch.equal(w, g) for w, g in zip(want, got))
fmg.reset_model_temporary_tensors(tconfig, ddp)
assert all(int(r.local_tokens_per_expert.count_nonzero()) == 0 for r in every)
restore()
fmg.k3_unpatched["reset_model_temporary_tensors"](tconfig, ddp)
assert all(int(r.local_tokens_per_expert.count_nonzero()) == 0 for r in every)
print("router walk check OK")
