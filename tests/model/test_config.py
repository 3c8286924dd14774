"""Presets, validation with clear messages, and parameter accounting (tools/model_info.py)."""
import json
import os
import subprocess
import sys

import pytest

from megatron_k3 import ConfigError, K3Config, get_preset, load_config
from megatron_k3.config import PRESETS, k3_kda_layers
from megatron_k3.plan.model_info import model_info


def test_all_presets_validate():
    for name in PRESETS:
        cfg = get_preset(name)
        assert cfg.name == name


def test_k3_layer_rule():
    full = get_preset("k3-full")
    assert len(full.kda_layers) == 69 and len(full.full_attn_layers) == 24
    assert full.full_attn_layers == list(range(4, 93, 4)) + [93]
    assert full.layer_kinds[-2:] == ["mla", "mla"]
    mini = get_preset("k3-mini")
    assert mini.kda_layers == k3_kda_layers(24)
    assert mini.full_attn_layers == [4, 8, 12, 16, 20, 23, 24]


@pytest.mark.parametrize("over,needle", [
    ({"num_experts_per_token": 9}, "num_experts_per_token"),
    ({"attn_res_block_size": 0}, "attn_res_block_size"),
    ({"gate_lower_bound": -6.0}, "gate_lower_bound"),
    ({"kda_layers": [0, 1]}, "kda_layers"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"kda_num_heads": 2.5}, "kda_num_heads"),
    ({"pad_token_id": 10_000}, "pad_token_id"),
    ({"first_k_dense_replace": 99}, "first_k_dense_replace"),
    ({"mla_use_nope": False}, "mla_use_nope"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
])
def test_invalid_config_clear_error(over, needle):
    with pytest.raises(ConfigError) as e:
        get_preset("k3-tiny", **over)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg


def test_unknown_preset_and_field():
    with pytest.raises(ConfigError, match="unknown preset 'k3-huge'"):
        get_preset("k3-huge")
    with pytest.raises(ConfigError, match="unknown config field"):
        K3Config.from_dict({"hidden": 3})


def test_load_config_files(tmp_path):
    y = tmp_path / "m.yaml"
    y.write_text("preset: k3-tiny\nhidden_size: 96\n")
    cfg = load_config(y)
    assert cfg.hidden_size == 96 and cfg.num_hidden_layers == 8
    t = tmp_path / "m.toml"
    t.write_text('[model]\npreset = "k3-tiny"\nnum_experts = 4\nnum_experts_per_token = 2\n')
    assert load_config(t).num_experts == 4
    j = tmp_path / "m.json"
    j.write_text(json.dumps(get_preset("k3-tiny").to_dict()))
    assert load_config(j).hidden_size == 64
    bad = tmp_path / "bad.yaml"
    bad.write_text("preset: k3-tiny\nnum_experts_per_token: 99\n")
    with pytest.raises(ConfigError, match="num_experts_per_token"):
        load_config(bad)


def test_k3_full_counts():
    info = model_info(get_preset("k3-full"))
    assert abs(info["total_params"] / 2.78e12 - 1) < 0.01, info["total_params"]
    assert abs(info["active_params"] / 104e9 - 1) < 0.01, info["active_params"]
    assert abs(info["routed_expert_active_params"] / 48.6e9 - 1) < 0.01
    assert info["layers"]["kda"] == 69 and info["layers"]["moe"] == 92


def test_k3_mini_count_is_the_documented_one(root):
    info = model_info(get_preset("k3-mini"))
    assert info["total_params"] == 1_256_654_984
    readme = open(os.path.join(root, "README.md")).read()
    assert "1,256,654,984" in readme


def test_k3_tiny_accounting_adds_up():
    from megatron_k3.model import K3ForCausalLM

    cfg = get_preset("k3-tiny")
    info = model_info(cfg)
    real = sum(p.numel() for p in K3ForCausalLM(cfg, seed=0).parameters())
    assert info["total_params"] == real == sum(info["components"].values())
    per_expert = 3 * cfg.expert_width * cfg.moe_intermediate_size
    assert info["routed_expert_active_params"] == 7 * cfg.num_experts_per_token * per_expert
    assert info["active_params"] == (real - info["components"]["embed_tokens"]
                                     - info["routed_expert_params_total"] + info["routed_expert_active_params"])


def _run(root, *args):
    return subprocess.run([sys.executable, os.path.join(root, "tools", "model_info.py"), *args],
                          capture_output=True, text=True, timeout=120)


def test_cli_json_and_bad_input(root, tmp_path):
    r = _run(root, "--preset", "k3-tiny", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["preset"] == "k3-tiny"
    r = _run(root, "--preset", "nope")
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "unknown preset 'nope'" in r.stderr and "Traceback" not in r.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("preset: k3-tiny\nattn_res_block_size: -1\n")
    r = _run(root, "--config", str(bad))
    assert r.returncode == 2 and "attn_res_block_size" in r.stderr and r.stderr.strip().count("\n") == 0
    r = _run(root, "--config", str(tmp_path / "missing.yaml"))
    assert r.returncode == 2 and "not found" in r.stderr
