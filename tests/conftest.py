import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

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
