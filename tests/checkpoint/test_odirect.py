"""O_DIRECT DCP writer: drop-in for the stock writer, page-cache free, falls back cleanly."""
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from checkpoints_io import odirect
from checkpoints_io.odirect import ODirectStream, make_writer


def test_stream_odd_sizes_roundtrip(tmp_path):
    if not odirect.odirect_supported(tmp_path):
        pytest.skip("no O_DIRECT on this file system")
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes()
              for n in (1, 4095, 4097, 70_000, 3, 9000)]
    s = ODirectStream(tmp_path / "f", buffer_bytes=8192)
    pos = []
    for c in chunks:
        pos.append(s.tell())
        s.write(c)
    s.close()
    data = (tmp_path / "f").read_bytes()
    assert data == b"".join(chunks)                      # padded tail truncated back
    assert pos == [sum(len(c) for c in chunks[:i]) for i in range(len(chunks))]


def test_dcp_files_load_with_stock_reader(tmp_path):
    sd = {"w": torch.randn(1000, 37), "b": torch.arange(10), "nested": {"x": torch.randn(3)}, "step": 7}
    dcp.save(sd, storage_writer=make_writer(tmp_path / "ck", "odirect"))
    back = {"w": torch.empty(1000, 37), "b": torch.empty(10, dtype=torch.long), "nested": {"x": torch.empty(3)},
            "step": 0}
    dcp.load(back, storage_reader=FileSystemReader(tmp_path / "ck"))
    assert torch.equal(back["w"], sd["w"]) and torch.equal(back["b"], sd["b"])
    assert torch.equal(back["nested"]["x"], sd["nested"]["x"]) and back["step"] == 7


def test_falls_back_when_odirect_refused(tmp_path, monkeypatch):
    def refuse(self, *args, **kwargs):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(ODirectStream, "__init__", refuse)
    monkeypatch.setattr(odirect, "_warned", set())
    sd = {"w": torch.randn(64, 64)}
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        dcp.save(sd, storage_writer=odirect.ODirectFileSystemWriter(tmp_path / "ck"))
    assert any("falling back to buffered" in str(x.message) for x in w)
    back = {"w": torch.empty(64, 64)}
    dcp.load(back, storage_reader=FileSystemReader(tmp_path / "ck"))
    assert torch.equal(back["w"], sd["w"])


def test_page_cache_growth_1gib(root, tmp_path):
    """benchmarks/bench_checkpoint.py at 1 GiB: O_DIRECT leaves < 64 MiB of its files in the page cache, buffered
    ~ the size (mincore on the checkpoint's own files)."""
    out = tmp_path / "b.json"
    r = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "bench_checkpoint.py"), "--size-gib", "1",
                        "--dir", str(tmp_path / "d"), "--json", str(out)], capture_output=True, text=True,
                       timeout=600, env=dict(os.environ, PYTHONPATH=root))
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.load(open(out))
    if not rep["odirect_supported"]:
        pytest.skip("no O_DIRECT on this file system")
    assert rep["odirect_files_read_by_stock_reader_bit_exact"]
    assert rep["writers"]["odirect"]["checkpoint_pages_in_cache_bytes"] < 64 << 20
    # Both writers are judged by their own files' pages (mincore). The report's page_cache_growth_bytes is
    # /proc/meminfo's Cached delta, which also moves with other processes' cache traffic: with the test suite's
    # other worker writing checkpoints beside this one it read 110 MB for the O_DIRECT writer in a clean-clone
    # CI run (2026-12-03), a number no test here can attribute to this writer, so it is reported, not asserted.
    assert rep["writers"]["buffered"]["checkpoint_pages_in_cache_bytes"] > 0.8 * (1 << 30)
