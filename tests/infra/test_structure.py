"""The codebase's shape: no import cycle, no ``sys.path`` manipulation in product code, no ``K3_*`` switches read
by the model or the trainer, every command reachable from ``python -m megatron_k3``, and a megatron-core
outside the tested versions refused with one line."""
import ast
import os
import subprocess
import sys

PACKAGES = ("megatron_k3", "checkpoints_io")
PRODUCT = ("megatron_k3", "checkpoints_io", "launchers", "tools", "benchmarks")


def _modules(root):
    mods = {}
    for top in PACKAGES:
        for d, _, fs in os.walk(os.path.join(root, top)):
            for f in fs:
                if f.endswith(".py"):
                    p = os.path.join(d, f)
                    m = os.path.relpath(p, root)[:-3].replace(os.sep, ".")
                    mods[m.removesuffix(".__init__")] = p
    return mods


def import_graph(root):
    """module -> project modules it imports anywhere in its body (function-local imports included)."""
    mods = _modules(root)
    graph = {}
    for m, p in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(open(p).read(), p)):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = m.split(".")
                    if not p.endswith("__init__.py"):
                        parts = parts[:-1]
                    parts = parts[:len(parts) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            for n in names:
                while n and n not in mods:
                    n = n.rpartition(".")[0]
                if n and n != m:
                    deps.add(n)
        graph[m] = deps
    return graph


def cycles(graph):
    """Strongly connected components of more than one module (Tarjan)."""
    idx, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        idx[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in idx:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], idx[w])
        if low[v] == idx[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in graph:
        if v not in idx:
            visit(v)
    return out


def test_no_import_cycle(root):
    found = cycles(import_graph(root))
    assert not found, "import cycles (module -> module, local imports counted):\n" + "\n".join(map(str, found))


# The package's top level: entry points and the few settings every subpackage reads; everything else lives in
# a subpackage named for what it does (docs/development.md has the map).
TOP_LEVEL = {"__init__.py", "__main__.py", "cli.py", "compat.py", "config.py", "cudnn.py", "perf.py"}
SUBPACKAGES = {"commands", "data", "eval", "hf", "model", "optim", "parallel", "patches", "plan", "train"}


def test_package_layout(root):
    pkg = os.path.join(root, "megatron_k3")
    files = {f for f in os.listdir(pkg) if f.endswith(".py")}
    dirs = {d for d in os.listdir(pkg) if os.path.isdir(os.path.join(pkg, d)) and d != "__pycache__"}
    assert files == TOP_LEVEL, f"modules at megatron_k3/'s top level: {sorted(files - TOP_LEVEL)} unexpected, " \
                               f"{sorted(TOP_LEVEL - files)} missing"
    assert dirs == SUBPACKAGES, sorted(dirs ^ SUBPACKAGES)
    no_init = [d for d in dirs if not os.path.isfile(os.path.join(pkg, d, "__init__.py"))]
    assert not no_init, f"subpackages without __init__.py: {no_init}"


def test_patches_one_file_each(root):
    """Every megatron-core patch in its own file under megatron_k3/patches/, each saying which megatron-core
    versions it was written against; the package's table lists every file."""
    pdir = os.path.join(root, "megatron_k3", "patches")
    init = open(os.path.join(pdir, "__init__.py")).read()
    files = sorted(f for f in os.listdir(pdir) if f.endswith(".py") and f != "__init__.py")
    assert len(files) >= 6
    for f in files:
        doc = ast.get_docstring(ast.parse(open(os.path.join(pdir, f)).read())) or ""
        assert doc.startswith("Patch ") and "megatron-core 0.19.2" in doc, f
        assert f.removesuffix(".py") in init, f"{f} missing from patches/__init__.py's table"


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_sys_path_manipulation_in_product_code(root):
    bad = []
    for top in PRODUCT:
        for d, _, fs in os.walk(os.path.join(root, top)):
            for f in fs:
                if f.endswith(".py"):
                    p = os.path.join(d, f)
                    for node in ast.walk(ast.parse(open(p).read(), p)):
                        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                                and ast.unparse(node.func.value) == "sys.path"):
                            bad.append(f"{os.path.relpath(p, root)}:{node.lineno}")
    assert not bad, "sys.path changed in: " + ", ".join(bad)


def test_no_k3_environment_switches_in_the_package(root):
    """Kernel and fast-path choices are typed settings (megatron_k3/perf.py), not environment variables. (The
    parallel check's fault injection, K3_VERIFY_FAULT, is a test hook of tools/verify_parallel.py's self-test.)"""
    bad = []
    for d, _, fs in os.walk(os.path.join(root, "megatron_k3")):
        for f in fs:
            if f.endswith(".py") and f != "verify.py":
                p = os.path.join(d, f)
                for node in ast.walk(ast.parse(open(p).read(), p)):
                    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("K3_") \
                            and node.value.isupper():
                        parent_src = open(p).read().splitlines()[node.lineno - 1]
                        if "environ" in parent_src or "getenv" in parent_src:
                            bad.append(f"{os.path.relpath(p, root)}:{node.lineno}: {node.value}")
    assert not bad, bad


HELP = r"""
import contextlib, io, sys
from megatron_k3.__main__ import COMMANDS, main, usage
out = io.StringIO()
with contextlib.redirect_stdout(out):
    main(["--help"])
assert all(c in out.getvalue() for c in COMMANDS), out.getvalue()
for c in COMMANDS:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
        try:
            main([c, "--help"])
        except SystemExit as e:
            assert e.code in (0, None), (c, e.code)
    assert "usage" in buf.getvalue().lower() or "--" in buf.getvalue(), (c, buf.getvalue()[:300])
print("OK", len(COMMANDS))
"""


def test_every_command_has_help(root):
    r = subprocess.run([sys.executable, "-c", HELP], capture_output=True, text=True, timeout=600, cwd=root,
                       env=dict(os.environ, PYTHONPATH=root))
    assert r.returncode == 0 and r.stdout.strip().startswith("OK"), r.stdout[-2000:] + r.stderr[-3000:]


def test_untested_megatron_core_is_one_error_line(root, tmp_path):
    """A megatron-core whose version the patches were not tested with (a distribution record of 0.20.0 ahead
    of the installed one on the path) is refused before anything runs."""
    dist = tmp_path / "megatron_core-0.20.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: megatron-core\nVersion: 0.20.0\n")
    r = subprocess.run([sys.executable, "-m", "megatron_k3", "train", "--train-iters", "1"], capture_output=True,
                       text=True, timeout=300, cwd=root,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), root])))
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and lines == [lines[-1]] and lines[-1].startswith("error: megatron-core 0.20.0"), r.stderr


# the Python commands under tools/ before the package layout of 2026-12-05 (#29): each still answers --help
OLD_TOOLS = ("bench_checkpoint", "bench_fp8", "bench_host", "bench_memory", "bench_ops", "bench_scaling", "benchmark",
             "build_embedded_corpus", "convert_from_hf", "convert_to_hf", "eval_hellaswag", "gpu_check", "model_info",
             "plan_layout", "plot_run", "prepare_data", "probe_moe", "train_tokenizer", "verify_parallel")


def test_old_tool_paths_still_work(root):
    bad = []
    for name in OLD_TOOLS:
        r = subprocess.run([sys.executable, os.path.join(root, "tools", name + ".py"), "--help"], capture_output=True,
                           text=True, timeout=300, cwd=root, env=dict(os.environ, PYTHONPATH=root))
        if r.returncode != 0 or "usage" not in r.stdout.lower():
            bad.append((name, r.returncode, r.stderr[-500:]))
    assert not bad, bad
