"""HF export/import (tools/convert_to_hf.py, tools/convert_from_hf.py, megatron_k3/hf/) checked against the
real clients: transformers' remote-code loading of the K3 layout and its native Kimi Linear classes.

The reference logits are the golden model's on the same weights (the megatron model is proven equal to the
golden one by test_parallel.py)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_k3.config import get_preset
from megatron_k3.hf import export, names
from megatron_k3.hf.importer import HFDir
from megatron_k3.model import K3ForCausalLM

TOK = "data/tokenizer/k3-tiny-bpe512.json"
TOL = 1e-5  # fp32: max |diff| / max |logit|


def _env(root):
    env = dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1", WANDB_MODE="disabled", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
    env.pop("WORLD_SIZE", None)
    return env


def tool(root, name, *args, check=True):
    r = subprocess.run([sys.executable, os.path.join(root, "tools", name), *map(str, args)], capture_output=True,
                       text=True, timeout=600, env=_env(root), cwd=root)
    if check:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def golden(cfg, sd):
    m = K3ForCausalLM(cfg, init=False)
    m.load_state_dict(sd)
    return m.eval()


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def perturbed_state(cfg, seed=0):
    """A golden state dict whose zero-initialised tensors (AttnRes queries, router bias, bounded A_log) are
    made non-trivial, so the comparison sees every tensor."""
    sd = K3ForCausalLM(cfg, seed=seed).state_dict()
    g = torch.Generator().manual_seed(seed + 1)
    for k, v in sd.items():
        if k.endswith(("A_log", "e_score_correction_bias", "res_proj.weight")):
            v.copy_(torch.randn(v.shape, generator=g) * 0.2)
    return sd


def hf_logits(path, ids, **kw):
    from transformers import AutoModelForCausalLM

    m, info = AutoModelForCausalLM.from_pretrained(str(path), output_loading_info=True, **kw)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    assert not bad, bad
    with torch.no_grad():
        return m.eval()(ids).logits, m


IDS = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(7))


# ------------------------------------------------------------------------------------------------------
# round trip through a real trainer checkpoint saved at TP2 x PP2
@pytest.fixture(scope="module")
def trained(root, tmp_path_factory):
    d = tmp_path_factory.mktemp("hf_tp2pp2")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", "29761",
           os.path.join(root, "launchers", "pretrain_k3.py"), "--config", "configs/k3-tiny-cpu.yaml",
           "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--train-iters", "2",
           "--lr-warmup-fraction", "0.5",
           "--micro-batch-size", "2", "--global-batch-size", "4", "--wandb-mode", "disabled",
           "--save", str(d / "ckpt"), "--run-dir", str(d / "run")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env(root), cwd=root)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return d


def test_roundtrip_tp2pp2_checkpoint_remote_code_and_back(root, trained):
    from checkpoints_io import k3ckpt

    d = trained
    meta, shapes, get = k3ckpt.read_weights(d / "ckpt")
    cfg = get_preset("k3-tiny")
    sd = get(list(shapes))
    ref = golden(cfg, sd)(IDS)

    # dry run: names and shapes only, release layout
    r = tool(root, "convert_to_hf.py", "--checkpoint", d / "ckpt", "--dry-run")
    rows = dict(line.split("\t")[:2] for line in r.stdout.splitlines() if not line.startswith("#"))
    assert len(rows) == len(shapes) and all(k.startswith("language_model.") for k in rows)
    assert rows["language_model.model.layers.0.self_attn.A_log"] == "[128]"
    assert rows["language_model.lm_head.weight"] == "[512, 64]"

    hf_dir = d / "hf"
    tool(root, "convert_to_hf.py", "--checkpoint", d / "ckpt", "--output", hf_dir, "--shard-size", "1M")
    conf = json.loads((hf_dir / "config.json").read_text())
    tc = conf["text_config"]
    assert conf["model_type"] == "kimi_k3" and conf["auto_map"]["AutoModelForCausalLM"]
    assert tc["model_type"] == "kimi_linear" and tc["hidden_act"] == "situ"
    assert tc["linear_attn_config"]["kda_layers"] == [1, 2, 3, 5, 6]
    assert tc["linear_attn_config"]["full_attn_layers"] == [4, 7, 8]
    assert tc["linear_attn_config"]["gate_lower_bound"] == -5.0 and tc["linear_attn_config"]["use_full_rank_gate"]
    for k in ("mla_use_nope", "mla_use_output_gate", "latent_moe_use_norm"):
        assert tc[k] is True
    assert tc["routed_expert_hidden_size"] == 32 and tc["attn_res_block_size"] == 2
    assert tc["activation_situ_beta"] == 4.0 and tc["activation_situ_linear_beta"] == 25.0
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2  # sharded
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "modeling_k3.py",
              "configuration_k3.py", "k3_golden.py", "k3_kda.py"):
        assert (hf_dir / f).is_file(), f
    assert json.loads((hf_dir / "k3_export.json").read_text())["step"] == 2

    # transformers, remote code, CPU
    logits, model = hf_logits(hf_dir, IDS, trust_remote_code=True)
    assert rel_err(logits, ref) < TOL
    assert model.language_model.model.layers[0].self_attn.A_log.shape == (128,)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(hf_dir), trust_remote_code=True)
    from megatron_k3.data.tokenizer import load_tokenizer

    assert tok.encode("def f(x):\n    return x") == load_tokenizer(TOK).encode("def f(x):\n    return x")

    # back into a checkpoint meant for another layout (EP2), read at any layout: same logits
    out = d / "imported"
    tool(root, "convert_from_hf.py", "--hf", hf_dir, "--output", out, "--tp", 1, "--pp", 1, "--ep", 2)
    meta2, shapes2, get2 = k3ckpt.read_weights(out)
    assert meta2["weights_only"] and meta2["config"] | {"name": ""} == meta["config"] | {"name": ""}
    sd2 = get2(list(shapes2))
    assert sd2.keys() == sd.keys() and all(torch.equal(sd2[k], sd[k]) for k in sd)
    assert rel_err(golden(cfg, sd2)(IDS), ref) < TOL
    assert meta2["tokenizer"]["sha256"] == meta["tokenizer"]["sha256"]

    # the trainer resumes from it at EP2 (2 ranks)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29762",
           os.path.join(root, "launchers", "pretrain_k3.py"), "--config", "configs/k3-tiny-cpu.yaml",
           "--expert-model-parallel-size", "2", "--train-iters", "2", "--lr-warmup-fraction", "0.5",
           "--micro-batch-size", "2", "--global-batch-size", "4", "--wandb-mode", "disabled", "--load", str(out),
           "--run-dir", str(d / "run2")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env(root), cwd=root)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "loaded weights from" in r.stdout


# ------------------------------------------------------------------------------------------------------
# Kimi Linear layout: transformers' native classes, no remote code
def kimi_linear_tiny():
    return get_preset("kimi-linear-48b", hidden_size=64, num_hidden_layers=8, kda_layers=[1, 2, 3, 5, 6, 7],
                      vocab_size=512, kda_num_heads=4, kda_head_dim=16, num_attention_heads=4, kv_lora_rank=32,
                      qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=192, num_experts=8,
                      num_experts_per_token=2, moe_intermediate_size=32, kda_chunk_size=16, bos_token_id=None,
                      eos_token_id=None, pad_token_id=None)


def test_kimi_linear_native_transformers_same_logits(tmp_path):
    from transformers.models.kimi_linear import KimiLinearForCausalLM

    cfg = kimi_linear_tiny()
    sd = K3ForCausalLM(cfg, seed=3).state_dict()
    g = torch.Generator().manual_seed(5)
    for k, v in sd.items():
        if k.endswith("e_score_correction_bias"):
            v.copy_(torch.randn(v.shape, generator=g) * 0.2)
    ref = golden(cfg, sd)(IDS)
    export.export_hf(export.source_from_state_dict(sd, cfg, {"path": TOK}), tmp_path / "kl", layout="kimi_linear",
                     progress=False)
    conf = json.loads((tmp_path / "kl" / "config.json").read_text())
    assert conf["model_type"] == "kimi_linear" and "auto_map" not in conf
    assert not list((tmp_path / "kl").glob("*.py"))
    logits, model = hf_logits(tmp_path / "kl", IDS)
    assert isinstance(model, KimiLinearForCausalLM)
    assert rel_err(logits, ref) < TOL
    # import back (also from transformers' own save_pretrained output)
    back = HFDir(tmp_path / "kl")
    want = cfg.replace(bos_token_id=2, eos_token_id=0, pad_token_id=1)  # the tokenizer's ids fill the flat config
    assert back.cfg.to_dict() | {"name": ""} == want.to_dict() | {"name": ""}
    sd2 = back.state_dict()
    assert all(torch.equal(sd2[k], sd[k]) for k in sd)
    model.save_pretrained(tmp_path / "saved")
    sd3 = HFDir(tmp_path / "saved").state_dict()
    assert sd3.keys() == sd.keys() and all(torch.equal(sd3[k], sd[k]) for k in sd)


def test_kimi_linear_layout_refuses_k3_features(root, tmp_path):
    sd = K3ForCausalLM(get_preset("k3-tiny"), seed=0).state_dict()
    torch.save(sd, tmp_path / "w.pt")
    r = tool(root, "convert_to_hf.py", "--checkpoint", tmp_path / "w.pt", "--preset", "k3-tiny", "--layout",
             "kimi_linear", "--output", tmp_path / "o", check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0
    for needle in ("hidden_act='situ'", "gate_lower_bound", "attn_res_block_size", "routed_expert_hidden_size"):
        assert needle in r.stderr
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------------------------------
def test_bf16_export_keeps_fp32_tensors_and_loads(tmp_path):
    from safetensors import safe_open

    cfg = get_preset("k3-tiny")
    sd = perturbed_state(cfg)
    export.export_hf(export.source_from_state_dict(sd, cfg, {"path": TOK}), tmp_path / "bf", dtype="bf16",
                     progress=False)
    seen = {}
    for f in (tmp_path / "bf").glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                seen[k] = h.get_tensor(k).dtype
    for k, dt in seen.items():
        assert dt == (torch.float32 if names.keeps_fp32(k) else torch.bfloat16), (k, dt)
    ref = golden(cfg, sd)(IDS)
    logits, model = hf_logits(tmp_path / "bf", IDS, trust_remote_code=True, dtype=torch.bfloat16)
    assert model.language_model.model.layers[0].self_attn.A_log.dtype == torch.float32
    assert rel_err(logits.float(), ref) < 0.1  # bf16 weights and activations


def test_streaming_one_shard_at_a_time(tmp_path):
    cfg = get_preset("k3-tiny")
    sd = perturbed_state(cfg)
    src = export.source_from_state_dict(sd, cfg)
    calls, inner = [], src.get
    src.get = lambda which: calls.append(sum(sd[n].numel() * 4 for n in which)) or inner(which)
    s = export.export_hf(src, tmp_path / "s", shard_bytes=256 << 10, progress=False)
    biggest = max(v.numel() * 4 for v in sd.values())
    assert s["shards"] == len(calls) > 4 and max(calls) <= max(256 << 10, biggest)
    index = json.loads((tmp_path / "s" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == s["bytes"] and len(index["weight_map"]) == len(sd)
    assert (tmp_path / "s" / "k3_export.json").is_file() and not (tmp_path / "s" / "tokenizer.json").exists()


def test_mxfp4_experts_dequantised_on_import(tmp_path):
    from safetensors.torch import load_file, save_file

    # the format on hand values: one group of 32, scale 2^1
    vals = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0] * 4) * 2
    packed, scale = names.quantize_mxfp4(vals.view(1, 32))
    assert scale.tolist() == [[128]] and torch.equal(names.dequantize_mxfp4(packed, scale)[0], vals)
    assert packed[0, 0].item() == (1 << 4) | 0  # low nibble first: 0.0, 1.0 = codes 0, 1 (0.0, 0.5 x 2^1)

    cfg = get_preset("k3-tiny")
    sd = perturbed_state(cfg)
    d = tmp_path / "q"
    export.export_hf(export.source_from_state_dict(sd, cfg), d, shard_bytes=1 << 30, progress=False)
    f = next(d.glob("model-*.safetensors"))
    t = load_file(str(f))
    expect = dict(sd)
    for k in [k for k in t if ".experts." in k]:
        packed, scale = names.quantize_mxfp4(t.pop(k))
        t[k + "_packed"], t[k + "_scale"] = packed, scale
        expect[k[len("language_model."):]] = names.dequantize_mxfp4(packed, scale)
    t["vision_tower.patch_embed.weight"] = torch.zeros(2, 2)  # another modality: skipped
    save_file(t, str(f))
    index = {"metadata": {}, "weight_map": {k: f.name for k in t}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    h = HFDir(d)
    assert h.plan.skipped == ["vision_tower.patch_embed.weight"]
    got = h.state_dict()
    assert got.keys() == sd.keys()
    assert all(torch.equal(got[k], expect[k]) for k in sd)
    e = "model.layers.1.block_sparse_moe.experts.0.w1.weight"
    assert 0 < rel_err(got[e], sd[e]) < 0.5  # really quantised


def test_a_log_padding_must_be_zero(tmp_path):
    from safetensors.torch import load_file, save_file

    cfg = get_preset("k3-tiny")
    export.export_hf(export.source_from_state_dict(perturbed_state(cfg), cfg), tmp_path / "a", progress=False)
    f = next((tmp_path / "a").glob("model-*.safetensors"))
    t = load_file(str(f))
    k = "language_model.model.layers.0.self_attn.A_log"
    assert t[k].shape == (128,) and not t[k][4:].any()
    t[k][100] = 1.0
    save_file(t, str(f))
    with pytest.raises(ValueError, match="padding"):
        HFDir(tmp_path / "a").state_dict()


def test_cli_bad_input_one_line(root, tmp_path):
    cases = [
        ("convert_to_hf.py", ["--checkpoint", tmp_path / "nope", "--output", tmp_path / "o"], "no such file"),
        ("convert_to_hf.py", ["--checkpoint", tmp_path, "--output", tmp_path / "o"], "no checkpoint"),
        ("convert_from_hf.py", ["--hf", tmp_path / "nope", "--output", tmp_path / "o"], "no such directory"),
        ("convert_from_hf.py", ["--hf", tmp_path, "--output", tmp_path / "o"], "config.json"),
    ]
    for name, args, needle in cases:
        r = tool(root, name, *args, check=False)
        assert r.returncode == 2, (name, args, r.stdout, r.stderr)
        assert needle in r.stderr and "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr


def test_import_refuses_a_layout_that_cannot_work(root, tmp_path):
    cfg = get_preset("k3-tiny")
    export.export_hf(export.source_from_state_dict(perturbed_state(cfg), cfg), tmp_path / "h", progress=False)
    r = tool(root, "convert_from_hf.py", "--hf", tmp_path / "h", "--output", tmp_path / "o", "--ep", 3, check=False)
    assert r.returncode == 2 and "EP=3" in r.stderr and not (tmp_path / "o").exists()


def test_remote_code_rewrites_every_relative_import():
    """Every relative import of the copied golden-model files (one-line and parenthesised multi-line, at
    module level and inside functions) points at a shipped ``k3_*`` file after the rewrite."""
    import re

    from megatron_k3.hf.export import ROOT, _rewrite_imports, remote_modules

    shipped = {dst[:-3] for _, dst in remote_modules()}
    text = "from .common import (Linear,\n    RMSNorm)\nfrom . import situ\n    from .common import compiled\n"
    out = _rewrite_imports(text, "model/kda.py")
    assert out == ("from .k3_common import (Linear,\n    RMSNorm)\nfrom . import k3_situ as situ\n"
                   "    from .k3_common import compiled\n"), out
    for src, _ in remote_modules():
        for m in re.finditer(r"^\s*from\s+(\.+)(\w*)\s+import\s+(.*)$", _rewrite_imports((ROOT / src).read_text(), src),
                             re.MULTILINE):
            target = m.group(2) or m.group(3).split(" as ")[0].strip()
            assert target in shipped, (src, m.group(0))


def test_export_of_a_data_path_run_ships_its_tokenizer_and_evaluates(root, tmp_path):
    """A run given only ``--data-path`` (the store made by tools/prepare_data.py carries its tokenizer): the
    checkpoint keeps a copy of the tokenizer, so even with the original file gone the HF export ships it,
    transformers loads it, and eval_hellaswag runs on the export without extra flags."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(open(os.path.join(root, "data", "README.md")).read() * 30)
    tok = tmp_path / "mytok.json"
    tool(root, "train_tokenizer.py", "--input", corpus, "--vocab-size", 300, "--output", tok)
    store = tmp_path / "store.zarr"
    r = subprocess.run([sys.executable, "-m", "megatron_k3", "prepare-data", "--input", str(corpus), "--tokenizer",
                        str(tok), "--output", str(store)], capture_output=True, text=True, timeout=600,
                       env=_env(root), cwd=root)
    assert r.returncode == 0, r.stderr[-3000:]
    ck = tmp_path / "ckpt"
    r = subprocess.run([sys.executable, "launchers/pretrain_k3.py", "--data-path", str(store), "--train-iters", "2",
                        "--micro-batch-size", "2", "--global-batch-size", "2", "--seq-length", "64", "--save", str(ck),
                        "--run-dir", str(tmp_path / "run"), "--wandb-mode", "disabled"],
                       capture_output=True, text=True, timeout=600, env=_env(root), cwd=root)
    assert r.returncode == 0, r.stderr[-3000:]
    tok.unlink()  # the original is gone: the export must use the checkpoint's own copy
    out = tmp_path / "hf"
    tool(root, "convert_to_hf.py", "--checkpoint", ck, "--output", out, "--no-progress")
    exp = json.loads((out / "k3_export.json").read_text())
    assert exp["tokenizer"]["shipped"] == {"file": "tokenizer.json", "from": "tokenizer-mytok.json"}
    assert (out / "tokenizer.json").read_bytes() == (store / "tokenizer" / "mytok.json").read_bytes()
    assert oct(os.stat(next(out.glob("*.safetensors"))).st_mode & 0o777) != "0o600"  # usual permissions
    r = tool(root, "eval_hellaswag.py", "--model", out, "--data", "data/hellaswag/sample.jsonl", "--limit", "4",
             "--json", "--no-progress")
    assert json.loads(r.stdout[r.stdout.index("{"):])["n"] == 4
