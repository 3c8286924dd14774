"""Per-rank initialisation (megatron_k3/model/init.py, megatron_k3/parallel/rank_init.py).

- every module's values depend on (seed, its name) only, so one tensor can be generated alone and equals the
  golden model's;
- the split model initialised rank by rank equals the golden model for DP2, TP2+SP, PP2 and EP2 (gathered
  through the weight adapter, bit for bit);
- a rank's peak host memory while building and initialising its chunks stays within its shard plus the
  largest single full parameter (measured: VmHWM), where building the whole golden model does not; with two
  initialisation threads, within one more full parameter. The layouts are initialised by three threads."""
import json
import os
import subprocess
import sys

import torch

from megatron_k3 import get_preset
from megatron_k3.train.launch_env import free_port
from megatron_k3.model import K3ForCausalLM
from megatron_k3.model.init import module_seed
from megatron_k3.model.skeleton import GoldenSkeleton


def test_each_tensor_alone_equals_the_golden_model():
    cfg = get_preset("k3-tiny", num_nextn_predict_layers=1)
    ref = K3ForCausalLM(cfg, seed=5).state_dict()
    sk = GoldenSkeleton(cfg)
    for k in reversed(list(ref)):  # any order: a tensor does not depend on what was generated before it
        v = sk.initial_value(k, 5)
        assert v.shape == ref[k].shape and torch.equal(v, ref[k]), k
        assert tuple(sk.shapes[k]) == tuple(ref[k].shape)
    assert module_seed(5, "lm_head") != module_seed(5, "model.embed_tokens") != module_seed(6, "model.embed_tokens")


def test_skeleton_of_k3_full_is_cheap():
    sk = GoldenSkeleton(get_preset("k3-full"))
    assert tuple(sk.shapes["model.layers.90.block_sparse_moe.experts.895.w2.weight"]) == (3584, 3072)
    assert tuple(sk.shapes["model.embed_tokens.weight"]) == (163840, 7168)
    assert sum(1 for _ in sk.model_for("model.layers.90.self_attn.q_proj.weight").modules()) < 5000


def _run(root, mode):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           os.path.join(root, "tests", "helpers", "init_check.py"), mode]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=root))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return [json.loads(line.split("RESULT ", 1)[1]) for line in r.stdout.splitlines() if "RESULT " in line]


def test_every_layout_initialises_the_same_weights(root):
    (res,) = _run(root, "layouts")
    assert set(res) == {"DP2", "TP2+SP", "PP2", "EP2"}
    for name, r in res.items():
        assert r["tensors"] > 300 and r["n_bad"] == 0, (name, r)


def test_init_peak_memory_is_shard_plus_one_parameter(root):
    for r in _run(root, "memory"):
        bound = r["shard_mb"] + r["largest_param_mb"] + 16  # 16 MB for allocator and Python objects
        assert r["peak_mb"] <= bound, r
        # with two init threads: at most one more full parameter in flight
        assert r["peak_two_workers_mb"] <= bound + r["largest_param_mb"], r
        # the measurement tells the two ways apart: the whole golden model does not fit the bound
        assert r["old_way_peak_mb"] > bound + 0.5 * r["shard_mb"], r
        assert r["shard_mb"] < 0.6 * r["full_model_mb"]  # TP2: this rank holds about half the model
