"""Every user-facing command on bad input: one ``error:`` line, a non-zero exit (2 for usage errors, 1 for a
run that failed for another reason), no traceback, and every file that existed before byte-identical after.

Most cases run through ``python -m megatron_k3 <command>``'s dispatcher in one child process
(tests/helpers/bad_inputs_runner.py: the commands' ``main`` functions as the console runs them, sha256 of
every fixture file before and after each case); the cases that need a process of their own (a save that
hits the file-size limit, a data thread that fails mid-run, the Slurm script's check, the console entry
itself) run as subprocesses. The fixture: a k3-tiny checkpoint of 2 steps, corrupted copies of it, its HF
export, a second tokenizer and store, and bad config and data files."""
import json
import os
import shutil
import subprocess
import sys

import pytest

PY = sys.executable


def _env(root, **kw):
    return dict(os.environ, PYTHONPATH=root, WANDB_MODE="disabled", **kw)


def _run(root, args, timeout=300, **kw):
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=root, env=_env(root), **kw)


@pytest.fixture(scope="module")
def fx(root, tmp_path_factory):
    """The fixture directory (see the module docstring)."""
    d = tmp_path_factory.mktemp("bad")
    ck = d / "ckpt"
    r = _run(root, [PY, "launchers/pretrain_k3.py", "--train-iters", "2", "--micro-batch-size", "2",
                    "--global-batch-size", "2", "--lr-warmup-fraction", "0", "--save", str(ck), "--run-dir",
                    str(d / "run"), "--wandb-mode", "disabled"])
    assert r.returncode == 0, r.stderr[-3000:]
    shard = sorted((ck / "iter_0000002").glob("*.distcp"))[0]
    for name, how in (("ckpt_trunc", "truncate"), ("ckpt_flip", "flip")):
        shutil.copytree(ck, d / name)
        p = d / name / "iter_0000002" / shard.name
        data = bytearray(p.read_bytes())
        if how == "truncate":
            data = data[: len(data) // 2]
        else:
            data[len(data) // 3] ^= 0xFF
        p.write_bytes(bytes(data))
    r = _run(root, [PY, "tools/convert_to_hf.py", "--checkpoint", str(ck), "--output", str(d / "hf"), "--no-progress"])
    assert r.returncode == 0, r.stderr[-3000:]
    # a second tokenizer and a store made with it
    (d / "text").mkdir()
    (d / "text" / "a.txt").write_text("Another small corpus, other words entirely. " * 400)
    r = _run(root, [PY, "tools/train_tokenizer.py", "--input", str(d / "text"), "--vocab-size", "300",
                    "--output", str(d / "tok2.json")])
    assert r.returncode == 0, r.stderr[-3000:]
    r = _run(root, [PY, "-m", "megatron_k3", "prepare-data", "--input", str(d / "text"), "--tokenizer",
                    str(d / "tok2.json"), "--output", str(d / "store2.zarr")])
    assert r.returncode == 0, r.stderr[-3000:]
    files = {
        "syntax.yaml": "train:\n  lr: [1, 2\n",
        "list_section.yaml": "train:\n  - train-iters\n  - 5\n",
        "wrong_type.yaml": "train:\n  micro-batch-size: four\n",
        "misspelled.yaml": "optimizer:\n  lr: 1.0e-3\n",
        "flat.toml": "lr = 1e-3\ntrain_iters = 5\n",
        "wrong_section.yaml": "train:\n  lr: 1.0e-3\n",
        "bad_choice.yaml": "optim:\n  lr-decay-style: exponential\n",
        "unknown_key.yaml": "perf:\n  fp16: true\n",
        "other_model.yaml": "model:\n  preset: k3-tiny\n  num_hidden_layers: 4\n",
        "bad_model_field.yaml": "model:\n  preset: k3-tiny\n  hidden_sise: 32\n",
        "conf.ini": "[train]\nlr=1\n",
        "top_list.yaml": "- 1\n- 2\n",
        "afile.txt": "not a directory\n",
        "tok_corrupt.json": "{ this is not json",
    }
    for name, text in files.items():
        (d / name).write_text(text)
    (d / "notckpt").mkdir()
    (d / "notckpt" / "notes.txt").write_text("unrelated\n")
    (d / "empty").mkdir()
    uni = d / "ü dir with spaces"
    uni.mkdir()
    good = [json.loads(line) for line in open(os.path.join(root, "data", "hellaswag", "sample.jsonl"))][:3]
    lines = [json.dumps(r) for r in good]
    (d / "hs_malformed.jsonl").write_text("\n".join(lines[:1] + ['{"ctx_a": "x", "label": ', *lines[1:]]) + "\n")
    (d / "hs_label_x.jsonl").write_text("\n".join([json.dumps({**good[0], "label": "x"})] + lines[1:]) + "\n")
    (d / "hs_label_7.jsonl").write_text("\n".join([json.dumps({**good[0], "label": "7"})] + lines[1:]) + "\n")
    (d / "hs_empty.jsonl").write_text("")
    (d / "hs_ok.jsonl").write_text("\n".join(lines) + "\n")
    (d / "hs_missing_field.jsonl").write_text(json.dumps({k: v for k, v in good[0].items() if k != "endings"}) + "\n")
    (d / "hs_array.jsonl").write_text("[1, 2, 3]\n")
    return d


# (id, command, argv, exit code, text the error line must contain); {D} is the fixture directory
T = ["--run-dir", "{D}/run_bad", "--wandb-mode", "disabled"]  # a trainer case that got far would write here
ck, hf = "{D}/ckpt", "{D}/hf"
CASES = [
    # the trainer: config files
    ("cfg-yaml-syntax", "train", ["--config", "{D}/syntax.yaml", *T], 2, "cannot parse"),
    ("cfg-section-list", "train", ["--config", "{D}/list_section.yaml", *T], 2, "section 'train' must be a mapping"),
    ("cfg-wrong-type", "train", ["--config", "{D}/wrong_type.yaml", *T], 2, "train.micro-batch-size: expected an integer"),
    ("cfg-misspelled-section", "train", ["--config", "{D}/misspelled.yaml", *T], 2, "unknown section 'optimizer'"),
    ("cfg-flat-file", "train", ["--config", "{D}/flat.toml", *T], 2, "unknown section 'lr'"),
    ("cfg-key-wrong-section", "train", ["--config", "{D}/wrong_section.yaml", *T], 2, "it belongs to 'optim'"),
    ("cfg-bad-choice", "train", ["--config", "{D}/bad_choice.yaml", *T], 2, "'exponential' is not one of"),
    ("cfg-unknown-key", "train", ["--config", "{D}/unknown_key.yaml", *T], 2, "'fp16' is not a setting of section 'perf'"),
    ("cfg-unknown-model-field", "train", ["--config", "{D}/bad_model_field.yaml", *T], 2, "hidden_sise"),
    ("cfg-missing", "train", ["--config", "{D}/nope.yaml", *T], 2, "config file not found"),
    ("cfg-ini", "train", ["--config", "{D}/conf.ini", *T], 2, "unsupported config format"),
    ("cfg-top-list", "train", ["--config", "{D}/top_list.yaml", *T], 2, "top level must be a mapping"),
    ("cfg-is-dir", "train", ["--config", "{D}/empty", *T], 2, "is not a file"),
    # the trainer: flags, counts and layouts
    ("flag-unknown", "train", ["--tensor-parallel", "2", *T], 2, "unrecognized arguments: --tensor-parallel"),
    ("flag-not-int", "train", ["--micro-batch-size", "four", *T], 2, "invalid int value"),
    ("micro-batch-0", "train", ["--micro-batch-size", "0", *T], 2, "--micro-batch-size must be >= 1"),
    ("micro-batch-neg", "train", ["--micro-batch-size", "-2", *T], 2, "--micro-batch-size must be >= 1"),
    ("global-batch-neg", "train", ["--global-batch-size", "-8", *T], 2, "--global-batch-size must be >= 1"),
    ("batch-not-divisible", "train", ["--global-batch-size", "6", "--micro-batch-size", "4", *T], 2,
     "not divisible by micro batch x DP"),
    ("train-iters-0", "train", ["--train-iters", "0", *T], 2, "--train-iters must be >= 1"),
    ("tp-not-dividing-world", "train", ["--tensor-model-parallel-size", "3", *T], 2, "not divisible by TP*PP*CP"),
    ("pp-0", "train", ["--pipeline-model-parallel-size", "0", *T], 2, "--pipeline-model-parallel-size must be >= 1"),
    ("ep-not-dividing", "train", ["--expert-model-parallel-size", "3", *T], 2, "EP=3 must divide"),
    ("warmup-fraction", "train", ["--lr-warmup-fraction", "1.5", *T], 2, "--lr-warmup-fraction must be in [0, 1)"),
    ("lr-negative", "train", ["--lr", "-1", *T], 2, "--lr must be a finite number >= 0"),
    ("lr-nan", "train", ["--lr", "nan", *T], 2, "--lr must be a finite number >= 0"),
    ("save-interval-0", "train", ["--save-interval", "0", *T], 2, "--save-interval must be >= 1"),
    ("exit-interval-0", "train", ["--exit-interval", "0", *T], 2, "--exit-interval must be >= 1"),
    ("graphs-on-cpu", "train", ["--cuda-graph-impl", "local", *T], 2, "it needs a CUDA device"),
    ("fp8-without-bf16", "train", ["--fp8-recipe", "blockwise", *T], 2, "add --bf16"),
    ("muon-distopt", "train", ["--optimizer", "muon", "--use-distributed-optimizer", *T], 2,
     "--optimizer muon runs without --use-distributed-optimizer"),
    # the trainer: files and directories
    ("data-missing", "train", ["--data-path", "{D}/nostore.zarr", *T], 2, "nostore.zarr"),
    ("data-unicode-space", "train", ["--data-path", "{D}/ü dir with spaces/store", *T], 2, "ü dir with spaces"),
    ("data-not-a-store", "train", ["--data-path", "{D}/notckpt", *T], 2, "notckpt"),
    ("tokenizer-corrupt", "train", ["--tokenizer-model", "{D}/tok_corrupt.json", *T], 2, "tok_corrupt.json"),
    ("tokenizer-not-the-stores", "train", ["--tokenizer-model", "{D}/tok2.json", *T], 2,
     "is not the one the store"),
    ("save-is-a-file", "train", ["--save", "{D}/afile.txt", *T], 2, "exists and is not a directory"),
    ("load-missing", "train", ["--load", "{D}/nockpt", *T], 2, "no such directory"),
    ("load-other-files", "train", ["--load", "{D}/notckpt", *T], 2, "holds no checkpoint"),
    ("load-other-model", "train", ["--config", "{D}/other_model.yaml", "--load", ck, *T], 2, "config"),
    ("load-other-tokenizer", "train", ["--data-path", "{D}/store2.zarr", "--tokenizer-model", "{D}/tok2.json",
                                       "--load", ck, *T], 2, "tokenizer"),
    ("load-truncated", "train", ["--load", "{D}/ckpt_trunc", *T], 2, "__0_0.distcp"),
    ("load-flipped-byte", "train", ["--load", "{D}/ckpt_flip", *T], 2, "CRC32"),
    ("load-other-optimizer", "train", ["--load", ck, "--optimizer", "muon", *T], 2, "--no-load-optim"),
    # convert_to_hf
    ("hf-export-missing", "convert-to-hf", ["--checkpoint", "{D}/nockpt", "--output", "{D}/out1"], 2,
     "no such file or directory"),
    ("hf-export-output-file", "convert-to-hf", ["--checkpoint", ck, "--output", "{D}/afile.txt"], 2,
     "exists and is not a directory"),
    ("hf-export-output-nonempty", "convert-to-hf", ["--checkpoint", ck, "--output", "{D}/notckpt"], 2,
     "not empty"),
    ("hf-export-empty-dir", "convert-to-hf", ["--checkpoint", "{D}/empty", "--output", "{D}/out2"], 2, "empty"),
    ("hf-export-truncated", "convert-to-hf", ["--checkpoint", "{D}/ckpt_trunc", "--output", "{D}/out3"], 2,
     "__0_0.distcp"),
    ("hf-export-shard-size", "convert-to-hf", ["--checkpoint", ck, "--output", "{D}/out4", "--shard-size",
                                               "lots"], 2, "--shard-size"),
    ("hf-export-output-under-file", "convert-to-hf", ["--checkpoint", ck, "--output", "{D}/afile.txt/sub"], 2,
     "afile.txt"),
    # convert_from_hf
    ("hf-import-missing", "convert-from-hf", ["--hf", "{D}/nohf", "--output", "{D}/out5"], 2, "no such directory"),
    ("hf-import-not-hf", "convert-from-hf", ["--hf", "{D}/notckpt", "--output", "{D}/out6"], 2, "config.json"),
    ("hf-import-bad-tp", "convert-from-hf", ["--hf", hf, "--output", "{D}/out7", "--tp", "3"], 2, "TP"),
    # eval_hellaswag
    ("hs-malformed-line", "eval-hellaswag", ["--model", hf, "--data", "{D}/hs_malformed.jsonl"], 2,
     "line 2 is not valid JSON"),
    ("hs-label-not-int", "eval-hellaswag", ["--model", hf, "--data", "{D}/hs_label_x.jsonl"], 2,
     "label 'x' is not an integer"),
    ("hs-label-out-of-range", "eval-hellaswag", ["--model", hf, "--data", "{D}/hs_label_7.jsonl"], 2,
     "label 7 is out of range"),
    ("hs-empty", "eval-hellaswag", ["--model", hf, "--data", "{D}/hs_empty.jsonl"], 2, "no rows"),
    ("hs-missing-field", "eval-hellaswag", ["--model", hf, "--data", "{D}/hs_missing_field.jsonl"], 2,
     "lacks endings"),
    ("hs-array-row", "eval-hellaswag", ["--model", hf, "--data", "{D}/hs_array.jsonl"], 2, "expected an object"),
    ("hs-data-missing", "eval-hellaswag", ["--model", hf, "--data", "{D}/nope.jsonl"], 2, "no such file"),
    ("hs-model-missing", "eval-hellaswag", ["--model", "{D}/nohf", "--data", "{D}/hs_ok.jsonl"], 2, "nohf"),
    ("hs-batch-0", "eval-hellaswag", ["--model", hf, "--data", "{D}/hs_empty.jsonl", "--batch-size", "0"], 2,
     "--batch-size must be >= 1"),
    # prepare_data, train_tokenizer
    ("prep-input-missing", "prepare-data", ["--input", "{D}/notext", "--tokenizer", "{D}/tok2.json", "--output",
                                            "{D}/out8.zarr"], 2, "notext"),
    ("prep-tokenizer-corrupt", "prepare-data", ["--input", "{D}/text", "--tokenizer", "{D}/tok_corrupt.json",
                                                "--output", "{D}/out9.zarr"], 2, "tok_corrupt.json"),
    ("prep-output-file", "prepare-data", ["--input", "{D}/text", "--tokenizer", "{D}/tok2.json", "--output",
                                          "{D}/afile.txt"], 2, "afile.txt"),
    ("tok-input-missing", "train-tokenizer", ["--input", "{D}/notext", "--vocab-size", "300", "--output",
                                              "{D}/out.json"], 2, "notext"),
    ("tok-vocab-small", "train-tokenizer", ["--input", "{D}/text", "--vocab-size", "10", "--output",
                                            "{D}/out.json"], 2, "--vocab-size must be >= 260"),
    # plan, model_info, simulate, supervisor
    ("plan-nodes-0", "plan", ["--preset", "k3-mini", "--nodes", "0"], 2, "--nodes"),
    ("plan-tp-heads", "plan", ["--preset", "k3-full", "--nodes", "8", "--tp", "3", "--pp", "1", "--ep", "1"], 2,
     "TP"),
    ("plan-unknown-preset", "plan", ["--preset", "k3-huge"], 2, "unknown preset"),
    ("info-unknown-preset", "model-info", ["--preset", "k3-huge"], 2, "unknown preset"),
    ("info-config-missing", "model-info", ["--config", "{D}/nope.yaml"], 2, "not found"),
    ("simulate-bad-rank", "simulate", ["--preset", "k3-mini", "--nodes", "1", "--ranks", "9"], 2, "--ranks"),
    ("supervise-no-command", "supervise", [], 2, "no command given"),
    ("supervise-max-failures-0", "supervise", ["--max-failures", "0", "--", "true"], 2, "--max-failures"),
    ("supervise-stall-negative", "supervise", ["--stall-timeout", "-1", "--", "true"], 2, "--stall-timeout"),
    ("unknown-command", "frobnicate", [], 2, "unknown command"),
]


def _the_error_line(stderr: str, what) -> str:
    """The one ``error:`` line, which must end stderr; no traceback. (Libraries may log before it: torch prints
    "No CUDA runtime is found" when a CPU machine imports its extension loader.)"""
    lines = [line for line in stderr.splitlines() if line.strip()]
    err = [line for line in lines if line.startswith("error: ")]
    assert "Traceback" not in stderr and "[rank" not in stderr, f"{what}: {stderr[-2000:]}"
    assert len(err) == 1 and lines[-1] == err[0], f"{what}: not one error line at the end: {lines[-5:]}"
    return err[0]


def expand(argv, d):
    return [a.replace("{D}", str(d)) for a in argv]


@pytest.fixture(scope="module")
def results(root, fx):
    cs = [{"id": i, "command": c, "argv": expand(a, fx)} for i, c, a, _, _ in CASES]
    spec = fx.parent / "cases.json"
    spec.write_text(json.dumps(cs))
    r = subprocess.run([PY, os.path.join(root, "tests", "helpers", "bad_inputs_runner.py"), str(spec), str(fx)],
                       capture_output=True, text=True, timeout=900, cwd=root, env=_env(root))
    got = {}
    for line in r.stdout.splitlines():
        if line.startswith("CASE "):
            x = json.loads(line[5:])
            got[x["id"]] = x
    assert len(got) == len(cs), (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
    return got


def test_sweep_has_at_least_40_cases():
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)
    assert {c[1] for c in CASES} >= {"train", "convert-to-hf", "convert-from-hf", "eval-hellaswag", "prepare-data",
                                     "train-tokenizer", "plan", "model-info", "supervise", "simulate"}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_case(results, case):
    cid, cmd, argv, rc, needle = case
    x = results[cid]
    assert x["traceback"] is None, f"{cid}: an exception escaped:\n{x['traceback']}"
    assert x["rc"] == rc, f"{cid}: exit {x['rc']} (want {rc}); stderr: {x['stderr'][-1500:]}"
    line = _the_error_line(x["stderr"], cid)
    assert needle in line, f"{cid}: {needle!r} not in {line!r}"
    assert not x["changed"], f"{cid}: pre-existing files changed: {x['changed']}"
    assert not [f for f in x["created"] if not f.startswith("run_bad/")], f"{cid}: files created: {x['created']}"


# ---- cases that need a process of their own --------------------------------------------------------------
def _one_error_line(r, rc):
    assert r.returncode == rc, (r.returncode, r.stderr[-2000:])
    return _the_error_line(r.stderr, r.args)


def test_disk_full_during_save_keeps_latest(root, fx, tmp_path):
    """A save that cannot write (the file-size limit stands in for a full disk: the writer gets EFBIG) is one
    line naming the step and the checkpoint ``latest`` still names; that checkpoint is byte-identical."""
    import resource

    ck = tmp_path / "ck"
    shutil.copytree(fx / "ckpt", ck)
    before = {p: p.read_bytes() for p in ck.rglob("*") if p.is_file()}

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # 1 MiB per file: a shard is larger

    r = subprocess.run([PY, "launchers/pretrain_k3.py", "--train-iters", "4", "--micro-batch-size", "2",
                        "--global-batch-size", "2", "--lr-warmup-fraction", "0", "--save", str(ck), "--load", str(ck),
                        "--ckpt-write-threads", "1",
                        "--run-dir", str(tmp_path / "run"), "--wandb-mode", "disabled"],
                       capture_output=True, text=True, timeout=300, cwd=root, env=_env(root), preexec_fn=limit)
    line = _one_error_line(r, 1)
    assert "saving step 4" in line and "latest still names step 2" in line, line
    assert {p: p.read_bytes() for p in before} == before
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


def test_nan_loss_stops_with_one_line(root, tmp_path):
    r = _run(root, [PY, "launchers/pretrain_k3.py", "--train-iters", "6", "--lr", "1e25", "--clip-grad", "0",
                    "--lr-warmup-fraction", "0", "--micro-batch-size", "2", "--global-batch-size", "2",
                    "--run-dir", str(tmp_path / "run"), "--wandb-mode", "disabled"])
    line = _one_error_line(r, 1)
    assert "non-finite loss" in line and "stopping without saving" in line


def test_console_entry_and_slurm_script_check(root, tmp_path):
    """The real console path (``python -m megatron_k3``) and the Slurm script's check on the batch host: a
    bad trainer flag is one line and exit 2 before any rank starts (no srun, no scontrol is run)."""
    r = _run(root, [PY, "-m", "megatron_k3", "train", "--micro-batch-size", "0"])
    assert "--micro-batch-size must be >= 1" in _one_error_line(r, 2)
    env = _env(root, SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES="1", SLURM_NTASKS_PER_NODE="2", K3_PROFILE="cpu",
               K3_PYTHON=PY, K3_RUN_DIR=str(tmp_path / "run"), K3_HOME=root)
    r = subprocess.run(["bash", "slurm/pretrain_k3.sh", "--global-batch-size", "3"], capture_output=True,
                       text=True, timeout=300, cwd=root, env=env)
    assert "not divisible by micro batch x DP" in _one_error_line(r, 2)
    r = subprocess.run(["bash", "slurm/pretrain_k3.sh"], capture_output=True, text=True, timeout=60, cwd=root,
                       env=dict(env, K3_PROFILE="nosuch"))
    assert "K3_PROFILE=nosuch" in _one_error_line(r, 2)


def test_out_of_memory_is_one_line(capsys):
    """A real allocation failure (the CPU allocator's; a device's is ``torch.OutOfMemoryError``) inside a command
    becomes one ``error:`` line naming what needs less memory, exit code 1, no traceback."""
    import torch

    from megatron_k3.cli import friendly_errors

    @friendly_errors
    def main():
        torch.empty(1 << 50, dtype=torch.uint8)  # 1 PiB

    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err
    assert e.value.code == 1 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: out of memory (") and "--micro-batch-size" in err and "Traceback" not in err

    @friendly_errors
    def other():
        raise RuntimeError("not a memory error")

    with pytest.raises(RuntimeError):  # anything else keeps its traceback (a bug to report, not a bad input)
        other()
