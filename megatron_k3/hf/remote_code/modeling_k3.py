"""Kimi K3 for transformers (remote code written by megatron-k3's ``tools/convert_to_hf.py``).

The math is megatron-k3's plain-PyTorch golden model, copied beside this file unchanged (``k3_golden.py``,
``k3_kda.py``, ``k3_mla.py``, ``k3_moe.py``, ``k3_attn_res.py``, ``k3_situ.py``, ``k3_mtp.py``,
``k3_common.py``; only their relative imports were renamed): the same code the trainer is tested against.
On CUDA with flash-linear-attention installed, KDA runs fla's ``chunk_kda``; otherwise the exact pure-PyTorch
chunked form (CPU works).

Parameter names are the release's: ``language_model.model.layers.{i}...``, ``language_model.lm_head.weight``;
KDA ``A_log`` is held zero-padded to the release's length (the math reads its first ``num_heads`` entries).

Limits: no KV / recurrent-state cache (every forward recomputes the whole prefix; ``generate`` works with
``use_cache=False``, slowly); padding must be on the right (causal: right padding does not change earlier
positions), a left-padded ``attention_mask`` is refused.
"""
import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_k3 import KimiK3Config
from .k3_golden import K3ForCausalLM
from .k3_hf_config import a_log_padded_len, config_from_hf_dict
from .k3_kda import KimiDeltaAttention


def _text_dict(config):
    tc = config.text_config
    return tc.to_dict() if hasattr(tc, "to_dict") else dict(tc)


class KimiK3PreTrainedModel(PreTrainedModel):
    config_class = KimiK3Config
    base_model_prefix = "language_model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["K3DecoderLayer"]
    _keep_in_fp32_modules_strict = ["A_log", "dt_bias", "q_conv1d", "k_conv1d", "v_conv1d", "o_norm"]
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module):
        fn = getattr(module, "reset_parameters", None)
        if fn is not None and not any(p.is_meta for p in module.parameters(recurse=False)):
            fn(None)


class KimiK3ForConditionalGeneration(KimiK3PreTrainedModel, GenerationMixin):
    """The K3 language model under the release's names (``language_model.*``)."""

    def __init__(self, config: KimiK3Config):
        super().__init__(config)
        self.k3_config = config_from_hf_dict(_text_dict(config), name="hf")
        self.language_model = K3ForCausalLM(self.k3_config, init=False)
        pad = a_log_padded_len(self.k3_config.kda_num_heads)
        for m in self.language_model.modules():
            if isinstance(m, KimiDeltaAttention) and m.A_log.shape[0] != pad:
                m.A_log = nn.Parameter(torch.zeros(pad, dtype=torch.float32, device=m.A_log.device))
        self.post_init()

    def get_input_embeddings(self):
        return self.language_model.model.embed_tokens

    def get_output_embeddings(self):
        return self.language_model.lm_head

    def forward(self, input_ids=None, attention_mask=None, labels=None, inputs_embeds=None, past_key_values=None,
                use_cache=None, logits_to_keep=0, return_dict=None, **kwargs):
        if input_ids is None:
            raise ValueError("KimiK3ForConditionalGeneration needs input_ids (inputs_embeds is not supported)")
        if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[1] > 0:
            am = attention_mask.bool()
            if bool((am[:, 1:] & ~am[:, :-1]).any()):
                raise ValueError("left padding is not supported (K3 has no position-independent padding mask); "
                                 "pad on the right")
        lm = self.language_model
        h = lm.model.trunk(input_ids)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = lm.lm_head(lm.model.norm(h))
        loss = None
        if labels is not None:
            shift = logits[:, :-1].float().reshape(-1, logits.shape[-1])
            loss = F.cross_entropy(shift, labels[:, 1:].reshape(-1).to(shift.device), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        return {"input_ids": input_ids, "attention_mask": attention_mask}


__all__ = ["KimiK3ForConditionalGeneration", "KimiK3PreTrainedModel"]
