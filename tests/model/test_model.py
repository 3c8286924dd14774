"""The golden K3 model end to end: finite loss, gradients everywhere, explicit and seeded initialisation."""
import torch

from megatron_k3 import get_preset
from megatron_k3.model import K3ForCausalLM
from megatron_k3.model.k3 import ce_sum_and_grad, chunked_cross_entropy, cross_entropy_sum, linear_cross_entropy


def _batch(cfg, B=4, T=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    return ids, labels


def test_tiny_forward_backward_gradient_on_every_parameter():
    cfg = get_preset("k3-tiny", num_nextn_predict_layers=1)
    m = K3ForCausalLM(cfg, seed=0)
    # Non-zero pseudo-queries: at zero queries the AttnRes norm gains get an exactly-zero gradient by design.
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("_res_proj.weight"):
                p.normal_(0, 0.5)
    ids, labels = _batch(cfg)
    out = m(ids, labels)
    assert torch.isfinite(out["loss"]) and len(out["mtp_losses"]) == 1
    # random init: loss near log(V)
    assert abs(out["lm_loss"].item() - torch.log(torch.tensor(float(cfg.vocab_size))).item()) < 0.5
    out["loss"].backward()
    # layer 0's attention mixer is never used: its layer sees no completed block yet (spec section 6).
    unused = {"model.layers.0.self_attention_res_norm.weight", "model.layers.0.self_attention_res_proj.weight"}
    for n, p in m.named_parameters():
        if n in unused:
            assert p.grad is None, n
            continue
        assert p.grad is not None, n
        assert torch.isfinite(p.grad).all(), n
        assert p.grad.abs().sum() > 0, n


def test_same_seed_same_weights_other_seed_different():
    cfg = get_preset("k3-tiny")
    a, b, c = K3ForCausalLM(cfg, seed=1), K3ForCausalLM(cfg, seed=1), K3ForCausalLM(cfg, seed=2)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sc.keys()
    constant = 0
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
        assert torch.isfinite(sa[k]).all(), k
        if sa[k].unique().numel() == 1:  # deterministic inits: norms (1), A_log (0), pseudo-queries/bias (0)
            assert torch.equal(sa[k], sc[k]), k
            constant += 1
        else:
            assert not torch.equal(sa[k], sc[k]), k
    assert 0 < constant < len(sa)


def test_every_parameter_and_buffer_is_explicitly_initialised():
    """Build on meta, materialise as NaN garbage, init: nothing may stay NaN and the result equals a normal build."""
    cfg = get_preset("k3-tiny", num_nextn_predict_layers=1)
    with torch.device("meta"):
        m = K3ForCausalLM(cfg, init=False)
    m.to_empty(device="cpu")
    with torch.no_grad():
        for t in list(m.parameters()) + list(m.buffers()):
            t.fill_(float("nan"))
    m.init_weights(seed=7)
    ref = K3ForCausalLM(cfg, seed=7).state_dict()
    for k, v in m.state_dict().items():
        assert not torch.isnan(v).any(), f"{k} was left uninitialised"
        assert torch.equal(v, ref[k]), k


def test_init_statistics():
    cfg = get_preset("k3-tiny")
    m = K3ForCausalLM(cfg, seed=0)
    sd = m.state_dict()
    assert abs(sd["model.embed_tokens.weight"].std().item() - cfg.init_std) < 0.002
    dt = torch.nn.functional.softplus(sd["model.layers.0.self_attn.dt_bias"])
    assert dt.min() >= 1e-4 - 1e-9 and dt.max() <= 0.1 + 1e-6
    assert torch.all(sd["model.layers.1.block_sparse_moe.gate.e_score_correction_bias"] == 0)
    assert sd["model.layers.0.self_attn.A_log"].shape == (cfg.kda_num_heads,)
    assert sd["model.layers.0.self_attn.q_conv1d.weight"].dtype == torch.float32


def test_official_names_present():
    cfg = get_preset("k3-tiny")
    keys = set(K3ForCausalLM(cfg, seed=0).state_dict())
    expect = [
        "model.embed_tokens.weight", "model.norm.weight", "model.output_attn_res_norm.weight",
        "model.output_attn_res_proj.weight", "lm_head.weight",
        "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.self_attention_res_proj.weight", "model.layers.0.mlp_res_norm.weight",
        "model.layers.0.self_attn.f_a_proj.weight", "model.layers.0.self_attn.f_b_proj.weight",
        "model.layers.0.self_attn.A_log", "model.layers.0.self_attn.dt_bias", "model.layers.0.self_attn.b_proj.weight",
        "model.layers.0.self_attn.g_proj.weight", "model.layers.0.self_attn.o_norm.weight",
        "model.layers.0.self_attn.k_conv1d.weight",
        "model.layers.3.self_attn.q_a_proj.weight", "model.layers.3.self_attn.q_a_layernorm.weight",
        "model.layers.3.self_attn.q_b_proj.weight", "model.layers.3.self_attn.kv_a_proj_with_mqa.weight",
        "model.layers.3.self_attn.kv_a_layernorm.weight", "model.layers.3.self_attn.kv_b_proj.weight",
        "model.layers.3.self_attn.o_proj.weight", "model.layers.3.self_attn.g_proj.weight",
        "model.layers.1.block_sparse_moe.gate.weight", "model.layers.1.block_sparse_moe.gate.e_score_correction_bias",
        "model.layers.1.block_sparse_moe.routed_expert_down_proj.weight",
        "model.layers.1.block_sparse_moe.routed_expert_norm.weight",
        "model.layers.1.block_sparse_moe.routed_expert_up_proj.weight",
        "model.layers.1.block_sparse_moe.experts.7.w1.weight", "model.layers.1.block_sparse_moe.experts.7.w2.weight",
        "model.layers.1.block_sparse_moe.experts.7.w3.weight",
        "model.layers.1.block_sparse_moe.shared_experts.gate_proj.weight",
    ]
    missing = [k for k in expect if k not in keys]
    assert not missing, missing
    # layer kinds follow K3's rule at 8 layers: MLA at 4 and the last two (7, 8), 1-indexed
    assert cfg.full_attn_layers == [4, 7, 8]


def test_chunked_cross_entropy_equals_full():
    torch.manual_seed(0)
    h = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(30, 16, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 30, (50,))
    t[::7] = -100
    s, n = chunked_cross_entropy(h, w, t, chunk_tokens=8)
    ref = torch.nn.functional.cross_entropy(h @ w.t(), t, ignore_index=-100, reduction="sum")
    torch.testing.assert_close(s, ref)
    assert n.item() == (t != -100).sum().item()
    g1 = torch.autograd.grad(s, (h, w))
    g2 = torch.autograd.grad(ref, (h, w))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)


def test_linear_cross_entropy_equals_full_and_scales_its_gradients():
    """The fast CE (gradients formed in forward, chunk by chunk) gives the full CE's sum and gradients, scaled
    by the incoming gradient, for either input alone; a ragged last chunk; without autograd the same sum."""
    from megatron_k3.model.common import compiled

    torch.manual_seed(0)
    h0 = torch.randn(50, 16, dtype=torch.float64)
    w0 = torch.randn(30, 16, dtype=torch.float64)
    t = torch.randint(0, 30, (50,))
    t[::7] = -100
    ref_h, ref_w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(ref_h @ ref_w.t(), t, ignore_index=-100, reduction="sum")
    gh_ref, gw_ref = torch.autograd.grad(ref * 0.3, (ref_h, ref_w))
    for need_h, need_w in ((True, True), (True, False), (False, True)):
        h, w = h0.clone().requires_grad_(need_h), w0.clone().requires_grad_(need_w)
        s = linear_cross_entropy(h, w, t, chunk_tokens=8)
        torch.testing.assert_close(s, ref.detach())
        (s * 0.3).backward()
        if need_h:
            torch.testing.assert_close(h.grad, gh_ref)
        if need_w:
            torch.testing.assert_close(w.grad, gw_ref)
        assert (h.grad is None) != need_h and (w.grad is None) != need_w
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(h0, w0, t, chunk_tokens=8), ref.detach())
    # the per-chunk loss + gradient, eager and traced (aot_eager: the graph the CUDA path compiles)
    logits = (torch.randn(20, 30, generator=torch.Generator().manual_seed(1)) * 3).to(torch.bfloat16)
    lx = logits.float().requires_grad_()
    expect = cross_entropy_sum(lx, t[:20])
    expect.backward()
    for fn in (ce_sum_and_grad, compiled(ce_sum_and_grad, backend="aot_eager")):
        loss, g = fn(logits, t[:20], -100)
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(loss, expect.detach())
        torch.testing.assert_close(g.float(), lx.grad, rtol=1e-2, atol=1e-2)
        assert g[::7].eq(0).all()


def test_ce_chunk_form_choice():
    """CUDA chunks go through the Triton kernel unless ``perf.cross_entropy = compiled``; CPU chunks run the
    plain function (compiled only with ``compile = all``)."""
    from megatron_k3 import perf
    from megatron_k3.model.k3 import ce_chunk_impl

    h = torch.zeros(2, 3)
    assert ce_chunk_impl(h) == "reference"
    with perf.using(cross_entropy="triton"):  # the kernel is for CUDA tensors
        assert ce_chunk_impl(h) == "reference"
    with perf.using(compile="all"):
        assert ce_chunk_impl(h) == "compiled"
    if torch.cuda.is_available():
        assert ce_chunk_impl(h.cuda()) == "triton"
        with perf.using(cross_entropy="compiled"):
            assert ce_chunk_impl(h.cuda()) == "compiled"


def test_ce_triton_kernel_under_interpreter(run_triton_interpreted):
    """The LM head's CE chunk kernel (``ce_triton.py``, the CUDA default) against ``ce_sum_and_grad`` in fp64,
    run by Triton's interpreter on the CPU: ignored rows (zero gradient, no loss), a vocabulary that is not a
    multiple of the tile (masked lanes, one and several tiles), a target in the last tile, large logits
    (the online max), a strided chunk (row stride past V), fp32 and bf16 logits."""
    run_triton_interpreted(r"""
import megatron_k3.model.ce_triton as ce
from megatron_k3.model.k3 import ce_sum_and_grad
ce.BLOCK_V = 64  # several tiles of a small vocabulary (the GPU's tile is 4096)
torch.manual_seed(0)
for n, V, dt, scale, strided, tol in ((9, 50, torch.float32, 3.0, False, 1e-6), (7, 200, torch.float32, 40.0, True, 1e-6),
                                      (6, 130, torch.bfloat16, 5.0, False, 1e-2), (1, 64, torch.float32, 1.0, False, 1e-6)):
    base = (torch.randn(n, V + 5) * scale).to(dt)
    logits = base[:, :V] if strided else base[:, :V].contiguous()
    t = torch.randint(0, V, (n,))
    t[0] = V - 1
    if n > 2:
        t[2] = -100
    assert ce.supported(logits, t) and logits.is_contiguous() != strided
    loss, g = ce.ce_sum_and_grad_triton(logits, t, -100)
    rl, rg = ce_sum_and_grad(logits.double(), t, -100)
    assert g.dtype == dt and g.shape == logits.shape and g.is_contiguous()
    assert rel(loss, rl) <= 1e-6 and rel(g, rg) <= tol, (n, V, dt, rel(loss, rl), rel(g, rg))
    if n > 2:
        assert g[2].eq(0).all()
assert not ce.supported(torch.zeros(2, 3, 4), torch.zeros(2, dtype=torch.long))
assert not ce.supported(torch.zeros(3, 4, dtype=torch.float64), torch.zeros(3, dtype=torch.long))
print("OK")
""")


def test_layer_checkpointing_same_loss_and_grads():
    cfg = get_preset("k3-tiny")
    ids, labels = _batch(cfg, B=2, T=32)
    grads = []
    for ckpt in (False, True):
        m = K3ForCausalLM(cfg, seed=4).double()
        m.checkpoint_layers = ckpt
        out = m(ids, labels)
        out["loss"].backward()
        grads.append((out["loss"].detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-12, atol=1e-12)
    for n in grads[0][1]:
        torch.testing.assert_close(grads[0][1][n], grads[1][1][n], rtol=1e-10, atol=1e-12)


def test_kimi_linear_variant_runs():
    cfg = get_preset("kimi-linear-48b").replace(
        hidden_size=64, num_hidden_layers=4, kda_layers=[1, 2, 3], kda_num_heads=2, kda_head_dim=16,
        num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        intermediate_size=64, num_experts=4, num_experts_per_token=2, moe_intermediate_size=16, vocab_size=97,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    m = K3ForCausalLM(cfg.validate(), seed=0)
    keys = set(m.state_dict())
    assert "model.layers.0.self_attn.g_a_proj.weight" in keys and "model.layers.3.self_attn.q_proj.weight" in keys
    assert not any("_res_" in k or "routed_expert" in k for k in keys)
    ids, labels = _batch(cfg, B=2, T=20)
    out = m(ids, labels)
    out["loss"].backward()
    assert torch.isfinite(out["loss"])


def test_layout_fused_norm_and_gate_equal_their_two_steps():
    """``rms_norm_batch_first`` and ``sigmoid_gate_seq_first`` (the megatron layers' norm before the token mixer and
    output gate after it, each writing the other layout), eager and traced (aot_eager: the graph the CUDA path
    compiles into one kernel): the same values and gradients as the norm/gate followed by the transpose copy, in a
    contiguous output of the other layout; the gate also takes the attention's strided [B, T, H, v] output."""
    from megatron_k3.model.common import (compiled, rms_norm, rms_norm_batch_first, sigmoid_gate,
                                          sigmoid_gate_seq_first)

    gen = torch.Generator().manual_seed(3)
    S, B, D, H, v = 7, 3, 12, 2, 5
    x = torch.randn(S, B, D, generator=gen).bfloat16().requires_grad_()
    w = torch.randn(D, generator=gen).bfloat16().requires_grad_()
    gy = torch.randn(B, S, D, generator=gen).bfloat16()
    ref = rms_norm(x, w, 1e-6).transpose(0, 1).contiguous()
    rx, rw = torch.autograd.grad(ref, (x, w), gy)
    for fn in (rms_norm_batch_first, compiled(rms_norm_batch_first, backend="aot_eager")):
        y = fn(x, w, 1e-6)
        assert y.shape == (B, S, D) and y.is_contiguous() and torch.equal(y, ref)
        gx, gw = torch.autograd.grad(y, (x, w), gy)
        assert torch.equal(gx, rx) and torch.equal(gw, rw)
    o = torch.randn(B, H, S, v, generator=gen).bfloat16().transpose(1, 2).requires_grad_()  # SDPA's [B, T, H, v] view
    g = torch.randn(B, S, H * v, generator=gen).bfloat16().requires_grad_()
    go = torch.randn(S, B, H * v, generator=gen).bfloat16()
    ref = sigmoid_gate(o.reshape(B, S, -1), g, torch.bfloat16).transpose(0, 1).contiguous()
    ro, rg = torch.autograd.grad(ref, (o, g), go)
    for fn in (sigmoid_gate_seq_first, compiled(sigmoid_gate_seq_first, backend="aot_eager")):
        y = fn(o, g, torch.bfloat16)
        assert y.shape == (S, B, H * v) and y.is_contiguous() and torch.equal(y, ref)
        go_, gg_ = torch.autograd.grad(y, (o, g), go)
        assert torch.equal(go_, ro) and torch.equal(gg_, rg)


def test_split_columns_backward_is_the_plain_split():
    """``SplitColumns`` (the pieces of KDA's fused projection output; its backward one compiled concatenation on
    CUDA), with the concatenation eager and traced (``compile = all``, aot_eager): the same views forward and
    the same d y as autograd's split, bit for bit, including a piece whose gradient is unused (zeros)."""
    from megatron_k3 import perf
    from megatron_k3.parallel.layers import SplitColumns

    gen = torch.Generator().manual_seed(5)
    y0 = torch.randn(2, 3, 17, generator=gen).bfloat16()
    sizes = [4, 4, 1, 8]
    grads = [torch.randn(2, 3, n, generator=gen).bfloat16() for n in sizes]
    y = y0.clone().requires_grad_()
    ref = torch.autograd.grad(y.split(sizes, dim=-1)[:3], y, grads[:3])[0]
    for mode in ({}, {"compile": "all", "compile_backend": "aot_eager"}):
        with perf.using(**mode):
            y = y0.clone().requires_grad_()
            parts = SplitColumns.apply(y, sizes)
            assert [tuple(p.shape) for p in parts] == [(2, 3, n) for n in sizes]
            assert all(torch.equal(p, r) for p, r in zip(parts, y0.split(sizes, dim=-1)))
            (gy,) = torch.autograd.grad(parts[:3], y, grads[:3])
            assert torch.equal(gy, ref)


def test_kda_output_norm_and_gate_in_one_function():
    """``rms_norm_gate_seq_first`` (the megatron KDA layer's output norm and gate, one compiled kernel each way on
    CUDA) equals ``mix``'s fp32 norm followed by ``sigmoid_gate_seq_first``, bit for bit, eager and traced
    (aot_eager), with the gradients of o, the norm weight and the gate."""
    from megatron_k3.model.common import compiled, rms_norm, rms_norm_gate_seq_first, sigmoid_gate_seq_first

    gen = torch.Generator().manual_seed(7)
    B, T, H, d = 2, 5, 3, 8
    o = torch.randn(B, T, H, d, generator=gen).bfloat16().requires_grad_()
    w = (1 + 0.1 * torch.randn(d, generator=gen)).requires_grad_()  # o_norm.weight is fp32
    gate = torch.randn(B, T, H, d, generator=gen).bfloat16().requires_grad_()
    gy = torch.randn(T, B, H * d, generator=gen).bfloat16()
    ref = sigmoid_gate_seq_first(rms_norm(o.float(), w, 1e-5), gate, torch.bfloat16)
    rgrads = torch.autograd.grad(ref, (o, w, gate), gy)
    for fn in (rms_norm_gate_seq_first, compiled(rms_norm_gate_seq_first, backend="aot_eager")):
        y = fn(o, w, 1e-5, gate, torch.bfloat16)
        assert y.shape == (T, B, H * d) and y.is_contiguous() and torch.equal(y, ref)
        for a, b in zip(torch.autograd.grad(y, (o, w, gate), gy), rgrads):
            assert a.dtype == b.dtype and torch.equal(a, b)
