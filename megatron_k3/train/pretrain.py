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

from ..cli import UsageError, friendly_errors
from .config import build_parser as _config_parser
from .config import from_namespace
from .trainer import EXIT_SAVED_ON_SIGNAL, Trainer, default_data, ensure_default_store  # noqa: F401


def build_parser(prog: str = "pretrain_k3"):
    ap = _config_parser(prog, __doc__)
    g = ap.add_argument_group("actions")
    g.add_argument("--validate-only", action="store_true",
                   help="check the configuration, the layout for the world size, the data and the checkpoint "
                        "directories, print the resolved configuration and exit (0 if valid); nothing is built")
    g.add_argument("--world-size", type=int, default=None,
                   help="with --validate-only: the world size to check the layout for (default: this launch's)")
    return ap


def parse(argv=None):
    return from_namespace(build_parser().parse_args(argv))


@friendly_errors
def main(argv=None):
    import os

    ns = build_parser().parse_args(argv)
    job = from_namespace(ns)
    if ns.validate_only:
        if ns.world_size is not None:
            if ns.world_size < 1:
                raise UsageError(f"--world-size must be >= 1 (got {ns.world_size})")
            os.environ["WORLD_SIZE"] = str(ns.world_size)
            os.environ.setdefault("RANK", "0")
        trainer = Trainer(job)
        trainer.prepare_data()
        from .config import describe

        print(f"[pretrain] configuration valid for {trainer.world} rank(s), layout {trainer.layout.describe()}:\n"
              + describe(job), flush=True)
        return
    trainer = Trainer(job)
    try:
        trainer.setup()
        trainer.fit()
    finally:
        trainer.close()


if __name__ == "__main__":
    main()
