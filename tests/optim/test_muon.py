"""Per-head Muon against a straightforward per-head reference; AdamW part against torch.optim.AdamW."""
import math

import torch

from megatron_k3 import get_preset
from megatron_k3.model import K3ForCausalLM
from megatron_k3.optim.muon import MuonAdamW, newton_schulz5, uses_muon


def reference_ns(G, steps=5):
    """Newton-Schulz quintic written out plainly (Moonlight's coefficients)."""
    X = G.double()
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    X = X / (torch.linalg.matrix_norm(X) + 1e-7)
    for _ in range(steps):
        A = X @ X.T
        X = 3.4445 * X + (-4.7750 * A + 2.0315 * A @ A) @ X
    return X.T if tall else X


def test_newton_schulz_matches_reference_and_orthogonalises():
    torch.manual_seed(0)
    for shape in [(16, 64), (64, 16), (32, 32)]:
        G = torch.randn(*shape, dtype=torch.float64)
        torch.testing.assert_close(newton_schulz5(G), reference_ns(G), rtol=1e-10, atol=1e-10)
        s = torch.linalg.svdvals(newton_schulz5(G))
        assert s.min() > 0.5 and s.max() < 1.3   # the quintic drives singular values into ~[0.7, 1.2]


def test_per_head_muon_equals_reference():
    cfg = get_preset("k3-tiny")
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg, seed=0).double()
    ids = torch.randint(0, cfg.vocab_size, (2, 32))
    model(ids, torch.roll(ids, -1, 1))["loss"].backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    lr, wd, mu = 0.02, 0.1, 0.95
    opt = MuonAdamW(model.named_parameters(), lr=lr, weight_decay=wd, momentum=mu)
    opt.step()
    d = cfg.kda_head_dim
    checked = 0
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight",
                 "model.layers.3.self_attn.kv_b_proj.weight", "model.layers.1.block_sparse_moe.experts.2.w1.weight",
                 "model.layers.0.mlp.down_proj.weight"):
        W0, G = before[name], grads[name]
        D = G + mu * G                                   # first step: momentum buffer = G, Nesterov
        if name.endswith("q_proj.weight"):
            blocks, dim = G.shape[0] // d, 0
        elif name.endswith("o_proj.weight"):
            blocks, dim = G.shape[1] // d, 1
        elif name.endswith("kv_b_proj.weight"):
            blocks, dim = cfg.num_attention_heads, 0
        else:
            blocks, dim = 1, 0
        parts = []
        for blk in D.chunk(blocks, dim=dim):
            parts.append(0.2 * math.sqrt(max(blk.shape)) * reference_ns(blk))
        expect = W0 * (1 - lr * wd) - lr * torch.cat(parts, dim=dim)
        got = dict(model.named_parameters())[name].detach()
        torch.testing.assert_close(got, expect, rtol=1e-9, atol=1e-12)
        if blocks > 1:  # per-head really differs from orthogonalising the whole matrix
            whole = W0 * (1 - lr * wd) - lr * 0.2 * math.sqrt(max(D.shape)) * reference_ns(D)
            assert (got - whole).abs().max() > 1e-4
        checked += 1
    assert checked == 5


def test_adamw_part_equals_torch_adamw():
    cfg = get_preset("k3-tiny")
    a, b = K3ForCausalLM(cfg, seed=1), K3ForCausalLM(cfg, seed=1)
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    for m in (a, b):
        m(ids, torch.roll(ids, -1, 1))["loss"].backward()
    adam_names = [n for n, p in a.named_parameters() if not uses_muon(n, p)]
    assert "model.embed_tokens.weight" in adam_names and "lm_head.weight" in adam_names
    assert "model.layers.0.self_attn.A_log" in adam_names and "model.layers.0.mlp_res_proj.weight" in adam_names
    opt = MuonAdamW(a.named_parameters(), lr=1e-3, weight_decay=0.1)
    pb = dict(b.named_parameters())
    decay = [pb[n] for n in adam_names if pb[n].ndim == 2 and "_res_proj" not in n]
    no_decay = [pb[n] for n in adam_names if not (pb[n].ndim == 2 and "_res_proj" not in n)]
    ref = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    for _ in range(3):
        opt.step()
        ref.step()
    pa = dict(a.named_parameters())
    for n in adam_names:
        torch.testing.assert_close(pa[n], pb[n], rtol=1e-6, atol=1e-7)
