#!/usr/bin/env python3
"""K3 pretraining entry point (same as ``python -m megatron_k3.train.pretrain``); see ``--help``.

    python launchers/pretrain_k3.py                                   # k3-tiny on the embedded corpus, 1 process
    torchrun --nproc-per-node 2 launchers/pretrain_k3.py --tensor-model-parallel-size 2 --sequence-parallel
"""

from megatron_k3.train.pretrain import main  # noqa: E402

if __name__ == "__main__":
    main()
