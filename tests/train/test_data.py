"""Tokenizers, the zarr token store and the TokenLoader."""
import base64
import gzip
import json

import numpy as np
import pytest

from megatron_k3.config import ConfigError
from megatron_k3.data.loader import TokenLoader
from megatron_k3.data.prepare import prepare
from megatron_k3.data.store import open_store
from megatron_k3.data.tokenizer import KimiTiktokenTokenizer, load_tokenizer, train_bpe

DOCS = [
    "The quick brown fox jumps over the lazy dog. " * 20,
    "Python is a programming language that lets you work quickly and integrate systems effectively. " * 15,
    "def f(x):\n    return x * 2\n\nprint(f(21))\n" * 25,
    "Attention residuals let each layer choose among earlier block summaries. " * 18,
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    with open(d / "a.jsonl", "w") as f:
        for t in DOCS[:2]:
            f.write(json.dumps({"text": t}) + "\n")
    with gzip.open(d / "b.jsonl.gz", "wt") as f:
        f.write(json.dumps({"text": DOCS[2]}) + "\n")
    (d / "sub").mkdir()
    (d / "sub" / "c.txt").write_text(DOCS[3])
    tok = train_bpe(DOCS, 300, d / "tok.json")
    return d, tok


@pytest.fixture(scope="module")
def store(corpus, tmp_path_factory):
    d, tok = corpus
    out = tmp_path_factory.mktemp("store") / "s.zarr"
    man = prepare([str(d)], str(d / "tok.json"), str(out), workers=2, progress=False)
    return out, man, tok


def test_tokenizer_roundtrip(corpus):
    _, tok = corpus
    for t in DOCS:
        assert tok.decode(tok.encode(t)) == t
    assert tok.vocab_size == 300 and tok.eos_id is not None and tok.pad_id is not None
    assert len(tok.identity()["sha256"]) == 64


def test_store_roundtrip(store):
    out, man, tok = store
    tokens, starts, m = open_store(out)
    expect = []
    for t in [DOCS[0], DOCS[1], DOCS[2], DOCS[3]]:  # a.jsonl, b.jsonl.gz, sub/c.txt in sorted order
        expect += tok.encode(t) + [tok.eos_id]
    assert m["token_count"] == len(expect) == man["token_count"]
    assert np.array_equal(np.asarray(tokens[:]), np.asarray(expect, dtype=np.uint32))
    lens = [len(tok.encode(t)) + 1 for t in DOCS]
    assert np.asarray(starts[:]).tolist() == np.cumsum([0] + lens[:-1]).tolist()
    assert m["num_documents"] == 4 and m["tokenizer"]["sha256"] == tok.identity()["sha256"]
    assert [s["documents"] for s in m["sources"]] == [2, 1, 1]


def _loader(store, **kw):
    out, _, _ = store
    args = dict(seq_length=15, micro_batch_size=2, global_batch_size=8, seed=5, prefetch=0)
    args.update(kw)
    return TokenLoader(out, **args)


def test_every_window_exactly_once_per_epoch_and_new_order(store):
    ld = _loader(store)
    W = ld.num_windows
    seen = {0: [], 1: []}
    while ld.epoch < 2:
        e, c = ld.epoch, ld.cursor
        ld.next_step()
        ids = ld.last_window_ids
        # attribute ids to epochs (a step may straddle the boundary)
        first = min(len(ids), W - c) if e in seen else 0
        if e in seen:
            seen[e] += ids[:first]
        if e + 1 in seen:
            seen[e + 1] += ids[first:]
    assert sorted(seen[0]) == list(range(W)) and len(seen[0]) == W
    assert sorted(seen[1]) == list(range(W))
    assert seen[0] != seen[1]  # a different order each epoch


def test_windows_are_the_stream(store):
    ld = _loader(store)
    tokens, _, _ = open_store(store[0])
    arr = np.asarray(tokens[:])
    micro = ld.next_step()
    w = ld.last_window_ids[0]
    L = 16
    assert micro[0]["tokens"][0].tolist() == arr[w * L:w * L + 15].tolist()
    assert micro[0]["labels"][0].tolist() == arr[w * L + 1:w * L + 16].tolist()


def test_restore_gives_identical_stream(store):
    a = _loader(store, prefetch=2)
    for _ in range(5):
        a.next_step()
    state = a.state_dict()
    rest_a = [[m["tokens"].clone() for m in a.next_step()] for _ in range(6)]
    b = _loader(store, prefetch=2)
    b.load_state_dict(state)
    rest_b = [[m["tokens"].clone() for m in b.next_step()] for _ in range(6)]
    for x, y in zip(rest_a, rest_b):
        for mx, my in zip(x, y):
            assert mx.equal(my)
    a.close(), b.close()
    with pytest.raises(ConfigError, match="loader state mismatch"):
        _loader(store, seq_length=7).load_state_dict(state)


def test_dp_shards_disjoint_and_complete(store):
    full = _loader(store, micro_batch_size=8)
    full.next_step()
    g = full.last_window_ids
    parts = []
    for r in range(4):
        ld = _loader(store, dp_rank=r, dp_size=4, micro_batch_size=1)
        micro = ld.next_step()
        assert len(micro) == 2  # 8 / (1 * 4) micro-batches per rank
        parts.append(ld.last_window_ids)
    assert sum(parts, []) == g
    assert len(set(sum(parts, []))) == 8


def test_pad_labels_masked(store):
    plain = _loader(store).next_step()[0]
    pad = int(plain["labels"][0, 3])  # pretend a token that occurs in the labels is the pad id
    m = _loader(store, pad_id=pad).next_step()[0]
    where = plain["labels"] == pad
    assert where.any()
    assert (m["labels"][where] == -100).all() and m["labels"][~where].equal(plain["labels"][~where])
    assert m["tokens"].equal(plain["tokens"])  # inputs keep the token


def test_bad_inputs(tmp_path, corpus):
    d, tok = corpus
    with pytest.raises(ConfigError, match="data path not found"):
        open_store(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "e.txt").write_text("   \n")
    with pytest.raises(ConfigError, match="empty corpus"):
        prepare([str(tmp_path / "empty")], str(d / "tok.json"), str(tmp_path / "o.zarr"), workers=1, progress=False)
    (tmp_path / "nothing").mkdir()
    with pytest.raises(ConfigError, match="no input files"):
        prepare([str(tmp_path / "nothing")], str(d / "tok.json"), str(tmp_path / "o2.zarr"), workers=1, progress=False)


def test_kimi_tiktoken_loader(tmp_path):
    """A synthetic tiktoken.model (256 byte tokens + 2 merges): ids, specials and the Kimi pattern."""
    ranks = [bytes([i]) for i in range(256)] + [b"th", b"the"]
    (tmp_path / "tiktoken.model").write_text(
        "\n".join(f"{base64.b64encode(t).decode()} {i}" for i, t in enumerate(ranks)) + "\n")
    tok = load_tokenizer(tmp_path / "tiktoken.model")
    assert isinstance(tok, KimiTiktokenTokenizer)
    assert tok.vocab_size == 258 + 256
    assert tok.bos_id == 258 and tok.eos_id == 260 and tok.pad_id == 258 + 255
    ids = tok.encode("the cat 数学")
    assert ids[0] == 257 and tok.decode(ids) == "the cat 数学"


def test_dali_backend_yields_the_same_batches(store):
    pytest.importorskip("nvidia.dali")
    from megatron_k3.data.dali import DALITokenLoader

    out, _, _ = store
    ref = _loader(store, dp_rank=1, dp_size=2, micro_batch_size=2)
    dali = DALITokenLoader(out, seq_length=15, micro_batch_size=2, global_batch_size=8, dp_rank=1, dp_size=2, seed=5,
                           device_id=None)
    for _ in range(60):  # 480 windows: crosses the epoch boundary (385 windows)
        a, b = ref.next_step(), dali.next_step()
        assert len(a) == len(b) == 2
        for x, y in zip(a, b):
            assert x["tokens"].equal(y["tokens"]) and x["labels"].equal(y["labels"])
    assert dali.state_dict() == ref.state_dict()


def test_default_store_built_by_two_processes_at_once(root, tmp_path):
    """Two trainers (or two test workers) that start together both build the default store: each writes its own
    temporary directory and renames it into place; the store is complete and no temporary copy is left."""
    import subprocess
    import sys

    code = ("import sys\nfrom megatron_k3.config import get_preset\n"
            "from megatron_k3.train.pretrain import default_data, ensure_default_store\n"
            "if __name__ == '__main__':\n"
            "    ensure_default_store(sys.argv[1], default_data(get_preset('k3-tiny'))[1])\n")
    script = tmp_path / "build.py"
    script.write_text(code)
    store = tmp_path / "s.zarr"
    env = {**__import__("os").environ, "PYTHONPATH": root}
    procs = [subprocess.Popen([sys.executable, str(script), str(store)], env=env, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), errs
    assert sorted(p.name for p in tmp_path.iterdir()) == ["build.py", "s.zarr"]
    tokens, _, manifest = open_store(store)
    assert tokens.shape[0] > 100_000 and manifest["tokenizer"]["vocab_size"] == 512


def test_prefetch_thread_error_reaches_the_main_thread(store):
    """A read error in the prefetch thread is raised by the next ``next_step`` (naming the store and the
    position), instead of the main thread waiting forever on an empty queue; a thread that dies without
    handing anything over is reported too."""
    import time

    from megatron_k3.data.loader import DataLoaderError

    out = store[0]
    ld = TokenLoader(out, seq_length=15, micro_batch_size=2, global_batch_size=4, seed=3)
    ld.next_step()
    ld.close()

    def broken(ids):
        raise OSError(5, "Input/output error")

    ld._read = broken
    t = time.time()
    with pytest.raises(DataLoaderError, match="epoch 0, window 4 failed: OSError"):
        ld.next_step()
    assert time.time() - t < 10
    ld2 = TokenLoader(out, seq_length=15, micro_batch_size=2, global_batch_size=4, seed=3)
    ld2._producer = lambda epoch, cursor: None  # a thread that ends without a result
    with pytest.raises(DataLoaderError, match="stopped without a result"):
        ld2.next_step()
