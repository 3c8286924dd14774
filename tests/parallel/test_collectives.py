"""Collectives take tensors on their process group's device (megatron_k3/parallel/collectives.py).

The trainer once all-reduced a host tensor on an NCCL group: fine on CPU/gloo, a crash at the first GPU
step. Two checks that run on a CPU-only machine catch that class of bug:
- no product module calls a ``torch.distributed`` tensor collective except through ``collectives.py``;
- on a real process group that, like NCCL, takes CUDA tensors only (torch's fake backend registered for the
  ``cuda`` device type: the same "No backend type associated with device type cpu" failure), the guarded
  collectives refuse a host tensor with an error naming both devices, and host values reach the group
  through ``all_reduce_host``.
"""
import ast
import os
import subprocess
import sys

TENSOR_COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
                      "broadcast", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single", "send", "recv",
                      "isend", "irecv", "batch_isend_irecv"}
PRODUCT = ("megatron_k3", "checkpoints_io", "launchers", "tools", "benchmarks")


def _direct_collectives(path):
    tree = ast.parse(open(path).read(), path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in TENSOR_COLLECTIVES:
            base = ast.unparse(node.func.value)
            if base in ("dist", "torch.distributed", "td"):
                out.append(f"{os.path.relpath(path)}:{node.lineno}: {base}.{node.func.attr}")
    return out


def test_no_direct_tensor_collectives_in_product_code(root):
    found = []
    for top in PRODUCT:
        for dirpath, _, files in os.walk(os.path.join(root, top)):
            for f in files:
                p = os.path.join(dirpath, f)
                if f.endswith(".py") and not p.endswith(os.path.join("megatron_k3", "parallel", "collectives.py")):
                    found += _direct_collectives(p)
    assert not found, "tensor collectives outside megatron_k3/parallel/collectives.py:\n" + "\n".join(found)


def test_scanner_sees_a_direct_call(tmp_path):
    """The scan is not vacuous: the pattern that crashed the trainer is reported."""
    p = tmp_path / "bad.py"
    p.write_text("import torch.distributed as dist\nimport torch\nt = torch.zeros(3)\ndist.all_reduce(t)\n")
    assert len(_direct_collectives(str(p))) == 1


GUARD = r"""
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from megatron_k3.parallel import collectives as C
dist.init_process_group("cuda:fake", store=FakeStore(), rank=0, world_size=2)
try:                                        # the raw call fails as NCCL does
    dist.all_reduce(torch.zeros(3))
    raise SystemExit("raw all_reduce of a CPU tensor on a cuda-only group did not fail")
except RuntimeError as e:
    assert "device type cpu" in str(e), e
assert C.group_device().type == "cuda"
for fn, args in ((C.all_reduce, (torch.zeros(3),)), (C.all_gather, ([torch.zeros(3)] * 2, torch.zeros(3)))):
    try:
        fn(*args)
        raise SystemExit(f"{fn.__name__} accepted a CPU tensor on a cuda-only group")
    except C.CollectiveDeviceError as e:
        assert "cpu" in str(e) and "cuda" in str(e), e
dist.destroy_process_group()
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % __import__("megatron_k3.train.launch_env", fromlist=["x"]).free_port(), rank=0, world_size=1)
assert C.group_device().type == "cpu"
assert C.all_reduce_host(torch.tensor([2.0]), C.ReduceOp.MAX).tolist() == [2.0]
assert C.agree_any(True) and not C.agree_all(False)
dist.destroy_process_group()   # a gloo group left to interpreter teardown can abort ("terminate called ...")
print("OK")
"""


def test_guard_refuses_host_tensor_on_cuda_only_group(root):
    r = subprocess.run([sys.executable, "-c", GUARD], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=root))
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout[-2000:] + r.stderr[-3000:]
