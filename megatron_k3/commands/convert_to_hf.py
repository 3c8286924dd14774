"""Export a K3 checkpoint (saved at any TP/PP/EP layout) to a HF model directory.

    python tools/convert_to_hf.py --checkpoint SAVE_DIR [--step N] --output HF_DIR [--dtype fp32|bf16]
                                  [--layout k3|kimi_linear] [--tokenizer FILE] [--dry-run]

``--layout k3`` (default) writes the K3 release layout: wrapper ``config.json`` (``model_type: kimi_k3``,
``text_config`` of type ``kimi_linear`` with the K3 fields), ``language_model.*`` tensors in safetensors
shards with an index, tokenizer files, ``generation_config.json`` and the remote code, so
``AutoModelForCausalLM.from_pretrained(HF_DIR, trust_remote_code=True)`` loads it. ``--layout kimi_linear``
writes a Kimi-Linear-48B-style directory for transformers' native ``kimi_linear`` classes (only for configs
Kimi Linear can express: SiLU, unbounded gate, low-rank output gate, no AttnRes / latent MoE / MLA gate).
``--checkpoint`` may also be a HF-named ``.pt`` file (the trainer's ``--export-weights``) with ``--config``
or ``--preset``. Tensors are streamed shard by shard (``--shard-size``); ``--dry-run`` lists the names,
shapes and dtypes and reads no tensor data. Details: ``megatron_k3/hf/export.py``.
"""
import argparse
import json
import os
import re
import sys


from megatron_k3.cli import ArgumentParser, UsageError, friendly_errors


def parse_size(s: str) -> int:
    """'2G', '500M', '64KiB', '1048576' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?)(?:i?b)?\s*", s.lower())
    if not m:
        raise UsageError(f"--shard-size {s!r}: expected a size like 2G, 500M or a byte count")
    return int(float(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2)])


@friendly_errors
def main(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="save dir (latest), iter_XXXXXXX dir, or HF-named .pt file")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--output", help="HF model directory to write (required unless --dry-run)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="floating dtype of the exported tensors (KDA gate/conv/o_norm and the router bias stay fp32)")
    p.add_argument("--layout", choices=["k3", "kimi_linear"], default="k3")
    p.add_argument("--tokenizer", default=None, help="tokenizer file to ship (default: the one the checkpoint records)")
    p.add_argument("--shard-size", default="2G", help="max bytes per safetensors shard (default 2G)")
    p.add_argument("--config", default=None, help="model config file (only for a .pt --checkpoint)")
    p.add_argument("--preset", default=None, help="model preset (only for a .pt --checkpoint)")
    p.add_argument("--dry-run", action="store_true", help="list tensor names, shapes and dtypes; write nothing")
    p.add_argument("--overwrite", action="store_true", help="allow a non-empty --output")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    a = p.parse_args(argv)

    from megatron_k3.hf import export

    if not os.path.exists(a.checkpoint):
        raise FileNotFoundError(f"--checkpoint {a.checkpoint}: no such file or directory")
    if os.path.isfile(a.checkpoint):
        from megatron_k3.config import get_preset, load_config

        if not (a.config or a.preset):
            raise UsageError("a .pt --checkpoint needs --config FILE or --preset NAME")
        cfg = load_config(a.config) if a.config else get_preset(a.preset)
        src = export.source_from_pt(a.checkpoint, cfg)
    else:
        if a.config or a.preset:
            raise UsageError("--config/--preset are only for a .pt --checkpoint (a checkpoint records its config)")
        src = export.source_from_checkpoint(a.checkpoint, a.step)
    if a.dry_run:
        rows = export.dry_run(src, a.layout, a.dtype)
        if a.json:
            print(json.dumps([{"name": n, "shape": list(s), "dtype": d} for n, s, d in rows], indent=1))
        else:
            for n, s, d in rows:
                print(f"{n}\t{list(s)}\t{d}")
            total = sum(export.Entry(n, n, s, export.DTYPES[a.dtype]).nbytes for n, s, _ in rows)
            print(f"# {len(rows)} tensors, about {total / 1e6:.1f} MB at {a.dtype} "
                  f"(config {src.cfg.name}, step {src.step}, layout {a.layout})")
        return 0
    if not a.output:
        raise UsageError("--output is required (or pass --dry-run)")
    s = export.export_hf(src, a.output, layout=a.layout, dtype=a.dtype, shard_bytes=parse_size(a.shard_size),
                         tokenizer=a.tokenizer, progress=not a.no_progress, overwrite=a.overwrite)
    if a.json:
        print(json.dumps(s, indent=1, default=str))
    else:
        print(f"[convert_to_hf] wrote {s['tensors']} tensors ({s['bytes'] / 1e6:.1f} MB, {s['shards']} shard(s), "
              f"{s['dtype']}, layout {s['layout']}) from step {s['step']} to {a.output}")
        if s["tokenizer"].get("shipped") is None:
            print("[convert_to_hf] warning: no tokenizer file found (pass --tokenizer FILE)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
