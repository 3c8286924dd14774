"""HellaSwag (0-shot, lm-eval's task definition: acc and acc_norm) on a HF directory or a trainer checkpoint.

    python tools/eval_hellaswag.py --model HF_DIR --data data/hellaswag/sample.jsonl [--limit N] [--batch-size B]
                                   [--json]
    python tools/eval_hellaswag.py --checkpoint SAVE_DIR [--step N] --data val.parquet

``--model`` loads through transformers (``trust_remote_code=True``; tokenised exactly as lm-eval's ``hf``
model does); ``--checkpoint`` runs the golden model on the checkpoint's weights (any save layout) with the
tokenizer the checkpoint records (or ``--tokenizer``). The data is a local ``.jsonl`` or ``.parquet``
file in the official schema (``data/hellaswag/README.md``). Prints acc / acc_norm with lm-eval's stderr and
a bootstrap stderr; ``--json`` prints the result object (``--per-doc`` adds per-document log-likelihoods).
Details: ``megatron_k3/eval/hellaswag.py``.
"""
import argparse
import json
import os
import sys


from megatron_k3.cli import ArgumentParser, UsageError, friendly_errors


@friendly_errors
def main(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="HF model directory")
    src.add_argument("--checkpoint", help="trainer checkpoint (save dir or iter_XXXXXXX dir)")
    p.add_argument("--step", type=int, default=None, help="with --checkpoint: step (default latest)")
    p.add_argument("--tokenizer", default=None, help="with --checkpoint: tokenizer file (default: the recorded one)")
    p.add_argument("--data", required=True, help="HellaSwag rows (.jsonl or .parquet)")
    p.add_argument("--limit", type=int, default=None, help="first N documents only")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-length", type=int, default=None, help="context window (default: the model's)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--bootstrap-iters", type=int, default=1000)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--per-doc", action="store_true", help="with --json: include per-document results")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    if a.batch_size < 1:
        raise UsageError("--batch-size must be >= 1")
    if a.limit is not None and a.limit < 1:
        raise UsageError("--limit must be >= 1")
    if a.model and (a.step is not None or a.tokenizer):
        raise UsageError("--step/--tokenizer go with --checkpoint (a HF directory has its own tokenizer)")

    from megatron_k3.eval import hellaswag as hs

    hs.load_docs(a.data, a.limit)  # bad data fails before a model is loaded
    if a.model:
        if not os.path.isdir(a.model):
            raise FileNotFoundError(f"--model {a.model}: no such directory")
        scorer = hs.hf_scorer(a.model, dtype=a.dtype, device=a.device, max_length=a.max_length)
    else:
        if not os.path.exists(a.checkpoint):
            raise FileNotFoundError(f"--checkpoint {a.checkpoint}: no such directory")
        scorer = hs.checkpoint_scorer(a.checkpoint, a.step, a.tokenizer, device=a.device, dtype=a.dtype,
                                      max_length=a.max_length)
    res, per_doc = hs.evaluate(scorer, a.data, a.limit, a.batch_size, progress=not a.no_progress,
                               bootstrap_iters=a.bootstrap_iters)
    if a.json:
        if a.per_doc:
            res["per_doc"] = per_doc
        print(json.dumps(res, indent=1))
    else:
        bs = a.bootstrap_iters > 0
        print(f"hellaswag, {res['n']} documents, 0-shot ({res['model']})")
        for m in ("acc", "acc_norm"):
            extra = f"  (bootstrap {res[m + '_stderr_bootstrap']:.4f})" if bs else ""
            print(f"  {m:<9} {res[m]:.4f} +- {res[m + '_stderr']:.4f}{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
