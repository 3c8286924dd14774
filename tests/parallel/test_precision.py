"""FP8 policy (megatron_k3/parallel/precision.py): up-front refusals, the Transformer Engine linear swap, and
torchao's float8 GEMMs.

Transformer Engine's FP8 GEMMs need a GPU: ``benchmarks/bench_fp8.py`` measures them there (loss and speed
against bf16 through the trainer, JSON in benchmarks/results/). Here: the checks that run before anything is
built; that routing a golden ``Linear`` through another module keeps its one Parameter, its name, its
``state_dict`` key, its output and its gradient (the inner module is a plain ``torch.nn.Linear`` on CPU); and
torchao's recipes for real, since ``torch._scaled_mm`` runs its FP8 GEMMs on the CPU too: each GEMM against
bf16, the compiled form against the eager one, KDA's fused projections, and the whole megatron model
(``tests/helpers/float8_check.py``).
"""
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from megatron_k3.cli import UsageError
from megatron_k3.model.common import Linear
from megatron_k3 import perf
from megatron_k3.parallel.precision import (Float8Linear, TELinear, TORCHAO_RECIPES, check_fp8, float8_gemm,
                                            resolve, use_te_linears, use_torchao_linears)

HOPPER, ADA, BLACKWELL = (9, 0), (8, 9), (10, 0)


@pytest.mark.parametrize("recipe,cap", [("delayed", HOPPER), ("tensorwise", ADA), ("blockwise", HOPPER),
                                        ("mxfp8", BLACKWELL), ("blockwise", BLACKWELL)])
def test_supported_combinations_pass(recipe, cap):
    check_fp8(recipe, None, capability=cap, te="2.20.2")
    assert resolve(recipe, None) == {"fp8": "e4m3", "fp8_recipe": recipe}


@pytest.mark.parametrize("recipe,cap", [("torchao-tensorwise", ADA), ("torchao-rowwise", HOPPER),
                                        ("torchao-rowwise-gw-hp", BLACKWELL)])
def test_torchao_recipes_pass_without_transformer_engine(recipe, cap):
    check_fp8(recipe, None, capability=cap, te=None, torchao="0.18.0")
    assert resolve(recipe, None) == {"torchao_float8": recipe}  # no megatron fp8 fields: TE stays out


def test_bf16_needs_nothing():
    check_fp8(None, None, capability=None, te=None)
    assert resolve(None, None) == {}


@pytest.mark.parametrize("kw,needle", [
    (dict(recipe="mxfp8", fmt=None, capability=HOPPER, te="2.20.2"),
     "compute capability 10.0 or higher"),
    (dict(recipe="blockwise", fmt=None, capability=ADA, te="2.20.2"), "compute capability 9.0 or higher"),
    (dict(recipe="tensorwise", fmt=None, capability=(8, 0), te="2.20.2"), "compute capability 8.9 or higher"),
    (dict(recipe="blockwise", fmt=None, capability=None, te=None), "needs a CUDA GPU"),
    (dict(recipe="blockwise", fmt=None, capability=HOPPER, te=None), "needs Transformer Engine"),
    (dict(recipe="blockwise", fmt="hybrid", capability=HOPPER, te="2.20.2"), "--fp8-format e4m3"),
    (dict(recipe="fp4", fmt=None, capability=HOPPER, te="2.20.2"), "choose from"),
    (dict(recipe="delayed", fmt=None, capability=HOPPER, te="2.20.2", recompute="full"), "amax history"),
    (dict(recipe="torchao-rowwise", fmt=None, capability=ADA, te=None, torchao="0.18.0"),
     "compute capability 9.0 or higher; on Ada use --fp8-recipe torchao-tensorwise"),
    (dict(recipe="torchao-tensorwise", fmt=None, capability=(8, 0), te=None, torchao="0.18.0"),
     "compute capability 8.9 or higher"),
    (dict(recipe="torchao-rowwise", fmt=None, capability=None, te=None, torchao="0.18.0"), "needs a CUDA GPU"),
    (dict(recipe="torchao-rowwise", fmt=None, capability=HOPPER, te="2.20.2", torchao=None), "needs torchao"),
    (dict(recipe="torchao-rowwise", fmt="e4m3", capability=HOPPER, te=None, torchao="0.18.0"),
     "drop --fp8-format"),
])
def test_refusals_name_the_problem(kw, needle):
    with pytest.raises(UsageError, match=needle.replace("(", r"\(")):
        check_fp8(kw.pop("recipe"), kw.pop("fmt"), **kw)


def test_mxfp8_on_hopper_message_is_actionable():
    with pytest.raises(UsageError) as e:
        check_fp8("mxfp8", None, capability=HOPPER, te="2.20.2")
    msg = str(e.value)
    assert "compute capability 9.0" in msg and "10.0 or higher" in msg and "blockwise" in msg


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = Linear(32, 48)
        self.small = Linear(32, 8)  # 8 is not a multiple of 16: stays a plain Linear


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({"0": _Block()})
        self.lm_head = Linear(32, 64)  # outside the decoder layers: never swapped


def _torch_inner(i, o, dtype, device):
    return nn.Linear(i, o, bias=False, dtype=dtype, device=device)


def test_swap_keeps_parameter_name_output_and_gradient():
    torch.manual_seed(0)
    ref = _Model()
    for m in ref.modules():
        if isinstance(m, Linear):
            m.reset_parameters(torch.Generator().manual_seed(1))
    model = _Model()
    model.load_state_dict(ref.state_dict())
    w = model.layers["0"].q_proj.weight
    names = use_te_linears(model, make_te=_torch_inner)
    assert names == ["layers.0.q_proj"]
    q = model.layers["0"].q_proj
    assert type(q) is TELinear and q._te.weight is w and q.weight is w
    assert type(model.layers["0"].small) is Linear and type(model.lm_head) is Linear
    # the inner module is not part of the tree: one name per parameter, unchanged state_dict keys
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert list(model.state_dict()) == list(ref.state_dict())
    x = torch.randn(5, 32)
    y = q(x)
    y_ref = ref.layers["0"].q_proj(x)
    assert torch.equal(y, y_ref)
    y.square().sum().backward()
    y_ref.square().sum().backward()
    assert torch.equal(w.grad, ref.layers["0"].q_proj.weight.grad)
    model.eval()
    assert not q._te.training
    model.train()
    assert q._te.training


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("recipe", list(TORCHAO_RECIPES))
def test_torchao_float8_linear_is_an_fp8_gemm(recipe):
    """A swapped projection keeps its Parameter and name and computes x @ W.T and both gradients in FP8: within
    FP8's rounding of bf16 (e4m3 ~3% per operand; measured 3.6-6.3% here), not equal to it (it did round)."""
    torch.manual_seed(0)
    model = _Model().to(torch.bfloat16)
    for m in model.modules():
        if isinstance(m, Linear):
            m.reset_parameters(torch.Generator().manual_seed(1))
    keys, w = list(model.state_dict()), model.layers["0"].q_proj.weight
    assert use_torchao_linears(model, recipe) == ["layers.0.q_proj"]
    q = model.layers["0"].q_proj
    assert type(q) is Float8Linear and q.weight is w and list(model.state_dict()) == keys
    assert type(model.layers["0"].small) is Linear and type(model.lm_head) is Linear
    x = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    y, yr = q(x), torch.nn.functional.linear(xr, w.detach().clone().requires_grad_())
    g = torch.randn_like(y)
    y.backward(g)
    yr.backward(g)
    assert 0 < _rel(y, yr) < 0.08 and 0 < _rel(x.grad, xr.grad) < 0.1
    wr = w.detach().clone().requires_grad_()
    torch.nn.functional.linear(x.detach(), wr).backward(g)
    if recipe.endswith("gw-hp"):  # the weight-gradient GEMM in bf16: bf16's own result
        assert _rel(w.grad, wr.grad) < 1e-3
    else:
        assert 0 < _rel(w.grad, wr.grad) < 0.1


def test_torchao_gemm_compiled_is_the_eager_gemm():
    """On CUDA the quantisation and GEMM run compiled (``fast``); that graph computes the eager function's bits
    (forward and both gradients; aot_eager backend on the CPU)."""
    torch.manual_seed(0)
    w = torch.randn(48, 64, dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(32, 48, dtype=torch.bfloat16)
    outs = []
    for mode in ("off", "all"):
        with perf.using(compile=mode, compile_backend="aot_eager"):
            y = float8_gemm(x, w, "torchao-rowwise")
        y.backward(g)
        outs.append((y.detach(), x.grad.clone(), w.grad.clone()))
        x.grad = w.grad = None
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_fused_projections_of_float8_linears_are_one_gemm():
    """``fused_linears``: Float8Linears of one recipe run as one FP8 GEMM on the concatenated weights; a mix
    (an ineligible narrow projection stays a plain Linear) runs one by one."""
    from megatron_k3.parallel.layers import fused_linears

    mods = [Linear(32, 48), Linear(32, 16), Linear(32, 32)]
    for m in mods:
        m.reset_parameters(torch.Generator().manual_seed(2))
        m.to(torch.bfloat16)
        Float8Linear.adopt(m, "torchao-rowwise")
    calls = []
    plain = Float8Linear.gemm
    Float8Linear.gemm = lambda self, x, w: calls.append(w.shape[0]) or plain(self, x, w)
    try:
        x = torch.randn(8, 32, dtype=torch.bfloat16)
        outs = fused_linears(x, mods)
        assert calls == [96] and [o.shape[-1] for o in outs] == [48, 16, 32]
        ref = torch.nn.functional.linear(x, torch.cat([m.weight for m in mods]))
        assert _rel(torch.cat(outs, -1), ref) < 0.08
        calls.clear()
        mixed = mods[:2] + [Linear(32, 8).to(torch.bfloat16)]
        fused_linears(x, mixed)
        assert calls == [48, 16]
    finally:
        Float8Linear.gemm = plain


def test_torchao_graphs_allowed_te_refused():
    """Layer CUDA graphs take torchao's stateless recipes and refuse Transformer Engine's."""
    from megatron_k3.parallel.graphs import CudaGraphError, check_cuda_graphs
    from megatron_k3.parallel.layout import ParallelLayout

    check_cuda_graphs("local", ParallelLayout(), fp8_recipe="torchao-rowwise", cuda=True)
    with pytest.raises(CudaGraphError, match="Transformer Engine updates its scaling state"):
        check_cuda_graphs("local", ParallelLayout(), fp8_recipe="blockwise", cuda=True)


def test_megatron_model_with_torchao_float8(root):
    """The megatron K3 model with each torchao recipe against itself in bf16 (tests/helpers/float8_check.py):
    the right projections swapped, KDA's six projections one FP8 GEMM, loss within 1%, gradients aligned."""
    from megatron_k3.train.launch_env import free_port

    r = subprocess.run([sys.executable, os.path.join(root, "tests", "helpers", "float8_check.py"), str(free_port())],
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=root), cwd=root)
    assert r.returncode == 0, r.stdout[-1500:] + r.stderr[-3000:]
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    assert all(rep[k]["float8_linears"] > 20 for k in TORCHAO_RECIPES)


def test_trainer_refuses_fp8_before_building(root, tmp_path):
    """The trainer's flags: FP8 without --bf16, and FP8 on a machine without a GPU, fail up front (exit 2)."""
    env = dict(os.environ, PYTHONPATH=root)
    base = [sys.executable, "-m", "megatron_k3.train.pretrain", "--train-iters", "1", "--run-dir", str(tmp_path / "r")]
    r = subprocess.run(base + ["--fp8-recipe", "blockwise"], capture_output=True, text=True, timeout=300, env=env,
                       cwd=root)
    assert r.returncode == 2 and "add --bf16" in r.stderr, r.stderr[-1500:]
    if not torch.cuda.is_available():
        r = subprocess.run(base + ["--bf16", "--fp8-recipe", "mxfp8"], capture_output=True, text=True, timeout=300,
                           env=env, cwd=root)
        assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr, r.stderr[-1500:]
        r = subprocess.run(base + ["--bf16", "--fp8-recipe", "torchao-rowwise"], capture_output=True, text=True,
                           timeout=300, env=env, cwd=root)
        assert r.returncode == 2 and "needs a CUDA GPU (torch._scaled_mm" in r.stderr, r.stderr[-1500:]
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_bench_fp8_smoke(root, tmp_path):
    """The FP8 benchmark runs the trainer once per recipe on CPU: the baseline trains (twice, reproducibly, on
    the synthetic store it writes), the FP8 recipes are refused by name with the trainer's error line."""
    out = tmp_path / "f.json"
    r = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "bench_fp8.py"), "--smoke", "--recipes",
                        "bf16,blockwise,torchao-rowwise,bf16", "--work", str(tmp_path / "w"), "--out", str(out)],
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=root))
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.load(open(out))
    b = rep["recipes"]["bf16"]
    assert b["steps"] == 6 and b["tokens_per_s"] > 0 and len(b["loss_every_10"]) == 1
    assert 0 < b["final_loss_mean_last20"] < 7 and "launchers/pretrain_k3.py" in b["command"]
    assert 0 < rep["source_entropy_nats"] < math.log(512)
    # the repeated recipe is a second trainer run on the same data and init: on the CPU its losses are the same
    assert rep["recipes"]["bf16#2"]["loss_every_10"] == b["loss_every_10"]
    assert rep["recipes"]["bf16#2"]["final_loss_mean_last20"] == b["final_loss_mean_last20"]
    if not torch.cuda.is_available():
        assert "needs a CUDA GPU" in rep["recipes"]["blockwise"]["error"]
        assert "needs a CUDA GPU (torch._scaled_mm" in rep["recipes"]["torchao-rowwise"]["error"]
        assert rep["recipes"]["torchao-rowwise"]["returncode"] == 2
    # the FLOP split it reports: k3-tiny's projections are most, not all, of the model's FLOPs
    assert 0.3 < rep["fp8_eligible_fraction"] < 1 and rep["model_tflop_per_step"] > 0
    # --append: a later call adds its runs to the same JSON (same settings), numbered after the earlier ones
    # (with --breakdown: benchmark.py's run of the same model and recipe, recorded beside the trainer's figures)
    r = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "bench_fp8.py"), "--smoke", "--recipes", "bf16",
                        "--work", str(tmp_path / "w"), "--out", str(out), "--append", "--breakdown"],
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=root))
    assert r.returncode == 0, r.stderr[-2000:]
    rep2 = json.load(open(out))
    assert list(rep2["recipes"]) == list(rep["recipes"]) + ["bf16#3"] and len(rep2["commands"]) == 2
    b3 = rep2["recipes"]["bf16#3"]
    assert b3["final_loss_mean_last20"] == b["final_loss_mean_last20"]
    bd = b3["breakdown"]
    assert "error" not in bd and bd["median_step_s"] > 0, bd
    assert "--config" in bd["command"] and "--baselines none" in bd["command"] and "--fp8-recipe" not in bd["command"]
    # the trainer's start-up figures of each run (what a cold GPU machine spends before the first step)
    assert b3["startup"]["startup_s"] > 0 and "graph_capture_s" in b3["startup"], b3["startup"]


def test_synthetic_source(bench_module):
    """The FP8 benchmark's data: reproducible from its seed, in the vocabulary, and learnable: the entropy
    it reports is far below a uniform guess, and the next-token counts follow the previous tokens."""
    bench_module("benchmark")  # bench_fp8 imports it
    synthetic_batches = bench_module("bench_fp8").synthetic_batches

    a, ha = synthetic_batches(64, 3, 4, 200, torch.device("cpu"))
    b, hb = synthetic_batches(64, 3, 4, 200, torch.device("cpu"))
    assert ha == hb and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))
    t, lab = a[0]
    assert torch.equal(t[:, 1:], lab[:, :-1]) and int(t.min()) >= 0 and int(t.max()) < 64
    assert 0.5 < ha < 0.85 * math.log(64)
    toks = torch.cat([torch.cat([x[0], x[1][:, -1:]], 1) for x in a]).flatten()

    def cond_entropy(z):  # empirical H(x_t | x_{t-1})
        pairs = torch.bincount(z[:-1] * 64 + z[1:], minlength=64 * 64).view(64, 64).double()
        p = pairs / pairs.sum(1, keepdim=True).clamp_min(1)
        return float(-(pairs * p.clamp_min(1e-30).log()).sum() / pairs.sum())

    # the previous token carries information: the same tokens shuffled (same counts, same sampling bias of the
    # estimate) have a much higher conditional entropy
    shuffled = toks[torch.randperm(len(toks), generator=torch.Generator().manual_seed(0))]
    assert cond_entropy(toks) < cond_entropy(shuffled) - 0.3
