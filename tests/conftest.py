import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Intra-op threads per test process: the cores shared among the pytest-xdist workers (tools/run_tests.sh).
# The environment variable reaches the trainers the tests start: with more OpenMP threads than free cores,
# CPU training slows several-fold (beside a second worker on the 2-core VM the main command's 300 steps with
# two threads had not finished after 1,200 s; alone they take ~370 s).
THREADS = max(1, min(2, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker: its share, whatever the controller's environment said
    os.environ["OMP_NUM_THREADS"] = str(THREADS)
else:
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
torch.set_num_threads(THREADS)

# The longest files first (the main command's fixture alone is minutes): started last, one of them would keep
# a worker busy long after the other ran out of files.
FIRST = ("test_pretrain.py", "test_checkpoint.py", "test_parallel.py", "test_offload.py")


def pytest_collection_modifyitems(items):
    order = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(FIRST)))  # stable: a file's tests keep their order


@pytest.fixture(scope="session")
def root():
    return ROOT


def bench_script(name):
    """A script of benchmarks/ imported as a module (by its path); its own imports of sibling scripts
    (``from benchmark import ...``) find the ones imported before it."""
    import importlib.util

    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def bench_module():
    """``bench_module(name)``: a script of benchmarks/ as a module (``bench_script``)."""
    return bench_script


INTERPRETER_PRELUDE = """import os, torch
os.environ["TRITON_INTERPRET"] = "1"
def rel(a, b):  # relative Frobenius error, in fp64
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
"""


@pytest.fixture
def run_triton_interpreted(root):
    """``run(code)``: ``code`` in a child Python under Triton's interpreter (``TRITON_INTERPRET=1``: Triton
    kernels run on CPU tensors), the repository on the path, ``os``, ``torch`` and ``rel(a, b)`` defined; the
    code must print OK at its end. Skips the test where triton is not installed."""
    import subprocess

    pytest.importorskip("triton")

    def run(code: str):
        env = dict(os.environ, PYTHONPATH=root, TRITON_INTERPRET="1")
        r = subprocess.run([sys.executable, "-c", INTERPRETER_PRELUDE + code], capture_output=True, text=True,
                           timeout=600, env=env)
        assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout[-2000:] + r.stderr[-3000:]

    return run
