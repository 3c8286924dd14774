"""MoE balancing: counts over all micro-batches and DP ranks, zero-mean bias, Quantile Balancing, metrics."""
import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_k3.parallel.balancing import quantile_shift, quantile_update, sign_update
from megatron_k3.train.metrics import routing_stats


def test_routing_metrics_tell_collapse_from_one_popular_expert():
    E, k, N = 40, 4, 1000
    collapse = torch.zeros(E)
    collapse[:4] = N                       # 4 experts take every token
    popular = torch.full((E,), 3 * N / 39)
    popular[0] = N                         # one expert sees every token, the rest share the other slots
    a, b = routing_stats(collapse), routing_stats(popular)
    assert a["max_mean"] == pytest.approx(E / k) and b["max_mean"] == pytest.approx(E / k)  # indistinguishable
    assert a["dead"] == 36 and b["dead"] == 0
    assert a["entropy"] == pytest.approx(torch.log(torch.tensor(4.0)).item() / torch.log(torch.tensor(40.0)).item())
    assert b["entropy"] > 0.85 and a["entropy"] < 0.4
    assert routing_stats(torch.ones(E))["entropy"] == pytest.approx(1.0)


def test_sign_update_is_zero_centred():
    b = torch.zeros(40)
    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        counts = torch.randint(0, 100, (40,), generator=g).double()
        counts[:3] += 500
        b = sign_update(b, counts, 1e-3)
    assert abs(b.mean().item()) < 1e-6
    assert (b[:3] < b[3:].mean()).all()    # over-loaded experts pushed down


def test_quantile_balancing_brings_skewed_router_within_10_percent():
    torch.manual_seed(0)
    E, k = 16, 2
    skew = torch.linspace(-2, 2, E)

    def batch(T):
        return torch.sigmoid(torch.randn(T, E) + skew)

    def load(s, b):
        return torch.bincount((s + b).topk(k, dim=1).indices.flatten(), minlength=E).double()

    b = torch.zeros(E)
    before = load(batch(32768), b)
    assert before.max() / before.mean() > 3
    for _ in range(8):  # 8 steps of 4 micro-batches of 4096 tokens
        c = torch.stack([quantile_shift(batch(4096), b, k) for _ in range(4)]).mean(0)
        b = quantile_update(b, c)
    after = load(batch(32768), b)  # held out
    assert after.max() / after.mean() <= 1.10 and after.min() / after.mean() >= 0.90
    assert abs(b.mean().item()) < 1e-6


def test_quantile_shift_targets_exactly_q_tokens():
    torch.manual_seed(1)
    T, E, k = 256, 8, 2
    s = torch.sigmoid(torch.randn(T, E) * 2)
    b = torch.zeros(E)
    c = quantile_shift(s, b, k)
    q = T * k // E
    for e in range(E):  # lowering expert e's bias by c_e (others fixed) makes exactly q tokens pick it
        b2 = b.clone()
        b2[e] -= c[e]
        picked = ((s + b2).topk(k, dim=1).indices == e).any(1)
        assert int(picked.sum()) == q


@pytest.fixture(scope="module", params=["sign", "quantile"])
def run(request, root, tmp_path_factory):
    out = tmp_path_factory.mktemp("bal") / f"{request.param}.json"
    r = subprocess.run([sys.executable, os.path.join(root, "tests", "helpers", "balancing_run.py"), request.param,
                        str(out)], capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=root))
    assert r.returncode == 0, r.stderr[-3000:]
    return request.param, json.load(open(out))


def test_counts_cover_all_micro_batches_and_dp_ranks(run):
    mode, rep = run
    for step in rep[:3]:
        captured = torch.tensor(list(step["captured"].values()))
        hooked = torch.tensor(step["hooked"])
        assert step["calls"] == [4] * len(step["calls"])            # every micro-batch went through each router
        assert torch.equal(captured, hooked)                         # the balancing saw all of them, both ranks
        assert captured.sum(1).tolist() == [2 * 4 * 32 * 2] * len(captured)   # DP2 x 4 micro x 32 tokens x top-2


def test_bias_moves_keeps_zero_mean_and_matches_across_ranks(run):
    mode, rep = run
    bias = torch.tensor(rep[2]["bias"])
    assert bias.abs().max() > 0                                       # the update acts
    assert bias.mean(1).abs().max() < 1e-6                            # and never drifts in common mode
    assert torch.equal(bias, torch.tensor(rep[3]["bias_rank1"]))      # DP replicas agree
