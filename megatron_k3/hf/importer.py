"""HF import: a HF model directory -> golden (HF-named) tensors -> a checkpoint the trainer loads.

Reads either layout the exporter writes (K3 wrapper with ``language_model.*`` names, or flat Kimi Linear),
plus what ``names.ImportPlan`` accepts (MXFP4-packed experts, transformers' in-memory Kimi Linear names,
other modalities skipped). Tensors are read lazily per safetensors file (``safe_open``), so the import
reads each source tensor once and holds only what the checkpoint writer needs.

The checkpoint is written by ``checkpoints_io.k3ckpt.write_weights``: every tensor under its HF name as a
global tensor, weights only, so the trainer's ``--load`` reads it at *any* TP/PP/EP/CP/DP layout (the
optimizer, data position and RNG start fresh). ``--tp/--pp/--ep`` name the layout the checkpoint is meant
for; it is validated against the model before anything is written (``ParallelLayout.validate``). The
tokenizer file found in the HF directory is copied into ``OUT/tokenizer/`` and recorded (identity + path)
in the checkpoint metadata.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from ..config import ConfigError, K3Config
from ..parallel import adapter
from . import config_map


class HFDir:
    """An HF model directory: its config (as a K3Config), tensor names and a lazy reader."""

    def __init__(self, path):
        self.path = Path(path)
        cj = self.path / "config.json"
        if not cj.is_file():
            raise FileNotFoundError(f"{cj} (not a HF model directory)")
        self.config_json = json.loads(cj.read_text())
        self.cfg: K3Config = config_map.config_from_hf_dict(self.config_json, name=self.path.name)
        idx = self.path / "model.safetensors.index.json"
        if idx.is_file():
            wm = json.loads(idx.read_text())["weight_map"]
            self.files = {k: self.path / f for k, f in wm.items()}
        else:
            single = self.path / "model.safetensors"
            if not single.is_file():
                raise FileNotFoundError(f"no model.safetensors(.index.json) in {self.path}")
            from safetensors import safe_open

            with safe_open(str(single), "pt") as f:
                self.files = {k: single for k in f.keys()}
        self.plan = adapter.release_import_plan(self.files, self.cfg)

    def tokenizer_file(self) -> Path | None:
        for cand in ("tokenizer.json", "tiktoken.model"):
            if (self.path / cand).is_file():
                return self.path / cand
        return None

    def check(self) -> list[str]:
        """Golden names in model order; raises ConfigError if the directory does not match its config."""
        from .export import golden_order

        order = golden_order(self.cfg)
        missing = [n for n in order if n not in self.plan.plan]
        extra = sorted(set(self.plan.plan) - set(order))
        if missing or extra:
            raise ConfigError(f"{self.path}: tensors do not match config.json: {len(missing)} missing (e.g. "
                              f"{missing[:1]}), {len(extra)} unexpected (e.g. {extra[:1]})")
        return order

    def tensors(self, dtype: torch.dtype | None = torch.float32, progress: bool = False):
        """Iterate ``(golden_name, tensor)`` in model order; floating tensors cast to ``dtype`` (None: as stored)."""
        from safetensors import safe_open
        from tqdm import tqdm

        order = self.check()
        handles = {}
        try:
            for name in tqdm(order, desc="import", unit="tensor", disable=not progress):
                keys, fn = self.plan.plan[name]
                d = {}
                for k in keys:
                    f = self.files[k]
                    if f not in handles:
                        handles[f] = safe_open(str(f), "pt").__enter__()
                    d[k] = handles[f].get_tensor(k)
                t = fn(d)
                if dtype is not None and t.is_floating_point():
                    t = t.to(dtype)
                yield name, t.contiguous()
        finally:
            for h in handles.values():
                h.__exit__(None, None, None)

    def state_dict(self, dtype=torch.float32) -> dict:
        return dict(self.tensors(dtype))


def convert_from_hf(hf_dir, out_dir, tp: int = 1, pp: int = 1, ep: int = 1, step: int = 0,
                    progress: bool = True, writer: str = "odirect") -> dict:
    """HF directory -> weights-only trainer checkpoint in ``out_dir``; returns a summary."""
    from checkpoints_io import k3ckpt

    from ..data.tokenizer import load_tokenizer
    from ..parallel.layout import ParallelLayout

    src = HFDir(hf_dir)
    cfg = src.cfg
    ParallelLayout(tp=tp, pp=pp, ep=ep, dp=max(1, ep // tp)).validate(cfg)
    out = Path(out_dir)
    tok_id = None
    tf = src.tokenizer_file()
    if tf is not None:
        (out / "tokenizer").mkdir(parents=True, exist_ok=True)
        dst = out / "tokenizer" / tf.name
        shutil.copyfile(tf, dst)
        cj = tf.with_name("tokenizer_config.json")
        if tf.name == "tiktoken.model" and cj.is_file():
            shutil.copyfile(cj, out / "tokenizer" / cj.name)
        tok = load_tokenizer(dst)
        if tok.vocab_size > cfg.vocab_size:
            raise ConfigError(f"{tf}: tokenizer has {tok.vocab_size} ids, more than the model's vocabulary "
                              f"({cfg.vocab_size})")
        tok_id = {**tok.identity(), "path": str(dst.resolve())}
    path = k3ckpt.write_weights(out, src.tensors(torch.float32, progress=progress), cfg, step=step,
                                tokenizer=tok_id, writer=writer)
    return {"checkpoint": str(path), "config": cfg.name, "tensors": len(src.plan.plan),
            "skipped": len(src.plan.skipped), "layout": f"TP{tp} PP{pp} EP{ep}", "tokenizer": tok_id}
