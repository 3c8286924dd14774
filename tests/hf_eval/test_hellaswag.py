"""HellaSwag (tools/eval_hellaswag.py, megatron_k3/eval/hellaswag.py) against the lm-eval harness 0.4.13 run on
the same exported model and the same local file (``dataset_path: json`` + ``data_files``)."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from megatron_k3.config import get_preset
from megatron_k3.eval import hellaswag as hs
from megatron_k3.hf import export
from megatron_k3.model import K3ForCausalLM

DATA = "data/hellaswag/sample.jsonl"
TOK = "data/tokenizer/k3-tiny-bpe512.json"
LIMIT = 10  # documents (40 requests): the harness runs in about a minute on 2 busy cores


def _env(root):
    env = dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
    return env


def run_tool(root, *args, check=True):
    r = subprocess.run([sys.executable, os.path.join(root, "tools", "eval_hellaswag.py"), *map(str, args)],
                       capture_output=True, text=True, timeout=600, env=_env(root), cwd=root)
    if check:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def weights():
    """k3-tiny with a few steps of plain next-token training on the sample's text, so predictions vary."""
    cfg = get_preset("k3-tiny")
    torch.manual_seed(0)
    m = K3ForCausalLM(cfg, seed=0)
    from megatron_k3.data.tokenizer import load_tokenizer

    tok = load_tokenizer(TOK)
    text = " ".join(r["ctx"] + " " + r["endings"][int(r["label"])] for r in hs.load_docs(DATA))
    ids = torch.tensor(tok.encode(text)[: 8 * 65]).view(8, 65)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    for _ in range(6):
        loss = m(ids[:, :-1], labels=ids[:, 1:])["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
    return cfg, {k: v.detach() for k, v in m.state_dict().items()}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("hs")
    cfg, sd = weights()
    export.export_hf(export.source_from_state_dict(sd, cfg, {"path": TOK}), d / "hf", progress=False)
    from checkpoints_io import k3ckpt
    from megatron_k3.data.tokenizer import load_tokenizer

    tok = load_tokenizer(TOK)
    k3ckpt.write_weights(d / "ckpt", sd, cfg, tokenizer={**tok.identity(), "path": os.path.abspath(TOK)},
                         writer="buffered")
    return d


def lm_eval_run(hf_dir, tmp_path, limit):
    """The harness's own hellaswag task (yaml + utils copied) on the local file."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    src = os.path.join(os.path.dirname(lm_eval.__file__), "tasks", "hellaswag")
    shutil.copy(os.path.join(src, "utils.py"), tmp_path / "utils.py")
    y = open(os.path.join(src, "hellaswag.yaml")).read()
    data = os.path.abspath(DATA)
    for a, b in (("task: hellaswag", "task: hellaswag_local"), ("tag:\n  - multiple_choice\n", ""),
                 ("dataset_path: Rowan/hellaswag",
                  f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    validation: {data}"),
                 ("training_split: train", "training_split: null")):
        assert a in y
        y = y.replace(a, b)
    (tmp_path / "hellaswag_local.yaml").write_text(y)
    res = lm_eval.simple_evaluate(model="hf", model_args={"pretrained": str(hf_dir), "trust_remote_code": True,
                                                          "dtype": "float32"},
                                  tasks=["hellaswag_local"], task_manager=TaskManager(include_path=str(tmp_path)),
                                  limit=limit, batch_size=4, device="cpu", log_samples=True, bootstrap_iters=1000)
    r = res["results"]["hellaswag_local"]
    samples = sorted(res["samples"]["hellaswag_local"], key=lambda s: s["doc_id"])
    return r, [[resp[0][0] for resp in s["resps"]] for s in samples]


def test_preprocess_matches_lm_eval_utils():
    from lm_eval.tasks.hellaswag import utils as lm_utils

    rows = hs.load_docs(DATA)
    for r in rows:
        ours = hs.process_doc(r)
        q = lm_utils.preprocess(r["activity_label"] + ": " + r["ctx_a"] + " " + r["ctx_b"].capitalize())
        assert ours["query"] == q and ours["choices"] == [lm_utils.preprocess(e) for e in r["endings"]]
        assert ours["gold"] == int(r["label"])
    assert hs.preprocess(" a [title] b [x] c ") == "a. b c"
    wiki = hs.process_doc(rows[24])
    assert "[" not in wiki["query"] and all("[" not in c for c in wiki["choices"])


def test_sample_file_schema():
    rows = [json.loads(line) for line in open(DATA)]
    assert len(rows) == 40
    keys = {"ind", "activity_label", "ctx_a", "ctx_b", "ctx", "endings", "source_id", "split", "split_type", "label"}
    for r in rows:
        assert set(r) == keys and len(r["endings"]) == 4 and r["label"] in "0123" and r["split"] == "val"
        assert r["ctx"] == (r["ctx_a"] + " " + r["ctx_b"] if r["ctx_b"] else r["ctx_a"])


def test_same_numbers_as_lm_eval_harness(root, model_dirs, tmp_path):
    r = run_tool(root, "--model", model_dirs / "hf", "--data", DATA, "--limit", LIMIT, "--batch-size", 3,
                 "--json", "--per-doc", "--no-progress")
    ours = json.loads(r.stdout)
    theirs, their_lls = lm_eval_run(model_dirs / "hf", tmp_path, LIMIT)
    assert ours["n"] == theirs["sample_len"] == LIMIT
    for m in ("acc", "acc_norm"):
        assert ours[m] == theirs[f"{m},none"], m
        assert ours[f"{m}_stderr"] == pytest.approx(theirs[f"{m}_stderr,none"], abs=1e-12), m
    our_lls = [d["loglikelihoods"] for d in ours["per_doc"]]
    assert torch.allclose(torch.tensor(our_lls), torch.tensor(their_lls), rtol=1e-5, atol=1e-4)
    preds = {d["pred"] for d in ours["per_doc"]} | {d["pred_norm"] for d in ours["per_doc"]}
    assert len(preds) > 1  # the model really discriminates (not one constant answer)


def test_checkpoint_equals_hf_dir_and_batching_invariant(root, model_dirs):
    a = json.loads(run_tool(root, "--model", model_dirs / "hf", "--data", DATA, "--limit", 6, "--batch-size", 1,
                            "--json", "--per-doc", "--no-progress").stdout)
    b = json.loads(run_tool(root, "--checkpoint", model_dirs / "ckpt", "--data", DATA, "--limit", 6,
                            "--batch-size", 8, "--json", "--per-doc", "--no-progress").stdout)
    for m in ("acc", "acc_norm", "acc_stderr", "acc_norm_stderr"):
        assert a[m] == pytest.approx(b[m]), m
    assert torch.allclose(torch.tensor([d["loglikelihoods"] for d in a["per_doc"]]),
                          torch.tensor([d["loglikelihoods"] for d in b["per_doc"]]), rtol=1e-5, atol=1e-4)
    assert a["acc_stderr_bootstrap"] >= 0 and "acc_norm_stderr_bootstrap" in b


def test_parquet_equals_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = hs.load_docs(DATA)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "s.parquet")
    assert hs.load_docs(tmp_path / "s.parquet", limit=5) == rows[:5]


def test_metrics_by_hand():
    docs = [{"choices": ["a", "bbbb"], "gold": 1}, {"choices": ["cc", "d"], "gold": 0}]
    # doc 0: ll (-1, -2): acc picks 0 (wrong), norm (-1, -0.5) picks 1 (right); doc 1: ll (-4, -3): acc picks 1
    # (wrong), norm (-2, -3) picks 0 (right)
    res, per = hs.metrics(docs, [-1.0, -2.0, -4.0, -3.0], bootstrap_iters=0)
    assert res["acc"] == 0.0 and res["acc_norm"] == 1.0 and res["acc_norm_stderr"] == 0.0
    assert [p["pred"] for p in per] == [0, 1] and [p["pred_norm"] for p in per] == [1, 0]
    enc = {"ab c": [1, 2, 3], "ab": [1, 2]}
    assert hs.encode_pair(lambda s: enc[s], "ab ", "c") == ([1, 2], [3])  # trailing space moves to continuation


@pytest.mark.parametrize("args,needle", [
    (["--model", "/nonexistent", "--data", DATA], "no such directory"),
    (["--model", "/tmp", "--data", "/nonexistent.jsonl"], "no such file"),
    (["--model", "/tmp", "--data", "README.md"], "expected a .jsonl or .parquet"),
    (["--model", "/tmp", "--data", DATA, "--batch-size", "0"], "--batch-size"),
])
def test_bad_input_one_line(root, args, needle):
    r = run_tool(root, *args, check=False)
    assert r.returncode == 2, r.stdout + r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
