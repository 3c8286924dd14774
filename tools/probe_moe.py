#!/usr/bin/env python3
"""Expert load and cross-domain specialisation of a trained K3 (see megatron_k3/eval/probe.py):
    python tools/probe_moe.py --weights W.pt --preset k3-tiny --tokenizer data/tokenizer/k3-tiny-bpe512.json \\
        --data data/corpus/python-docs-3.11.jsonl.gz"""


from megatron_k3.eval.probe import main  # noqa: E402

if __name__ == "__main__":
    main()
