"""Attention Residuals: the mixer's math, the uniform case, and the block-size >= layers special case."""
import pytest
import torch

from megatron_k3 import get_preset
from megatron_k3.model import K3ForCausalLM
from megatron_k3.model import k3 as k3mod
from megatron_k3.model.attn_res import attn_res_mix


@pytest.mark.parametrize("n_blocks", [0, 1, 4])
def test_zero_queries_give_uniform_mean(n_blocks):
    torch.manual_seed(n_blocks)
    D = 16
    cands = [torch.randn(2, 5, D) * (i + 1) for i in range(n_blocks + 1)]
    out = attn_res_mix(cands[-1], cands[:-1], torch.zeros(D), torch.rand(D) + 0.5, 1e-5)
    torch.testing.assert_close(out, torch.stack(cands).mean(0), rtol=1e-6, atol=1e-6)


def test_mix_matches_explicit_softmax_fp64():
    torch.manual_seed(1)
    D, eps = 8, 1e-5
    cands = [torch.randn(3, D, dtype=torch.float64) for _ in range(4)]
    q, gamma = torch.randn(D, dtype=torch.float64), torch.rand(D, dtype=torch.float64) + 0.5
    out = attn_res_mix(cands[-1], cands[:-1], q, gamma, eps)
    for t in range(3):
        scores = []
        for c in cands:
            v = c[t]
            k = v / torch.sqrt((v * v).mean() + eps)
            scores.append(float((k * gamma * q).sum()))
        w = torch.softmax(torch.tensor(scores, dtype=torch.float64), 0)
        ref = sum(wi * c[t] for wi, c in zip(w, cands))
        torch.testing.assert_close(out[t].double(), ref, rtol=1e-6, atol=1e-6)
    # and the weights really depend on the query (it is not a mean)
    assert not torch.allclose(out, torch.stack(cands).mean(0).to(out.dtype))


def test_block_size_ge_layers_reduces_to_embedding_vs_running_sum():
    """block >= L: only layer 0 snapshots; every mixer averages (embedding, running sum of outputs) at zero q."""
    base = get_preset("k3-tiny")
    for bs in (base.num_hidden_layers, 3 * base.num_hidden_layers):
        cfg = base.replace(attn_res_block_size=bs)
        m = K3ForCausalLM(cfg, seed=3).double()
        ids = torch.randint(0, cfg.vocab_size, (2, 24))
        emb = m.model.embed_tokens(ids)
        S = None
        for i, layer in enumerate(m.model.layers):
            x = emb if i == 0 else (emb + S) / 2
            a = layer.self_attn(layer.input_layernorm(x))
            S = a if i == 0 else S + a
            S = S + layer.ffn(layer.post_attention_layernorm((emb + S) / 2))
        ref = m.lm_head(m.model.norm((emb + S) / 2))
        torch.testing.assert_close(m(ids), ref, rtol=1e-9, atol=1e-9)


def test_candidate_counts(monkeypatch):
    """8 layers, block 2: snapshots at layers 0,2,4,6 -> the final mixer sees 4 blocks + the partial sum."""
    cfg = get_preset("k3-tiny")
    seen = []

    def spy(real):
        def counted(prefix, blocks, *a):
            seen.append(len(blocks) + 1)
            return real(prefix, blocks, *a)
        return counted

    for name in ("attn_res_mix", "attn_res_mix_through"):  # the final mixer, the layers' mixers
        monkeypatch.setattr(k3mod, name, spy(getattr(k3mod, name)))
    m = K3ForCausalLM(cfg, seed=0)
    m(torch.randint(0, cfg.vocab_size, (1, 8)))
    # layer i: the attention mixer sees the snapshots taken before layer i ((i + 1) // 2 of them, skipped
    # when none), the MLP mixer those up to and including layer i (i // 2 + 1); each plus the partial sum.
    expect = []
    for i in range(cfg.num_hidden_layers):
        if (i + 1) // 2:
            expect.append((i + 1) // 2 + 1)
        expect.append(i // 2 + 1 + 1)
    expect.append(cfg.num_hidden_layers // 2 + 1)
    assert seen == expect
    # the released config: 93 layers, block 12 -> 9 candidates in the final mix
    assert len(range(0, 93, 12)) + 1 == 9


def test_pseudo_queries_zero_initialised():
    m = K3ForCausalLM(get_preset("k3-tiny"), seed=0)
    projs = [p for n, p in m.named_parameters() if n.endswith("_res_proj.weight")]
    assert len(projs) == 2 * 8 + 1
    assert all(p.shape == (1, 64) and torch.all(p == 0) for p in projs)


@pytest.mark.parametrize("n_blocks", [0, 3])
def test_compiled_graph_equals_eager(n_blocks):
    """The CUDA fast path is the reference under torch.compile(fullgraph=True): the traced forward and
    backward graphs (aot_eager backend here: the same graphs inductor lowers on the GPU, run eagerly) give
    the reference's outputs and gradients, for the mixer and for RMSNorm."""
    from megatron_k3.model.attn_res import attn_res_mix_reference
    from megatron_k3.model.common import compiled, rms_norm

    g = torch.Generator().manual_seed(n_blocks)
    D = 32
    for dtype in (torch.float32, torch.bfloat16):
        cands = [torch.randn(3, 5, D, generator=g).to(dtype) for _ in range(n_blocks + 1)]
        q, gamma = torch.randn(D, generator=g), torch.rand(D, generator=g) + 0.5
        dy = torch.randn(3, 5, D, generator=g).to(dtype)
        outs, grads = [], []
        for fn in (attn_res_mix_reference, compiled(attn_res_mix_reference, backend="aot_eager")):
            xs = [c.clone().requires_grad_() for c in cands]
            qq, gg = q.clone().requires_grad_(), gamma.clone().requires_grad_()
            y = fn(xs[-1], xs[:-1], qq, gg, 1e-5)
            y.backward(dy)
            outs.append(y)
            grads.append([x.grad for x in xs] + [qq.grad, gg.grad])
        torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
        for a, b in zip(grads[1], grads[0]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        x = cands[0].clone().requires_grad_()
        w = gamma.clone().requires_grad_()
        ref = rms_norm(x, w, 1e-5)
        ref.backward(dy)
        x2, w2 = cands[0].clone().requires_grad_(), gamma.clone().requires_grad_()
        out = compiled(rms_norm, backend="aot_eager")(x2, w2, 1e-5)
        out.backward(dy)
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        torch.testing.assert_close(x2.grad, x.grad, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(w2.grad, w.grad, rtol=1e-6, atol=1e-6)


def test_golden_model_with_compiled_glue_equals_eager(root):
    """The whole golden model with every compiled glue function switched on (perf compile=all, aot_eager
    backend on the CPU: the traced graphs run eagerly) gives the eager model's loss and gradients."""
    import os
    import subprocess
    import sys

    code = r"""
import os, torch
from megatron_k3 import get_preset, perf
from megatron_k3.model import K3ForCausalLM
perf.configure(compile_backend="aot_eager")
cfg = get_preset("k3-tiny")
m = K3ForCausalLM(cfg, seed=0)
ids = torch.randint(0, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
res = []
for flag in ("off", "all"):
    perf.configure(compile=flag)
    m.zero_grad(set_to_none=True)
    loss = m(ids[:, :-1], ids[:, 1:])["loss"]
    loss.backward()
    res.append((loss.detach(), [p.grad.clone() for p in m.parameters() if p.grad is not None]))
from megatron_k3.model.common import _COMPILED
assert len(_COMPILED) >= 4, _COMPILED.keys()   # mixer, norm, conv, gates were compiled
torch.testing.assert_close(res[1][0], res[0][0], rtol=1e-6, atol=1e-6)
assert len(res[0][1]) == len(res[1][1])
for a, b in zip(res[1][1], res[0][1]):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
print("OK", float(res[0][0]))
"""
    env = dict(os.environ, PYTHONPATH=root)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]


def test_compiled_mixer_keeps_compiling_past_eight_candidate_counts():
    """Up to 10 candidate counts x 2 grad modes (k3-full) stay compiled: with dynamo's default limit of 8
    graphs per function the 9th would raise FailOnRecompileLimitHit (fullgraph)."""
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    from megatron_k3.model.attn_res import attn_res_mix_reference
    from megatron_k3.model.common import compiled

    fn = compiled(attn_res_mix_reference, backend="aot_eager")
    dynamo.reset()
    counters.clear()
    D = 8
    for n in range(1, 11):
        for grad in (True, False):
            cands = [torch.randn(2, 3, D, requires_grad=grad) for _ in range(n)]
            with torch.set_grad_enabled(grad):
                fn(cands[-1], cands[:-1], torch.randn(D), torch.rand(D) + 0.5, 1e-5)
    assert counters["stats"]["unique_graphs"] >= 20, dict(counters["stats"])


def test_triton_kernels_under_interpreter(run_triton_interpreted):
    """The Triton mixer (``attn_res_triton.py``) against the fp64 reference, forward and every gradient
    (candidates, query, norm weight), run by Triton's interpreter on the CPU: column masking (D not a power of
    two), row masking, one to five candidates, backward programs looping over several row blocks. The
    interpreter rounds fp32 -> bf16 by truncation (the GPU rounds to nearest), hence the looser bf16 bound."""
    run_triton_interpreted(r"""
from megatron_k3.model.attn_res import attn_res_impl, attn_res_mix_reference
from megatron_k3.model.attn_res_triton import attn_res_mix_triton, supported
torch.manual_seed(0)
cases = (((3, 200, 48), 3, torch.float32, 1e-5), ((7, 40), 1, torch.float32, 1e-5),
         ((2, 37, 1024), 4, torch.float32, 1e-5), ((2, 3, 96), 5, torch.bfloat16, 1e-2))
for shape, N, dt, tol in cases:
    D = shape[-1]
    cands = [(torch.randn(shape) * (1 + i)).to(dt).requires_grad_() for i in range(N)]
    q = (torch.randn(D) * 0.5).requires_grad_()
    nw = (1 + 0.1 * torch.randn(D)).requires_grad_()
    assert supported(cands)
    out = attn_res_mix_triton(cands[-1], cands[:-1], q, nw, 1e-6)
    g = torch.randn(shape).to(dt)
    grads = torch.autograd.grad(out, cands + [q, nw], g)
    c64 = [c.detach().double().requires_grad_() for c in cands]
    q64, nw64 = q.detach().double().requires_grad_(), nw.detach().double().requires_grad_()
    ref = attn_res_mix_reference(c64[-1], c64[:-1], q64, nw64, 1e-6)
    rgrads = torch.autograd.grad(ref, c64 + [q64, nw64], g.double())
    errs = [rel(out, ref)] + [rel(a, b) for a, b in zip(grads, rgrads)]
    assert out.dtype == dt and all(e <= tol for e in errs), (shape, N, dt, errs)
    if N > 1:  # the query and norm weight really get gradients
        assert grads[-1].abs().max() > 0 and grads[-2].abs().max() > 0
x = torch.randn(4, 6, 8)
assert not supported([x, x.transpose(0, 1).contiguous().transpose(0, 1)])  # a strided candidate
assert not supported([x, x.double()]) and not supported([x, torch.randn(4, 6, 9)])
from megatron_k3 import perf
assert perf.current().attn_res == "triton"
assert attn_res_impl([x, x]) == "reference"  # CPU tensors: the Triton path is for CUDA
print("OK")
""")


def test_triton_handed_on_candidates_under_interpreter(run_triton_interpreted):
    """``attn_res_mix_through`` on the Triton path (run by the interpreter on the CPU): the handed-on prefix and
    blocks carry the inputs' values, and every gradient (candidates, query, norm weight) equals that of the
    plain mixer whose inputs are used again afterwards (the layer's pattern: a residual add on the prefix, a
    second mixer on the same blocks), so the gradients that come back through the handed-on tensors are added
    by the backward kernel; one handed-on block left unused (no gradient comes back for it)."""
    run_triton_interpreted(r"""
from megatron_k3.model.attn_res_triton import attn_res_mix_through_triton, attn_res_mix_triton
torch.manual_seed(0)
shape, N, D = (3, 50, 40), 4, 40
cands0 = [torch.randn(shape) * (1 + i) for i in range(N)]
q0, nw0, q2 = torch.randn(D) * 0.5, 1 + 0.1 * torch.randn(D), torch.randn(D) * 0.5
gs = [torch.randn(shape) for _ in range(3)]

def run(through):
    cands = [c.clone().requires_grad_() for c in cands0]
    q, nw = q0.clone().requires_grad_(), nw0.clone().requires_grad_()
    blocks, prefix = cands[:-1], cands[-1]
    if through:
        out, p2, b2 = attn_res_mix_through_triton(prefix, blocks, q, nw, 1e-6)
        assert torch.equal(p2, prefix) and all(torch.equal(a, b) for a, b in zip(b2, blocks))
        blocks2 = b2[:1] + blocks[1:2] + b2[2:]  # block 1 handed on but not used: None comes back for it
    else:
        out, p2, blocks2 = attn_res_mix_triton(prefix, blocks, q, nw, 1e-6), prefix, blocks
    h = p2 + out * 2                                        # the residual on the handed-on prefix
    out2 = attn_res_mix_triton(h, blocks2, q2, nw, 1e-6)    # the second mixer on the (handed-on) blocks
    loss = (out * gs[0]).sum() + (out2 * gs[1]).sum() + (h * gs[2]).sum()
    return torch.autograd.grad(loss, cands + [q, nw])

ref, got = run(False), run(True)
errs = [rel(a, b) for a, b in zip(got, ref)]
assert all(e <= 1e-6 for e in errs), errs
print("OK")
""")
