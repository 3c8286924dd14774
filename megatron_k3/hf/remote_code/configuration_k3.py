"""Kimi K3 configuration (remote code written by megatron-k3's ``tools/convert_to_hf.py``).

``config.json`` is the K3 wrapper (``model_type: kimi_k3``) with the language model under ``text_config``
(``model_type: kimi_linear`` plus the K3 fields: ``linear_attn_config.gate_lower_bound`` /
``use_full_rank_gate``, ``mla_use_output_gate``, ``routed_expert_hidden_size``, ``latent_moe_use_norm``,
``hidden_act: situ`` with its betas, ``attn_res_block_size``, ...). ``k3_hf_config.config_from_hf_dict``
turns the text config into the ``K3Config`` the model code takes.
"""
from transformers import PretrainedConfig


class KimiK3TextConfig(PretrainedConfig):
    """The language model's config: every key of ``text_config`` kept as an attribute."""

    model_type = "kimi_linear"

    def __init__(self, **kwargs):
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)


class KimiK3Config(PretrainedConfig):
    model_type = "kimi_k3"
    sub_configs = {"text_config": KimiK3TextConfig}

    def __init__(self, text_config=None, **kwargs):
        if text_config is None:
            text_config = {}
        if isinstance(text_config, dict):
            text_config = KimiK3TextConfig(**text_config)
        self.text_config = text_config
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)

    def get_text_config(self, *args, **kwargs):
        return self.text_config
