"""CUDA graphs of whole decoder layers (``--cuda-graph-impl local``): one forward and one backward graph
per layer, captured once with ``torch.cuda.make_graphed_callables`` and replayed every micro-batch.

Why: at k3-mini size one training step issues ~10,000 kernels and the GPU is busy for well under half the
step (``benchmarks/README.md``): the host's Python, autograd and launch work is the bottleneck. A replayed
graph launches a layer's forward (or backward) as one unit, so the host cost of a layer no longer depends
on how many kernels it has.

What is captured: ``body(h, *blocks) -> h'``, the layer's math on the partial block sum ``h`` and the
completed AttnRes snapshots ``blocks`` (the golden ``K3DecoderLayer.forward``); the snapshot list itself
(``blocks + [h]`` at a block's first layer) is rebuilt outside the graph, so no graph output aliases an
input.

Shared static inputs: a replay copies each input into the graph's static input unless it already lives
there (torch compares ``data_ptr``). Snapshot ``j`` is the ``h`` input of the block's first layer ``s_j``,
which that layer's replay has just copied into its static ``h``; so the static input of snapshot ``j`` in
every later layer's graph *is* that tensor (``capture_layer_graphs`` passes it as their sample), and the
snapshot handed on is ``_StaticAlias(h)``: the values of that buffer with ``h``'s autograd history. A later
layer's replay then copies nothing for its blocks (k3-mini: 81 of 105 input copies of 64 MiB per
micro-batch, and 81 static buffers fewer). The buffer keeps its values until ``s_j`` replays again, i.e.
the next micro-batch's forward, after this one's backward (no pipelining: ``check_cuda_graphs``).
``perf.graph_shared_inputs = False`` gives every graph its own block inputs again (the A/B switch).

The backward graph returns the gradients of ``h`` and of every block; the layer's parameter gradients are
added to megatron DDP's ``main_grad`` buffers inside the graph (the grouped experts by
``moe.stacked_main_grad``, every other parameter by ``_AddToMainGrad``; the buffers are persistent, so the
captured addresses stay valid), which is all DDP's hooks would do without overlapped reduction
(``runtime.wrap_ddp`` marks the parameters only then; ``grads_in_graph``). The parameters are then not
inputs of the graph at all (``_SunkLayerBody``); otherwise (or with ``perf.graph_main_grad = False``) the graph
returns their gradients too and they go through ``AccumulateGrad`` and the hooks as usual.

Conditions, checked up front by ``check_cuda_graphs`` (a clear error instead of a wrong replay):
- CUDA; no pipeline parallelism (1F1B keeps several micro-batches' activations in flight, a layer's graph
  holds one) and no full-layer recompute (it would replay the forward graph inside backward);
- EP x TP x CP = 1: the MoE dispatch is then sync-free (``patches/local_dispatcher.py``), every shape
  is static and no collective runs inside a layer (data parallelism is fine: its reduction runs after
  backward, outside the graphs);
- bf16 weights: in fp32, ``torch._grouped_mm`` takes a fallback that copies the group offsets to the host
  ("Cannot copy between CPU and CUDA tensors during CUDA graph capture", H200, 2026-12-02);
- no Transformer Engine FP8 (its scaling state is updated by host code around its modules); torchao's FP8
  recipes (`--fp8-recipe torchao-*`) are stateless device code and are captured like the rest.
A call whose inputs differ from the captured ones (shape, dtype, number of blocks), and every call
without grad or in eval mode, runs the layer eagerly: the same math, so validation and a short last batch
stay correct (and eval forwards do not add to the routers' token counts inside a graph).

After capture, the warm-up and capture work is undone where it touched persistent state: the DDP grad
buffers (the experts' fused weight-gradient adds ran during warm-up) and the routers' token counts.

Streams: ``use_graph_stream`` must make a side stream current before the model and DDP are built (the
benchmark, ``gpu_check`` and the trainer call it right after ``check_cuda_graphs``), as megatron's own
``CudaGraphManager`` does. Megatron's DDP keeps every parameter's ``AccumulateGrad`` node alive from its
construction (its grad hooks hang on them), and autograd runs a node's input-buffer work on the stream the
node was created on. Created on the legacy default stream, the backward capture (on
``torch.cuda.graph``'s capture stream) would make the default stream wait on the capturing stream, which
CUDA forbids ("operation would make the legacy stream depend on a capturing blocking stream"): measured on
the H200 on 2026-12-02 as ``cudaErrorStreamCaptureInvalidated`` at the first backward graph's
``capture_end``, with torch's warning that "the AccumulateGrad node's stream does not match". On a side
stream the same wait is a legal fork of the capture that autograd joins back at the end of backward.
``capture_layer_graphs`` refuses to start on the default stream.
"""
from __future__ import annotations

import torch
from torch import nn

from ..config import ConfigError
from ..perf import current as current_kernels

IMPLS = ("none", "local")


class CudaGraphError(ConfigError):
    """The requested CUDA graphs cannot be used with this layout, recompute or precision."""


def check_cuda_graphs(impl: str, layout, recompute: str = "none", fp8_recipe: str | None = None,
                      cuda: bool | None = None, bf16: bool = True) -> None:
    """Raise ``CudaGraphError`` naming the first condition (module docstring) that ``impl`` violates."""
    if impl not in IMPLS:
        raise CudaGraphError(f"--cuda-graph-impl {impl!r}: choose one of {', '.join(IMPLS)}")
    if impl == "none":
        return
    cuda = torch.cuda.is_available() if cuda is None else cuda
    problems = []
    if not cuda:
        problems.append("it needs a CUDA device (this process has none)")
    if layout.pp > 1 or layout.vpp > 1:
        problems.append(f"pipeline parallelism (PP={layout.pp}, VPP={layout.vpp}) keeps several micro-batches "
                        "in flight per layer; a layer graph holds one")
    if layout.ep * layout.tp * layout.cp > 1:
        problems.append(f"EP x TP x CP = {layout.ep} x {layout.tp} x {layout.cp}: the MoE all-to-all needs host-side "
                        "split sizes and the layers run collectives (graphs need EP = TP = CP = 1)")
    if recompute == "full":
        problems.append("--recompute-granularity full would replay a layer's forward graph inside its backward "
                        "(use none or selective)")
    if not bf16:
        problems.append("fp32 weights: torch._grouped_mm (the grouped experts) copies its group offsets to the host "
                        "outside bf16, which a capture forbids (add --bf16)")
    from .precision import is_torchao

    if fp8_recipe and not is_torchao(fp8_recipe):
        problems.append(f"FP8 ({fp8_recipe}): Transformer Engine updates its scaling state in host code around "
                        "each module (torchao's recipes, --fp8-recipe torchao-rowwise, run in the graphs)")
    if problems:
        raise CudaGraphError("--cuda-graph-impl local cannot be used here: " + "; ".join(problems))


def use_graph_stream(impl: str) -> None:
    """With ``impl == "local"`` on CUDA: make a fresh side stream current for the rest of the process. Call it
    before the model and its DDP wrapper are built (module docstring, "Streams")."""
    if impl == "local" and torch.cuda.is_available():
        torch.cuda.set_stream(torch.cuda.Stream())


class _AddToMainGrad(torch.autograd.Function):
    """``(p, anchor) -> p``: identity on a parameter whose backward adds the parameter's gradient to its
    ``main_grad`` (megatron DDP's buffer) and passes none on to the parameter. Inside a captured backward
    graph the add is one more recorded kernel on a persistent buffer, instead of a graph output that
    autograd hands to the parameter's ``AccumulateGrad`` node and DDP's Python hook adds after the replay.
    ``anchor`` (an empty leaf, an input of the graph) gets an empty gradient: it puts these nodes on the
    path from the outputs to the graph's inputs, so the captured backward runs them although the
    parameters themselves are not inputs of the graph (as inputs, their ``AccumulateGrad`` nodes would be
    visited during capture: on the H200 that invalidated the capture, 2026-12-03)."""

    @staticmethod
    def forward(ctx, p, anchor):
        ctx.param = p
        return p.view_as(p)

    @staticmethod
    def backward(ctx, g):
        ctx.param.main_grad.add_(g)
        return None, g.new_zeros(0)


class _StaticAlias(torch.autograd.Function):
    """``(x, buf) -> buf``'s storage with ``x``'s autograd history: the forward returns a detached alias of
    ``buf`` (which must hold ``x``'s values: the graph replay that filled it), the backward hands the
    gradient to ``x`` unchanged. ``buf`` is not an input of the node (passed in a list), so autograd neither
    tracks nor saves it."""

    @staticmethod
    def forward(ctx, x, holder):
        return holder[0].detach()

    @staticmethod
    def backward(ctx, g):
        return g, None


def shared_static_inputs() -> bool:
    """Whether later layers' graphs read the AttnRes snapshots from the snapshot layers' static inputs (module
    docstring, "Shared static inputs"); ``perf.graph_shared_inputs = False``: every graph copies its own."""
    return current_kernels().graph_shared_inputs


def main_grad_params(layer) -> dict[str, torch.Tensor]:
    """The parameters of ``layer`` whose gradients its captured backward adds to ``main_grad`` itself:
    those ``runtime.wrap_ddp`` marked ``k3_graph_main_grad`` (DDP without overlapped reduction, whose hooks
    would only do that add), except the grouped experts' (``k3_fuse_wgrad``: they add theirs already)."""
    return {n: p for n, p in layer.named_parameters()
            if p.requires_grad and getattr(p, "k3_graph_main_grad", False) and hasattr(p, "main_grad")
            and not getattr(p, "k3_fuse_wgrad", False)}


def grads_in_graph(layer) -> bool:
    """Whether every trainable parameter of ``layer`` gets its gradient added to ``main_grad`` inside the
    layer's graph (``main_grad_params`` or the experts' fused adds), so the graph needs no parameter
    gradient outputs. ``perf.graph_main_grad = False`` turns this off (parameter gradients leave the graph)."""
    if not current_kernels().graph_main_grad:
        return False
    sunk = main_grad_params(layer)
    return bool(sunk) and all(p is sunk.get(n) or getattr(p, "k3_fuse_wgrad", False)
                              for n, p in layer.named_parameters() if p.requires_grad)


class _LayerBody(nn.Module):
    """``(h, *blocks) -> h'``: what is captured of one decoder layer (kept out of the model's module tree);
    a module, so ``make_graphed_callables`` returns the gradients of its parameters too."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, h, *blocks):
        return eager_body(self.layer, h, blocks)


class _SunkLayerBody:
    """``(anchor, h, *blocks) -> h'`` for a layer with ``grads_in_graph``: a plain callable (its parameters
    are not graph inputs), the parameters of ``main_grad_params`` entering through ``_AddToMainGrad``
    (``torch.func.functional_call``). Per micro-batch that removes, per parameter, one ``AccumulateGrad``
    node, one DDP hook and one add launched from Python after the replay (k3-mini: ~300 per micro-batch)."""

    def __init__(self, layer):
        self.layer = layer

    def __call__(self, anchor, h, *blocks):
        from torch.func import functional_call

        subst = {n: _AddToMainGrad.apply(p, anchor) for n, p in main_grad_params(self.layer).items()}
        out, _ = functional_call(self.layer, subst, (h, list(blocks) if self.layer.attn_res else None))
        return out


def eager_body(layer, h, blocks):
    out, _ = layer(h, list(blocks) if layer.attn_res else None)
    return out


def next_blocks(layer, h, blocks):
    """The snapshot list after ``layer`` (``K3DecoderLayer.forward``): ``h`` is appended at a block's start."""
    if not layer.attn_res:
        return None
    return list(blocks) + [h] if layer.snapshot else blocks


class GraphedLayer:
    """The replayable form of one layer (a plain object, not a submodule: the model's parameter names and
    state dict do not change)."""

    def __init__(self, layer, graphed_body, sample, anchor=None, shared_inputs: bool = True):
        self.layer, self.body = layer, graphed_body
        self.sig = [(t.shape, t.dtype, t.device) for t in sample]
        self.anchor = anchor  # the empty leaf of a _SunkLayerBody's graph (None: parameter gradients leave it)
        # a snapshot layer's static h: the later layers' graphs read their copy of this snapshot from it
        # (module docstring, "Shared static inputs")
        self.static_h = sample[0] if shared_inputs and getattr(layer, "snapshot", False) else None
        self.replays = 0  # forward replays so far (tests and benchmarks read it)

    def matches(self, h, blocks) -> bool:
        ts = [h] + list(blocks or [])
        return (len(ts) == len(self.sig) and all((t.shape, t.dtype, t.device) == s for t, s in zip(ts, self.sig))
                and all(t.requires_grad for t in ts))

    def __call__(self, h, blocks):
        self.replays += 1
        lead = () if self.anchor is None else (self.anchor,)
        out = self.body(*lead, h, *(blocks or []))
        if self.static_h is not None:  # the replay left h's values in static_h: hand on an alias of it
            h = _StaticAlias.apply(h, [self.static_h])
        return out, next_blocks(self.layer, h, blocks)


def run_layer(layer, h, blocks):
    """The layer through its graph when one was captured and this call can replay it, else eagerly."""
    g = getattr(layer, "k3_graph", None)
    if g is not None and layer.training and torch.is_grad_enabled() and g.matches(h, blocks):
        return g(h, blocks)
    return layer(h, blocks)


def _k3_models(chunks):
    """The K3 stage modules inside ``chunks`` (megatron wrappers removed); checked by shape rather than by class
    (``model.py`` imports this module)."""
    from megatron.core.utils import unwrap_model

    models = unwrap_model(list(chunks))
    for c, m in zip(chunks, models):
        if not (hasattr(m, "layers") and hasattr(m, "layer_start") and hasattr(m, "num_blocks_before")):
            raise TypeError(f"expected a K3MegatronModel (or a wrapper of one), got {type(c).__name__}")
    return models


def layer_graph_replays(chunks) -> int:
    """Forward replays of all captured layer graphs of ``chunks`` so far (0 when none were captured)."""
    return sum(lay.k3_graph.replays for m in _k3_models(chunks) for lay in m.layers.values()
               if getattr(lay, "k3_graph", None) is not None)


def release_layer_graphs(chunks) -> None:
    """Drop the captured graphs of ``chunks`` (each ``GraphedLayer`` and its layer refer to each other, so
    without this their private memory pools outlive the model until the garbage collector runs)."""
    for m in _k3_models(chunks):
        for layer in m.layers.values():
            if getattr(layer, "k3_graph", None) is not None:
                layer.k3_graph = None


def capture_layer_graphs(chunks, ddp, micro_batch_size: int, seq_length: int, warmup_iters: int = 3) -> int:
    """Capture every decoder layer of ``chunks`` (``check_cuda_graphs`` passed) for micro-batches of
    ``micro_batch_size`` x ``seq_length`` tokens; returns the number of layers captured. ``ddp``: the DDP
    wrappers whose grad buffers are zeroed afterwards."""
    from .routers import moe_routers

    models = _k3_models(chunks)
    dev = next(models[0].parameters()).device
    if dev.type == "cuda" and torch.cuda.current_stream(dev) == torch.cuda.default_stream(dev):
        raise CudaGraphError("layer graphs need the model, DDP and training on a side stream: call "
                             "graphs.use_graph_stream('local') before building them (graphs.py, 'Streams')")
    bodies, samples, layers = [], [], []
    shared = shared_static_inputs()
    for m in models:
        if not m.pre_process:
            raise CudaGraphError("layer graphs are captured on the first (only) pipeline stage")
        D = m.cfg.hidden_size
        dtype, dev = m.embed_tokens.weight.dtype, m.embed_tokens.weight.device
        gen = torch.Generator(device=dev).manual_seed(0)
        snaps = []  # static h of the snapshot layers so far: the static block inputs of every later layer
        for layer in m.layers.values():
            nb = m.num_blocks_before(layer.layer_idx) if m.attn_res else 0
            if len(snaps) != nb:
                raise CudaGraphError(f"layer {layer.layer_idx}: {nb} AttnRes blocks expected, {len(snaps)} snapshot "
                                     "layers before it")
            fresh = [(torch.randn(seq_length, micro_batch_size, D, device=dev, generator=gen) * 0.02).to(dtype)
                     .requires_grad_() for _ in range(1 if shared else 1 + nb)]
            sample = tuple(fresh) if not shared else (fresh[0],) + tuple(snaps)
            if getattr(layer, "snapshot", False):
                snaps.append(fresh[0])
            if grads_in_graph(layer):
                anchor = torch.zeros(0, device=dev, requires_grad=True)
                bodies.append(_SunkLayerBody(layer))
                samples.append((anchor,) + sample)
            else:
                anchor = None
                bodies.append(_LayerBody(layer).train(layer.training))
                samples.append(sample)
            layers.append((layer, sample, anchor))
    if not bodies:
        return 0
    try:
        graphed = torch.cuda.make_graphed_callables(tuple(bodies), tuple(samples), num_warmup_iters=warmup_iters,
                                                    allow_unused_input=True)
        for (layer, sample, anchor), body in zip(layers, graphed):
            layer.k3_graph = GraphedLayer(layer, body, sample, anchor, shared)
    finally:  # undo what warm-up and capture left in persistent state (also when capture failed)
        torch.cuda.synchronize()
        for d in ddp:
            d.zero_grad_buffer()
        with torch.no_grad():
            for _, r in moe_routers(models):
                r.local_tokens_per_expert.zero_()
                for name in ("k3_qb_sum", "k3_qb_count"):
                    getattr(r, name).zero_()
    return len(layers)
