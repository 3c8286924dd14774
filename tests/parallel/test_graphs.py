"""CUDA graphs of the decoder layers (megatron_k3/parallel/graphs.py): what can be checked without a GPU.

Capture and replay need CUDA; their equivalence with the eager model (losses, parameters after Adam steps,
expert bias, and the eager fallback at another micro-batch size) is ``benchmarks/gpu_check.py --only graphs``
(benchmarks/README.md). Here: the refusals, the split of a layer into the captured body and the snapshot
bookkeeping outside it, when a captured layer is replayed or run eagerly, and a short training run through
the whole path with the graphs' static-buffer semantics emulated eagerly.
"""
import pytest
import torch

from megatron_k3.config import ConfigError, get_preset
from megatron_k3.parallel.layout import ParallelLayout
from megatron_k3.parallel.graphs import (CudaGraphError, GraphedLayer, check_cuda_graphs, eager_body, next_blocks,
                                         run_layer)
from megatron_k3.model import K3ForCausalLM


def test_refusals_name_the_reason():
    check_cuda_graphs("none", ParallelLayout(pp=4, ep=2), "full", "blockwise", cuda=False)  # off: anything goes
    check_cuda_graphs("local", ParallelLayout(dp=8), "selective", None, cuda=True)
    cases = [(dict(), {}, "needs a CUDA device", False),
             (dict(pp=2), {}, "pipeline parallelism", True),
             (dict(ep=2, dp=2), {}, "EP x TP x CP = 2 x 1 x 1", True),
             (dict(tp=2), {}, "EP x TP x CP = 1 x 2 x 1", True),
             (dict(cp=2), {}, "EP x TP x CP = 1 x 1 x 2", True),
             (dict(), {"recompute": "full"}, "recompute-granularity full", True),
             (dict(), {"fp8_recipe": "blockwise"}, "FP8 (blockwise)", True),
             (dict(), {"bf16": False}, "fp32 weights", True)]
    for layout_kw, kw, needle, cuda in cases:
        with pytest.raises(CudaGraphError, match=needle.replace("(", r"\(").replace(")", r"\)")) as e:
            check_cuda_graphs("local", ParallelLayout(**layout_kw), cuda=cuda, **kw)
        assert isinstance(e.value, ConfigError)  # the CLIs print it as one line, exit 2
    with pytest.raises(CudaGraphError, match="choose one of none, local"):
        check_cuda_graphs("full-model", ParallelLayout(), cuda=True)


def _golden_layers():
    cfg = get_preset("k3-tiny")
    model = K3ForCausalLM(cfg, seed=0)
    return cfg, list(model.model.layers)


def test_body_and_snapshots_are_the_layer():
    """body(h, *blocks) and the snapshot list rebuilt outside it give exactly the layer's (h, blocks)."""
    cfg, layers = _golden_layers()
    assert cfg.attn_res_block_size is not None and any(lay.snapshot for lay in layers[1:])
    torch.manual_seed(0)
    h = torch.randn(2, 16, cfg.hidden_size)
    blocks = []
    for lay in layers:
        ref_h, ref_blocks = lay(h, blocks)
        out_h, out_blocks = eager_body(lay, h, blocks), next_blocks(lay, h, blocks)
        assert torch.equal(out_h, ref_h)
        assert len(out_blocks) == len(ref_blocks) and all(a is b for a, b in zip(out_blocks, ref_blocks))
        h, blocks = ref_h, ref_blocks


def test_replay_only_when_the_call_matches_the_capture():
    cfg, layers = _golden_layers()
    lay = layers[1]
    D = cfg.hidden_size
    sample = (torch.randn(8, 2, D, requires_grad=True), torch.randn(8, 2, D, requires_grad=True))
    calls = []

    def body(h, *blocks):  # stands in for the replayed graph: the same math, counted
        calls.append(len(blocks))
        return eager_body(lay, h, blocks)

    lay.k3_graph = GraphedLayer(lay, body, sample)
    try:
        h, b = (torch.randn(8, 2, D, requires_grad=True) for _ in range(2))
        out, blocks = run_layer(lay, h, [b])
        ref, ref_blocks = lay(h, [b])
        assert calls == [1] and lay.k3_graph.replays == 1 and torch.equal(out, ref) and blocks == ref_blocks
        small = torch.randn(8, 1, D, requires_grad=True)
        eager = [(small, [small]),                                         # another micro-batch size
                 (h, [b, b]),                                              # another number of blocks
                 (h, [b.detach()])]                                        # an input without grad
        assert not lay.k3_graph.matches(h.to(torch.float64), [b.to(torch.float64)])  # another dtype
        for hh, bb in eager:
            run_layer(lay, hh, bb)
        with torch.no_grad():
            run_layer(lay, h, [b])
        lay.eval()
        run_layer(lay, h, [b])
        assert calls == [1] and lay.k3_graph.replays == 1  # none of those replayed the graph
    finally:
        lay.train()
        del lay.k3_graph


def test_graph_buffer_semantics_in_training(root):
    """The whole path (capture_layer_graphs, replay dispatch, DDP, fused expert wgrad, router counts, Adam)
    with make_graphed_callables replaced by an eager emulation of its static buffers
    (tests/helpers/graph_emulation_check.py): same losses, gradients, parameters and expert bias as eager."""
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, os.path.join(root, "tests", "helpers", "graph_emulation_check.py"), "29753"],
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=root))
    assert r.returncode == 0 and "GRAPH EMULATION OK" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
