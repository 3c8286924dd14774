"""Run by tests/train/test_bad_inputs.py: every case of a JSON list through ``python -m megatron_k3 <command>``'s
dispatcher, in this one process (the commands' ``main`` functions, as the console runs them), one after the
other. For each case: the exit code, everything written to stderr, whether an exception escaped (a
traceback), and whether any file under the fixture directory changed (sha256 of every file before and
after). Prints one JSON line per case. The environment is restored after every case (the trainer's
launcher discovery sets RANK, WORLD_SIZE, ...)."""
import contextlib
import hashlib
import io
import json
import os
import sys
import traceback


def tree_hashes(root):
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            try:
                with open(p, "rb") as fh:
                    out[os.path.relpath(p, root)] = hashlib.sha256(fh.read()).hexdigest()
            except OSError:
                out[os.path.relpath(p, root)] = "unreadable"
    return out


def run_case(case, fixture):
    from megatron_k3.__main__ import main as dispatch

    env = dict(os.environ)
    os.environ.update(case.get("env", {}))
    before = tree_hashes(fixture)
    err, out = io.StringIO(), io.StringIO()
    rc, tb = None, None
    old_argv = sys.argv
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                r = dispatch([case["command"], *case["argv"]])
                rc = r if isinstance(r, int) else 0
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if not isinstance(e.code, int) and e.code is not None:
                    err.write(str(e.code) + "\n")
            except BaseException:  # noqa: BLE001
                tb = traceback.format_exc()
                rc = 1
    finally:
        sys.argv = old_argv
        os.environ.clear()
        os.environ.update(env)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():  # a case that failed mid-run must not leak its group
            dist.destroy_process_group()
    after = tree_hashes(fixture)
    changed = sorted(k for k in before if after.get(k) != before[k])
    return {"id": case["id"], "rc": rc, "stderr": err.getvalue(), "traceback": tb, "changed": changed,
            "created": sorted(set(after) - set(before))}


def main():
    cases = json.load(open(sys.argv[1]))
    fixture = sys.argv[2]
    import warnings

    warnings.simplefilter("ignore")  # library warnings are not the commands' output
    for c in cases:
        res = run_case(c, fixture)
        print("CASE " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
