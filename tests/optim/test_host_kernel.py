"""The one-pass host AdamW kernel (megatron_k3/optim/host_adamw.c, host_kernel.py) against torch's fused CPU
AdamW, which the host stream ran before it (HostAdamWUpdate impl "fused"): the same bits wherever torch's kernel
takes its vector path, the same bits for any chunk/thread layout, and a self-check that refuses a kernel whose
bits differ."""
import pytest
import torch

from megatron_k3.optim import host_kernel
from megatron_k3.optim.offload import HostAdamWUpdate


def _run(impl, n, segments, chunk, outs_of, moments, steps=3, block=1 << 20, build_dir=None, threads=None):
    """A few AdamW steps over [0, n) in chunks; outs_of(h0, h1) -> the chunk's output views. Returns the state
    and every step's outputs."""
    upd = HostAdamWUpdate(n, segments, moments_dtype=moments, impl=impl, cpu_block_elems=block, build_dir=build_dir)
    assert upd.impl == impl, upd.impl_note
    if threads and upd.kernel is not None:
        upd.kernel = host_kernel.OnePassAdamW(upd.kernel.path, threads)
    gen = torch.Generator().manual_seed(7)
    upd.master.copy_(torch.randn(n, generator=gen))
    hyper = [(1e-2, 0.1), (3e-3, 0.0)]
    written = []
    for step in range(1, steps + 1):
        grads = torch.randn(n, generator=gen) * 1e-2
        clip = 0.5 if step % 2 else 1.0
        for h0 in range(0, n, chunk):
            h1 = min(n, h0 + chunk)
            outs = outs_of(h0, h1)
            upd.update(grads[h0:h1].clone(), h0, h1, step, clip, hyper, outs)
            written += [v.clone() for _, v in outs]
    return (upd.master, upd.exp_avg, upd.exp_avg_sq), written


def _mixed_outs(h0, h1):
    """bf16 weights for the first part of the chunk, fp32 for the rest (a chunk spanning two DDP buffers)."""
    cut = (h1 - h0) // 2 // 16 * 16
    return [(0, torch.empty(cut, dtype=torch.bfloat16)), (cut, torch.empty(h1 - h0 - cut, dtype=torch.float32))]


@pytest.mark.parametrize("moments", [torch.bfloat16, torch.float32])
def test_onepass_is_bit_identical_to_fused_on_its_vector_path(tmp_path, moments):
    """One torch thread and every segment, chunk and block a multiple of 16 elements: torch's fused kernel never
    enters its scalar tail, and the one-pass kernel must give its exact bits (state and cast weights)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = 16 * 2000
        segments = [(0, 16 * 700, 0), (16 * 700, 16 * 1300, 1), (16 * 1300, n, 0)]
        ref = _run("fused", n, segments, 16 * 512, _mixed_outs, moments, block=16 * 128)
        one = _run("onepass", n, segments, 16 * 512, _mixed_outs, moments, build_dir=str(tmp_path))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(ref[0], one[0]):
        assert torch.equal(a, b)
    assert len(ref[1]) == len(one[1]) > 0
    for a, b in zip(ref[1], one[1]):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert not torch.equal(ref[0][0], torch.zeros_like(ref[0][0]))


def test_onepass_bits_do_not_depend_on_chunks_or_threads(tmp_path):
    """Odd segment and chunk boundaries, 1 or 2 threads: the same bits (what torch's fused kernel cannot
    promise: its scalar tails round exp_avg_sq differently)."""
    n = 10_007
    segments = [(0, 3001, 0), (3001, 7777, 1), (7777, n, 0)]
    outs = lambda h0, h1: [(0, torch.empty(h1 - h0, dtype=torch.bfloat16))]  # noqa: E731
    a = _run("onepass", n, segments, 1013, outs, torch.bfloat16, build_dir=str(tmp_path), threads=1)
    b = _run("onepass", n, segments, 4099, outs, torch.bfloat16, build_dir=str(tmp_path), threads=2)
    for x, y in zip(a[0], b[0]):
        assert torch.equal(x, y)
    assert torch.equal(torch.cat(a[1][-10:]), torch.cat(b[1][-3:]))  # the last step's weights, all chunks


def test_self_check_refuses_a_kernel_with_other_bits(tmp_path):
    k = host_kernel.OnePassAdamW(host_kernel.build(str(tmp_path)))
    host_kernel.self_check(k)  # the real kernel passes

    class OffByOneUlp(host_kernel.OnePassAdamW):
        def chunk(self, pieces, h0, h1, g, master, *a, **kw):
            super().chunk(pieces, h0, h1, g, master, *a, **kw)
            master[h1 // 2:h1 // 2 + 1] = torch.nextafter(master[h1 // 2:h1 // 2 + 1], torch.tensor(1e9))

    with pytest.raises(host_kernel.KernelUnavailable, match="differs from torch._fused_adamw_"):
        host_kernel.self_check(OffByOneUlp(k.path))


def test_without_a_compiler_auto_falls_back_and_onepass_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(host_kernel, "_loaded", {})
    upd = HostAdamWUpdate(4096, [(0, 4096, 0)], impl="auto", build_dir=str(tmp_path / "b"))
    assert upd.impl == "fused" and "does not run" in upd.impl_note
    with pytest.raises(host_kernel.KernelUnavailable, match="does not run"):
        HostAdamWUpdate(4096, [(0, 4096, 0)], impl="onepass", build_dir=str(tmp_path / "b"))
    with pytest.raises(host_kernel.KernelUnavailable, match="fp32 and bf16"):
        monkeypatch.delenv("CC")
        HostAdamWUpdate(4096, [(0, 4096, 0)], impl="onepass", out_dtypes=[torch.float16],
                        build_dir=str(tmp_path / "b"))
