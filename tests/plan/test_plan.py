"""The layout planner (megatron_k3/plan/planner.py, tools/plan_layout.py): parameter counts from the real model, the
activation model against saved-tensor bytes measured on CPU, the k3-mini H200 benchmark peak, k3-full
layouts on B300 and H100, refusals."""
import json
import os
import subprocess
import sys

import pytest

from megatron_k3.plan import planner as P
from megatron_k3.config import get_preset
from megatron_k3.parallel.layout import LayoutError, ParallelLayout

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "benchmarks", "results", "benchmark_k3mini_h200_bf16_2026-12-01.json")
TOOL = os.path.join(ROOT, "tools", "plan_layout.py")
GPU_BY_NAME = {spec.name.split(" (")[0].split(" 80GB")[0]: key for key, spec in P.GPUS.items()}


def _tool(*args, timeout=180):
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONPATH=ROOT))


def test_parameter_counts_are_the_models():
    from megatron_k3.plan.model_info import model_info

    cfg = get_preset("k3-mini")
    c = P.model_params(cfg)
    assert c.total == model_info(cfg)["total_params_without_mtp"] == 1_256_654_984
    assert c.expert == model_info(cfg)["routed_expert_params_total"]
    # k3-full: per-layer-kind counting reproduces the README's total without building 93 layers
    assert P.model_params(get_preset("k3-full")).total == 2_779_484_393_568


def test_benchmark_peak_within_15_percent():
    """The committed k3-mini measurement (1 x H200): the planner's peak for exactly that setting."""
    b = json.load(open(BENCH))
    cfg = get_preset(b["preset"].split("+")[0], seq_length=b["seq_length"])
    assert b["params_total"] == P.model_params(cfg).total
    gpu = P.GPUS[GPU_BY_NAME[b["device"]]]
    s = P.PlanSettings(micro_batch_size=b["micro_batch_size"], seq_length=b["seq_length"],
                       global_batch_size=b["micro_batch_size"], bf16=b["dtype"] == "bfloat16",
                       recompute=b["recompute"],
                       # benchmarks/benchmark.py: megatron AdamW without the distributed optimizer, one GPU
                       distributed_optimizer=False,
                       # measured at commit aaa566b, before the streaming SiTU op and the grouped experts:
                       # the reference SiTU and megatron's SequentialMLP
                       situ="reference", experts="sequential")
    p = P.plan(cfg, ParallelLayout(), s, gpu)
    planned = p["peak_bytes"] / 2 ** 30
    measured = b["peak_memory_gib"]
    assert abs(planned / measured - 1) < 0.15, (planned, measured)
    assert p["fits"]


SMALL = {"preset": "k3-mini", "hidden_size": 128, "vocab_size": 2048, "bos_token_id": None, "eos_token_id": None,
         "pad_token_id": None, "kda_num_heads": 4, "kda_head_dim": 32, "num_attention_heads": 4, "q_lora_rank": 48,
         "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
         "intermediate_size": 320, "num_experts": 8, "moe_intermediate_size": 64, "routed_expert_hidden_size": 64,
         "num_hidden_layers": 8, "attn_res_block_size": 3, "kda_chunk_size": 32}


@pytest.mark.parametrize("extra", [["--micro-batch-size", "2", "--seq-length", "192"],
                                   ["--micro-batch-size", "1", "--seq-length", "160", "--recompute", "selective",
                                    "--situ", "reference", "--experts", "sequential"]])
def test_activation_model_matches_saved_tensors(tmp_path, extra):
    """Per component, the planner's activation bytes equal the saved-for-backward bytes measured with autograd
    hooks on a small K3 (KDA/MLA, dense + latent MoE, AttnRes blocks crossing layer kinds), bf16 on CPU."""
    cfgf = tmp_path / "small.json"
    cfgf.write_text(json.dumps(SMALL))
    r = _tool("--config", str(cfgf), "--measure", "--json", *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(r.stdout)
    m, p = d["measured"], d["planned"]
    assert set(m) == set(p)
    for k in m:
        assert p[k] == pytest.approx(m[k], rel=0.05), (k, m[k], p[k])
    assert sum(p.values()) == pytest.approx(sum(m.values()), rel=0.02)


def test_k3_full_layouts_b300_and_h100():
    cfg = get_preset("k3-full")
    lay = ParallelLayout(tp=8, pp=4, ep=128, dp=16, sequence_parallel=True, layers_per_stage=P.block_split(cfg, 4))
    b = P.plan(cfg, lay, P.PlanSettings(micro_batch_size=1), P.GPUS["b300"])
    assert lay.layers_per_stage == [24, 24, 24, 21]
    assert b["fits"] and b["world_size"] == 512
    st = b["stages"][b["peak_stage"]]
    assert st["activations"] > 0 and st["in_flight"] == 4 - st["stage"]
    # the expert weights on a GPU are 1/EP of the stage's experts; grads are fp32 (twice the bf16 weights)
    assert st["static"]["grads"] == pytest.approx(2 * st["static"]["weights"], rel=1e-3)
    h = P.plan(cfg, ParallelLayout(tp=8, pp=4, ep=128, dp=64, sequence_parallel=True,
                                   layers_per_stage=[24, 24, 24, 21]),
               P.PlanSettings(micro_batch_size=1, recompute="full"), P.GPUS["h100"])
    assert h["fits"] and 50 * 2 ** 30 < h["peak_bytes"] < P.GPUS["h100"].capacity
    # without recompute the same H100 layout does not fit (PP in-flight activations)
    assert not P.plan(cfg, ParallelLayout(tp=8, pp=4, ep=128, dp=64, sequence_parallel=True,
                                          layers_per_stage=[24, 24, 24, 21]),
                      P.PlanSettings(micro_batch_size=1), P.GPUS["h100"])["fits"]


def test_cli_picks_and_checks(tmp_path):
    r = _tool("--preset", "k3-full", "--nodes", "64", "--gpu", "b300", "--tp", "8", "--pp", "4", "--ep", "128",
              "--json")
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    assert p["fits"] and p["layers_per_stage"] == [24, 24, 24, 21] and p["gpu"].startswith("NVIDIA B300")
    r = _tool("--preset", "k3-mini", "--nodes", "1", "--gpu", "h100", "--micro-batch-size", "2")
    assert r.returncode == 0, r.stderr
    assert "trainer flags: --tensor-model-parallel-size" in r.stdout and "peak" in r.stdout


def test_impossible_and_invalid_layouts_are_refused():
    # does not fit: all of k3-full's experts on one H100 node
    r = _tool("--preset", "k3-full", "--nodes", "1", "--gpu", "h100", "--tp", "8", "--pp", "1", "--ep", "8")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("error: layout TP8 PP1 EP8 CP1 DP1 +SP does not fit:")
    # nothing fits when searching
    r = _tool("--preset", "k3-full", "--nodes", "2", "--gpu", "h100")
    assert r.returncode == 2 and "error: no layout found; closest:" in r.stderr
    # invalid before any arithmetic: EP must divide the experts
    r = _tool("--preset", "k3-mini", "--nodes", "1", "--gpu", "h100", "--tp", "1", "--pp", "1", "--ep", "7")
    assert r.returncode == 2
    assert r.stderr.strip() == ("error: layout TP1 PP1 EP7 CP1 DP8: EP=7 must divide TP*CP*DP = 8 (the expert grid)")
    with pytest.raises(LayoutError):
        P.plan(get_preset("k3-mini"), ParallelLayout(tp=3, dp=1), P.PlanSettings(micro_batch_size=1))
