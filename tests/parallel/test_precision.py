"""FP8 policy (megatron_k3/parallel/precision.py): up-front refusals, and the Transformer Engine linear swap.

The FP8 GEMMs themselves need a GPU with Transformer Engine: ``benchmarks/bench_fp8.py`` measures them there
(loss and speed against bf16, JSON in benchmarks/results/). Here: the checks that run before anything is
built, and that routing a golden ``Linear`` through another module keeps its one Parameter, its name, its
``state_dict`` key, its output and its gradient (the inner module is a plain ``torch.nn.Linear`` on CPU).
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
from megatron_k3.parallel.precision import TELinear, check_fp8, resolve, use_te_linears

HOPPER, ADA, BLACKWELL = (9, 0), (8, 9), (10, 0)


@pytest.mark.parametrize("recipe,cap", [("delayed", HOPPER), ("tensorwise", ADA), ("blockwise", HOPPER),
                                        ("mxfp8", BLACKWELL), ("blockwise", BLACKWELL)])
def test_supported_combinations_pass(recipe, cap):
    check_fp8(recipe, None, capability=cap, te="2.20.2")
    assert resolve(recipe, None) == {"fp8": "e4m3", "fp8_recipe": recipe}


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
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_bench_fp8_smoke(root, tmp_path):
    """The FP8 benchmark harness runs on CPU: the baseline trains (twice, reproducibly, on the synthetic source),
    the FP8 recipes are refused by name."""
    out = tmp_path / "f.json"
    r = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "bench_fp8.py"), "--smoke", "--recipes",
                        "bf16,blockwise,bf16", "--out", str(out)], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=root, MASTER_PORT="29689"))
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.load(open(out))
    b = rep["recipes"]["bf16"]
    assert b["tokens_per_s"] > 0 and len(b["loss_every_10"]) == 1 and b["final_loss_mean_last20"] > 0
    assert 0 < rep["source_entropy_nats"] < math.log(512)
    # the repeated recipe is a second run on the same data and init: on the CPU its losses are the same
    assert rep["recipes"]["bf16#2"]["loss_every_10"] == b["loss_every_10"]
    if not torch.cuda.is_available():
        assert "needs a CUDA GPU" in rep["recipes"]["blockwise"]["error"]


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
