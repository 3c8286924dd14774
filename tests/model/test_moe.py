"""Router and Stable LatentMoE: bias steers selection only, renormalised weights, dispatch == dense reference."""
import torch

from megatron_k3 import get_preset
from megatron_k3.model.common import rms_norm
from megatron_k3.model.moe import LatentMoE


def _moe(seed=0, dtype=torch.float64, **over):
    cfg = get_preset("k3-tiny", **over)
    m = LatentMoE(cfg)
    gen = torch.Generator().manual_seed(seed)
    for mod in m.modules():
        if hasattr(mod, "reset_parameters"):
            mod.reset_parameters(gen)
    return cfg, m.to(dtype)


def test_common_bias_shift_changes_nothing():
    cfg, m = _moe()
    x = torch.randn(3, 20, cfg.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        m.gate.e_score_correction_bias.copy_(torch.randn(cfg.num_experts) * 0.1)
    w0, i0, _ = m.gate(x.reshape(-1, cfg.hidden_size))
    y0 = m(x)
    with torch.no_grad():
        m.gate.e_score_correction_bias.add_(3.7)
    w1, i1, _ = m.gate(x.reshape(-1, cfg.hidden_size))
    assert torch.equal(i0, i1)
    torch.testing.assert_close(w0, w1)
    torch.testing.assert_close(m(x), y0)


def test_bias_steers_selection_but_not_weights_and_gets_no_gradient():
    cfg, m = _moe()
    x = torch.randn(64, cfg.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        m.gate.e_score_correction_bias.zero_()
        m.gate.e_score_correction_bias[3] = 10.0  # force expert 3 into every top-k
    w, idx, scores = m.gate(x)
    assert (idx == 3).any(-1).all()
    # the weights are the renormalised *unbiased* sigmoid scores of the chosen experts
    s = scores.gather(-1, idx)
    torch.testing.assert_close(w, s / s.sum(-1, keepdim=True) * cfg.routed_scaling_factor)
    torch.testing.assert_close(w.sum(-1), torch.full((64,), cfg.routed_scaling_factor, dtype=w.dtype))
    # the bias is a buffer: never a parameter, never a gradient; the gate weight does get one
    names = [n for n, _ in m.named_parameters()]
    assert "gate.e_score_correction_bias" not in names
    assert "gate.e_score_correction_bias" in m.state_dict()
    m(x.unsqueeze(0)).sum().backward()
    assert m.gate.e_score_correction_bias.grad is None and not m.gate.e_score_correction_bias.requires_grad
    assert m.gate.weight.grad is not None and m.gate.weight.grad.abs().sum() > 0


def test_dispatch_equals_dense_reference():
    """Every expert on every token, combined with a dense [N, E] weight matrix, then latent norm + up + shared."""
    cfg, m = _moe(seed=2, routed_scaling_factor=1.5)
    x = torch.randn(2, 17, cfg.hidden_size, dtype=torch.float64)
    flat = x.reshape(-1, cfg.hidden_size)
    w, idx, _ = m.gate(flat)
    dense_w = torch.zeros(flat.shape[0], cfg.num_experts, dtype=torch.float64).scatter(1, idx, w)
    z = flat @ m.routed_expert_down_proj.weight.t()
    outs = torch.stack([e(z) for e in m.experts], dim=1)  # [N, E, L]
    u = (dense_w.unsqueeze(-1) * outs).sum(1)
    y = rms_norm(u, m.routed_expert_norm.weight, cfg.rms_norm_eps) @ m.routed_expert_up_proj.weight.t()
    y = y + m.shared_experts(flat)
    torch.testing.assert_close(m(x), y.reshape(x.shape), rtol=1e-10, atol=1e-10)


def test_no_latent_variant_acts_on_hidden():
    cfg, m = _moe(routed_expert_hidden_size=None, latent_moe_use_norm=False, num_shared_experts=0)
    assert not hasattr(m, "routed_expert_down_proj") and not hasattr(m, "shared_experts")
    assert m.experts[0].w1.weight.shape == (cfg.moe_intermediate_size, cfg.hidden_size)
    x = torch.randn(1, 9, cfg.hidden_size, dtype=torch.float64)
    w, idx, _ = m.gate(x[0])
    ref = torch.zeros_like(x[0])
    for t in range(9):
        for j in range(cfg.num_experts_per_token):
            ref[t] += w[t, j] * m.experts[int(idx[t, j])](x[0, t:t + 1])[0]
    torch.testing.assert_close(m(x)[0], ref)


def test_grouped_expert_path_equals_the_loop():
    """LatentMoE's grouped-GEMM dispatch (the CUDA default) == the per-expert loop, values and gradients."""
    import copy

    from megatron_k3.config import get_preset
    from megatron_k3.model.moe import LatentMoE

    cfg = get_preset("k3-tiny")
    torch.manual_seed(0)
    a = LatentMoE(cfg).double()
    for p in a.parameters():
        torch.nn.init.normal_(p, std=0.1)
    b = copy.deepcopy(a)
    a.grouped, b.grouped = False, True
    x = torch.randn(2, 37, cfg.hidden_size, dtype=torch.float64)
    ya, yb = a(x), b(x)
    assert torch.allclose(ya, yb, rtol=1e-12, atol=1e-12)
    ya.square().sum().backward()
    yb.square().sum().backward()
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(pa.grad, pb.grad, rtol=1e-10, atol=1e-12), n


def test_grouped_linear_gradients_and_saved_bytes():
    """grouped_linear == per-group matmuls (values, input and weight gradients, empty groups included) and
    keeps only its input and the weights themselves for backward (no stacked copy)."""
    from megatron_k3.model.moe import grouped_linear

    torch.manual_seed(0)
    ws = [torch.randn(12, 8, dtype=torch.float64, requires_grad=True) for _ in range(4)]
    x = torch.randn(9, 8, dtype=torch.float64, requires_grad=True)
    offs = torch.tensor([3, 3, 7, 9], dtype=torch.int32)  # group 1 empty
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = grouped_linear(x, ws, offs)
    assert sum(t.data_ptr() not in {w.data_ptr() for w in ws} | {x.data_ptr(), offs.data_ptr()} for t in saved) == 0
    ref = torch.cat([x[0:3] @ ws[0].T, x[3:3] @ ws[1].T, x[3:7] @ ws[2].T, x[7:9] @ ws[3].T])
    assert torch.allclose(y, ref, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x, *w: grouped_linear(x, list(w), offs), (x, *ws))


def test_local_dispatcher_skips_sync_and_equals_megatron(root):
    """EP x TP = 1: no device-to-host copy/sync and no identity sort per MoE layer, bit-identical loss and
    gradients to megatron's stock all-to-all dispatcher; and through megatron's DDP the grouped experts'
    fused weight-gradient accumulation equals DDP's per-parameter hooks (tests/helpers/dispatch_check.py)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=root)
    r = subprocess.run([sys.executable, os.path.join(root, "tests", "helpers", "dispatch_check.py"), "29733"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "dispatch check OK" in r.stdout and "wgrad fusion check OK" in r.stdout, \
        r.stdout[-2000:] + r.stderr[-3000:]


def test_gather_permutation_equals_index_add_and_gradchecks():
    """permute_tokens/unpermute_tokens (the local dispatcher's atomic-free permutation): the values and both
    gradients equal megatron-style index_select / scatter_add, and gradcheck passes."""
    from megatron_k3.model.moe import permute_tokens, token_permutation, unpermute_tokens

    torch.manual_seed(0)
    N, E, k, D = 7, 5, 2, 3
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(N)])
    routing_map = torch.zeros(N, E, dtype=torch.bool).scatter_(1, idx, True)
    src = routing_map.T.reshape(-1).argsort(descending=True, stable=True)[: N * k] % N
    rows = token_permutation(src, N, k)
    assert sorted(rows.reshape(-1).tolist()) == list(range(N * k)) and bool((src[rows] == torch.arange(N)[:, None]).all())
    x = torch.randn(N, D, dtype=torch.float64, requires_grad=True)
    y = permute_tokens(x, src, rows)
    assert torch.equal(y, x.detach()[src])
    w = torch.randn(N * k, D, dtype=torch.float64)
    (y * w).sum().backward()
    assert torch.allclose(x.grad, torch.zeros_like(x).index_add(0, src, w), rtol=0, atol=1e-12)
    z = torch.randn(N * k, D, dtype=torch.float64, requires_grad=True)
    out = unpermute_tokens(z, src, rows)
    assert torch.allclose(out, torch.zeros(N, D, dtype=torch.float64).scatter_add(0, src[:, None].expand(-1, D), z),
                          rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda t: permute_tokens(t, src, rows), (x,))
    assert torch.autograd.gradcheck(lambda t: unpermute_tokens(t, src, rows), (z,))


def test_compiled_gather_sum_and_prob_scale_equal_eager():
    """The two glue functions the local dispatcher and the grouped experts compile on CUDA (traced here with
    the aot_eager backend: the graphs inductor lowers, run eagerly) equal their eager forms, gradients too."""
    from megatron_k3.parallel.experts import scale_rows
    from megatron_k3.model.common import compiled
    from megatron_k3.model.moe import gather_sum_reference

    torch.manual_seed(0)
    y = torch.randn(12, 5, dtype=torch.bfloat16)
    rows = torch.randperm(12).view(4, 3)
    ref = gather_sum_reference(y, rows)
    assert torch.equal(ref, (y.float()[rows.reshape(-1)].view(4, 3, 5)[:, 0] + y.float()[rows[:, 1]]
                             + y.float()[rows[:, 2]]).to(torch.bfloat16))
    assert torch.equal(compiled(gather_sum_reference, backend="aot_eager")(y, rows), ref)
    h = torch.randn(6, 4, dtype=torch.bfloat16, requires_grad=True)
    p = torch.rand(6, dtype=torch.float32, requires_grad=True)
    outs = []
    for fn in (scale_rows, compiled(scale_rows, backend="aot_eager")):
        h.grad = p.grad = None
        out = fn(h, p, torch.bfloat16)
        (out.float() * torch.arange(24.0).view(6, 4)).sum().backward()
        outs.append((out, h.grad.clone(), p.grad.clone()))
    assert outs[0][0].dtype == torch.bfloat16
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_compiled_stacked_grad_add_writes_the_interleaved_view_in_place():
    """``add_stacked_grad`` (the experts' weight gradients into megatron's main_grad buffer, where expert e's fc1
    block sits one fc1 + fc2 stride from expert e+1's, in reverse order): eager and compiled (traced here; inductor
    on CUDA) it adds in place into that strided view of the shared buffer, bit for bit as the per-expert loop,
    leaves every other element of the buffer alone, and takes a second layer's view (same shapes, another offset
    in the buffer) without recompiling."""
    from torch._dynamo.testing import CompileCounter

    from megatron_k3.model.common import compiled
    from megatron_k3.model.moe import add_stacked_grad

    E, out_f, in_f = 5, 6, 4
    shape, stride = (E, out_f, in_f), (2 * out_f * in_f, in_f, 1)
    counter = CompileCounter()
    counted = torch.compile(add_stacked_grad, backend=counter, fullgraph=True, dynamic=False)
    for reverse in (True, False):
        for offset in (8, 8 + 2 * E * out_f * in_f):  # two layers' fc1 views in one buffer
            torch.manual_seed(offset + reverse)
            orig = torch.randn(1000)
            g = torch.randn(shape).bfloat16()
            ref = orig.clone()
            ref_view = ref.as_strided(shape, stride, offset)
            for e in range(E):
                ref_view[e] += g[E - 1 - e if reverse else e].float()
            assert not torch.equal(ref, orig)
            for fn in (add_stacked_grad, counted, compiled(add_stacked_grad, backend="aot_eager")):
                buf = orig.clone()
                fn(buf.as_strided(shape, stride, offset), g, reverse)
                assert torch.equal(buf, ref), (fn, reverse, offset)
    assert counter.frame_count == 2  # one graph per direction, not one per offset


def test_router_logits_equal_megatrons_router_gating_linear():
    """``RouterLogits`` (the megatron router's logits on CUDA: bf16 GEMM with fp32 output forward, fp32 GEMMs
    backward) gives megatron's ``router_gating_linear`` fp32 logits and gradients; here (CPU) its forward is the
    fp32 GEMM, so the two agree bit for bit; on CUDA the forward sums the same exact products in another order."""
    from megatron.core.transformer.moe.moe_utils import RouterGatingLinearFunction

    from megatron_k3.parallel.layers import RouterLogits

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 7, 16, generator=gen).bfloat16().requires_grad_()
    w = torch.randn(6, 16, generator=gen).bfloat16().requires_grad_()
    g = torch.randn(3, 7, 6, generator=gen)
    outs = []
    for fn in (lambda: RouterLogits.apply(x, w), lambda: RouterGatingLinearFunction.apply(x, w, None, torch.float32)):
        y = fn()
        gx, gw = torch.autograd.grad(y, (x, w), g)
        outs.append((y, gx, gw))
    assert outs[0][0].dtype == torch.float32 and outs[0][1].dtype == torch.bfloat16 and outs[0][2].dtype == torch.bfloat16
    for a, b in zip(*outs):
        assert torch.equal(a, b)
