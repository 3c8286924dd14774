"""Import a HF model directory into a checkpoint the trainer loads (``--load OUT``).

    python tools/convert_from_hf.py --hf HF_DIR --output OUT [--tp N] [--pp N] [--ep N] [--step N]

Reads the K3 release layout (``language_model.*``, padded ``A_log``, MXFP4-packed experts
``weight_packed``/``weight_scale`` dequantised) or a Kimi Linear directory, and writes a weights-only,
layout-independent checkpoint (tensors under their HF names): the trainer loads it at any layout and
starts the optimizer fresh. ``--tp/--pp/--ep`` are the layout it is meant for, validated against the model
before anything is written. ``--dry-run`` prints the config and the tensor mapping. Details:
``megatron_k3/hf/importer.py``.
"""
import argparse
import json
import os
import sys


from megatron_k3.cli import ArgumentParser, UsageError, friendly_errors


@friendly_errors
def main(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf", required=True, help="HF model directory (config.json + safetensors)")
    p.add_argument("--output", help="checkpoint directory to write (required unless --dry-run)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--step", type=int, default=0, help="step number of the written checkpoint (default 0)")
    p.add_argument("--ckpt-writer", choices=["odirect", "buffered"], default="odirect")
    p.add_argument("--dry-run", action="store_true", help="print the config and tensor mapping; write nothing")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)

    from megatron_k3.hf.importer import HFDir, convert_from_hf

    if not os.path.isdir(a.hf):
        raise FileNotFoundError(f"--hf {a.hf}: no such directory")
    if a.dry_run:
        d = HFDir(a.hf)
        order = d.check()
        if a.json:
            print(json.dumps({"config": d.cfg.to_dict(), "tensors": {n: d.plan.plan[n][0] for n in order},
                              "skipped": d.plan.skipped}, indent=1))
        else:
            for n in order:
                print(f"{n}\t<- {', '.join(d.plan.plan[n][0])}")
            print(f"# {len(order)} tensors, {len(d.plan.skipped)} source tensors skipped; config: {d.cfg}")
        return 0
    if not a.output:
        raise UsageError("--output is required (or pass --dry-run)")
    if os.path.exists(os.path.join(a.output, "latest_checkpointed_iteration.txt")):
        raise UsageError(f"--output {a.output} already holds a checkpoint")
    s = convert_from_hf(a.hf, a.output, tp=a.tp, pp=a.pp, ep=a.ep, step=a.step, progress=not a.no_progress,
                        writer=a.ckpt_writer)
    if a.json:
        print(json.dumps(s, indent=1))
    else:
        print(f"[convert_from_hf] wrote {s['tensors']} tensors (config {s['config']}, for {s['layout']}) to "
              f"{s['checkpoint']}" + (f"; skipped {s['skipped']} non-text tensors" if s["skipped"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
