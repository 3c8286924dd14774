"""K3 pretraining on megatron-core: ``python -m megatron_k3 train`` / ``launchers/pretrain_k3.py``.

One process per GPU (or CPU rank) launched by torchrun/srun/mpiexec; run alone it is a world of one. Flags
use megatron's names; ``--config FILE`` (YAML/TOML/JSON) holds any of the sections listed below (flags
given on the command line win). Everything is validated before the first forward pass; the run is
``megatron_k3.train.Trainer`` (setup, ``train_step``, the loop).

The loop, per step: take this DP rank's micro-batches from the TokenLoader, run megatron's schedule
(1F1B / interleaved / no pipelining) with gradient accumulation over the micro-batches, finalize gradients
(DP/TP reductions, the MoE bias sign update from the counts of *all* micro-batches and DP ranks, then
re-centred to zero mean), clip, step the optimizer, step the LR schedule (warmup given as a fraction of the
steps), log loss / lr / grad norm / tokens/s / step time and per-MoE-layer routing statistics to the console,
the run's ``metrics.jsonl`` and wandb (offline by default).
"""
from __future__ import annotations

from .cli import friendly_errors
from .train.config import build_parser as _config_parser
from .train.config import from_namespace
from .train.trainer import EXIT_SAVED_ON_SIGNAL, Trainer, default_data, ensure_default_store  # noqa: F401


def build_parser(prog: str = "pretrain_k3"):
    return _config_parser(prog, __doc__)


def parse(argv=None):
    return from_namespace(build_parser().parse_args(argv))


@friendly_errors
def main(argv=None):
    job = parse(argv)
    trainer = Trainer(job)
    try:
        trainer.setup()
        trainer.fit()
    finally:
        trainer.close()


if __name__ == "__main__":
    main()
