"""``python -m megatron_k3 <command> [flags]``: every user-facing command of the project in one place.

``python -m megatron_k3 --help`` lists them; ``python -m megatron_k3 <command> --help`` shows a command's
flags. The scripts under ``tools/`` and ``launchers/`` that users name call the same functions.
"""
from __future__ import annotations

import importlib
import inspect
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# command -> (module in the package, or a path under the repository, function, one-line summary)
COMMANDS = {
    "train": ("megatron_k3.train.pretrain", "main", "pretrain a K3 model (megatron-core; torchrun/srun/mpiexec for several ranks)"),
    "simulate": ("megatron_k3.plan.simulate", "main", "build chosen ranks of a planned layout on the meta device; compare with the plan"),
    "plan": ("megatron_k3.commands.plan", "main", "pick or check a parallel layout and print the per-GPU memory it needs"),
    "verify-parallel": ("megatron_k3.parallel.verify", "main", "check a parallel layout against the golden model (loss, grads, weights)"),
    "prepare-data": ("megatron_k3.data.prepare", "main", "tokenize text/jsonl/parquet into a zarr token store"),
    "train-tokenizer": ("megatron_k3.commands.train_tokenizer", "main", "train a byte-level BPE tokenizer offline"),
    "convert-to-hf": ("megatron_k3.commands.convert_to_hf", "main", "export a checkpoint to a Hugging Face directory"),
    "convert-from-hf": ("megatron_k3.commands.convert_from_hf", "main", "import a Hugging Face directory into a checkpoint"),
    "eval-hellaswag": ("megatron_k3.commands.eval_hellaswag", "main", "HellaSwag accuracy of an exported model or a checkpoint"),
    "model-info": ("megatron_k3.commands.model_info", "main", "parameter counts of a preset or config"),
    "probe-moe": ("megatron_k3.eval.probe", "main", "expert load and specialisation of trained weights"),
    "plot-run": ("megatron_k3.commands.plot_run", "main", "loss and routing plots of a run directory"),
    "supervise": ("megatron_k3.commands.supervise", "main", "restart a training command from its latest checkpoint until it finishes"),
    "benchmark": ("benchmarks/benchmark.py", "main", "training throughput through Trainer.train_step, with same-run baselines"),
}


def _load(target: str):
    if target.endswith(".py"):
        path = os.path.join(ROOT, target)
        name = "_k3_cmd_" + os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        return mod
    return importlib.import_module(target)


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: python -m megatron_k3 <command> [flags]   (python -m megatron_k3 <command> --help)", "",
             "commands:"]
    lines += [f"  {name:{width}s}  {summary}" for name, (_, _, summary) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"error: unknown command '{cmd}'; commands are: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    target, fn, _ = COMMANDS[cmd]
    sys.argv = [f"megatron_k3 {cmd}"] + rest
    func = getattr(_load(target), fn)
    takes_argv = bool(inspect.signature(inspect.unwrap(func)).parameters)  # else it reads sys.argv itself
    return func(rest) if takes_argv else func()


if __name__ == "__main__":
    sys.exit(main())
