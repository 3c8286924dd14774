"""HF export: a K3 checkpoint (any TP/PP/EP layout) -> a HF model directory, tensor-streamed.

``export_hf(source, out_dir, layout="k3"|"kimi_linear", dtype="fp32"|"bf16")`` writes

* ``config.json`` (``config_map``), ``generation_config.json``;
* ``model-0000k-of-0000n.safetensors`` shards of at most ``shard_bytes`` + ``model.safetensors.index.json``
  (``metadata.total_size``, ``weight_map``), names and shapes from ``names.py``;
* the tokenizer files: ``tokenizer.json`` + ``tokenizer_config.json`` (``PreTrainedTokenizerFast``, loads with
  ``AutoTokenizer``) for a HF ``tokenizers`` BPE; ``tiktoken.model`` + ``tokenizer_config.json`` (the
  special-token ids) for the Kimi tokenizer, which ``AutoTokenizer`` reads only with the release's own
  ``tokenization_kimi.py`` (not shipped: not ours to redistribute);
* for ``layout="k3"``: the remote code, ``configuration_k3.py`` + ``modeling_k3.py`` and the golden model's
  own sources copied beside them as ``k3_*.py`` (relative imports renamed, nothing else changed), so the
  directory is self-contained, ``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` loads
  it, and its math *is* the code the trainer is tested against. A copy of the math, rather than a second
  implementation, is the decision: nothing can drift between the trainer and the exported model;
* ``k3_export.json``: provenance (source checkpoint, step, config name, layout, dtype, tokenizer identity).

**Streaming.** A *source* gives names, shapes and dtypes without data and loads the tensors of one shard at
a time (``get(names)``); at most one shard (``shard_bytes``, default 2 GiB) is in memory. Sources: a
checkpoint directory (``checkpoints_io.k3ckpt.read_weights``: layout-independent, so any save layout
works), a HF-named ``.pt`` file (``--export-weights``), or an in-memory state dict (tests).

**dtype.** ``bf16`` casts floating tensors except those K3 keeps in fp32 (KDA ``A_log``, ``dt_bias``, short
convolutions, ``o_norm``; the router's ``e_score_correction_bias``).
"""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable

import torch

from ..config import ConfigError, K3Config
from ..parallel import adapter
from . import config_map, names

ROOT = Path(__file__).resolve().parents[1]  # megatron_k3/
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
DEFAULT_SHARD_BYTES = 2 << 30

# The remote code copies the golden model's sources: every module reachable by relative imports from these
# roots (megatron_k3/model/*.py, megatron_k3/config.py, megatron_k3/hf/config_map.py), renamed k3_*.py.
REMOTE_ROOTS = ["model/k3.py", "hf/config_map.py"]
REMOTE_NAMES = {"model/k3.py": "k3_golden.py", "config.py": "k3_config.py", "hf/config_map.py": "k3_hf_config.py"}
REMOTE_TEMPLATES = ["configuration_k3.py", "modeling_k3.py"]


# ----------------------------------------------------------------------------------------------------
# sources
@dataclass
class WeightSource:
    """HF-named (golden) tensors: ``shapes[name] = (shape, dtype)`` and ``get(names) -> {name: tensor}``."""

    cfg: K3Config
    shapes: dict
    get: Callable
    step: int = 0
    tokenizer: dict | None = None
    origin: str = "memory"
    extra: dict = field(default_factory=dict)


def source_from_state_dict(sd: dict, cfg: K3Config, tokenizer: dict | None = None, step: int = 0) -> WeightSource:
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in sd.items()}
    return WeightSource(cfg, shapes, lambda which: {n: sd[n] for n in which}, step, tokenizer)


def source_from_checkpoint(path, step: int | None = None) -> WeightSource:
    """A trainer checkpoint (save dir with ``latest_checkpointed_iteration.txt`` or an ``iter_*`` dir)."""
    from checkpoints_io import k3ckpt

    meta, shapes, get = k3ckpt.read_weights(path, step)
    cfg = K3Config.from_dict(meta["config"]).validate()
    return WeightSource(cfg, dict(shapes), get, int(meta.get("step", 0)), meta.get("tokenizer"),
                        origin=str(meta.get("path", path)))


def source_from_pt(path, cfg: K3Config, tokenizer: dict | None = None) -> WeightSource:
    """A HF-named ``torch.save`` dict (the trainer's ``--export-weights`` file); loaded memory-mapped."""
    sd = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    src = source_from_state_dict(sd, cfg, tokenizer)
    src.origin = str(path)
    return src


def golden_order(cfg: K3Config) -> list[str]:
    """The golden model's state_dict order (embedding, layer by layer, head): shards follow the model."""
    from ..model import hf_shapes

    return list(hf_shapes(cfg))


def check_source(src: WeightSource) -> list[str]:
    """The source's names in model order; raises ConfigError when they do not match the config."""
    order = golden_order(src.cfg)
    missing = [n for n in order if n not in src.shapes]
    extra = sorted(set(src.shapes) - set(order))
    if missing or extra:
        raise ConfigError(f"weights do not match config '{src.cfg.name}': {len(missing)} missing (e.g. "
                          f"{missing[:1]}), {len(extra)} unexpected (e.g. {extra[:1]})")
    return order


# ----------------------------------------------------------------------------------------------------
# planning
@dataclass
class Entry:
    src: str
    name: str
    shape: tuple
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


def out_dtype(name: str, src_dtype: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    if not src_dtype.is_floating_point:
        return src_dtype
    return torch.float32 if names.keeps_fp32(name) else dtype


def plan(src: WeightSource, layout: str = "k3", dtype: torch.dtype = torch.float32) -> list[Entry]:
    if layout not in config_map.LAYOUTS:
        raise ConfigError(f"unknown layout '{layout}' (choose from: {', '.join(config_map.LAYOUTS)})")
    if layout == "kimi_linear":
        probs = config_map.native_kimi_linear_problems(src.cfg)
        if probs:
            raise ConfigError(f"config '{src.cfg.name}' cannot be written in the Kimi Linear layout: "
                              + "; ".join(probs))
    out = []
    for n in check_source(src):
        shape, sdt = src.shapes[n]
        on, oshape = adapter.release_name_shape(n, shape, src.cfg, layout)
        out.append(Entry(n, on, tuple(oshape), out_dtype(n, sdt, dtype)))
    return out


def shard(entries: list[Entry], shard_bytes: int) -> list[list[Entry]]:
    shards, cur, size = [], [], 0
    for e in entries:
        if cur and size + e.nbytes > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(e)
        size += e.nbytes
    if cur:
        shards.append(cur)
    return shards


# ----------------------------------------------------------------------------------------------------
# remote code and tokenizer
# ``from .m import a, b`` and the parenthesised, multi-line ``from .m import (a,\n    b)``
_REL_IMPORT = re.compile(r"^([ \t]*)from\s+(\.+)([\w.]*)\s+import\s+(\([\w,\s]+?\)|[\w, ]+?)([ \t]*(?:#.*)?)$",
                         re.MULTILINE)


def _names(what: str) -> list[str]:
    return [w.strip() for w in what.strip("()").replace("\n", " ").split(",") if w.strip()]


def _resolve(src_rel: str, dots: str, mod: str, name: str | None) -> str:
    """File (relative to megatron_k3/) that ``from <dots><mod> import <name>`` in ``src_rel`` refers to."""
    base = list(Path(src_rel).parent.parts)
    base = base[: len(base) - (len(dots) - 1)] if len(dots) > 1 else base
    parts = base + (mod.split(".") if mod else []) + ([name] if name else [])
    return "/".join(parts) + ".py"


def remote_name(rel: str) -> str:
    return REMOTE_NAMES.get(rel, "k3_" + Path(rel).stem + ".py")


def remote_modules() -> list[tuple[str, str]]:
    """[(source file relative to megatron_k3/, remote file name)]: the closure of relative imports."""
    todo, seen = list(REMOTE_ROOTS), []
    while todo:
        rel = todo.pop(0)
        if rel in seen:
            continue
        if not (ROOT / rel).is_file():
            raise RuntimeError(f"remote code: megatron_k3/{rel} not found")
        seen.append(rel)
        for m in _REL_IMPORT.finditer((ROOT / rel).read_text()):
            dots, mod, what = m.group(2), m.group(3), m.group(4)
            if mod:
                todo.append(_resolve(rel, dots, mod, None))
            else:  # from . import a, b
                todo.extend(_resolve(rel, dots, "", w.split(" as ")[0]) for w in _names(what))
    return [(rel, remote_name(rel)) for rel in seen]


def _rewrite_imports(text: str, src_rel: str) -> str:
    """``from .common import x`` -> ``from .k3_common import x``; ``from . import a`` -> ``from . import k3_a as a``."""

    def repl(m):
        indent, dots, mod, what, tail = m.groups()
        if mod:
            return f"{indent}from .{remote_name(_resolve(src_rel, dots, mod, None))[:-3]} import {what}{tail}"
        items = []
        for w in _names(what):
            name, _, alias = w.partition(" as ")
            items.append(f"{remote_name(_resolve(src_rel, dots, '', name))[:-3]} as {alias or name}")
        return f"{indent}from . import {', '.join(items)}{tail}"

    return _REL_IMPORT.sub(repl, text)


def write_remote_code(out_dir: Path) -> list[str]:
    written = []
    for src_rel, dst in remote_modules():
        text = (ROOT / src_rel).read_text()
        header = f"# Copied by megatron-k3's HF exporter from megatron_k3/{src_rel} (relative imports renamed).\n"
        (out_dir / dst).write_text(header + _rewrite_imports(text, src_rel))
        written.append(dst)
    for t in REMOTE_TEMPLATES:
        shutil.copyfile(ROOT / "hf" / "remote_code" / t, out_dir / t)
        written.append(t)
    return written


def resolve_tokenizer_file(tok: dict | None, override: str | None = None) -> Path | None:
    """The tokenizer file to ship: ``override`` or the checkpoint's recorded path (checked by SHA-256)."""
    from ..data.tokenizer import file_sha256

    if override:
        p = Path(override)
        if p.is_dir():
            for cand in ("tokenizer.json", "tiktoken.model"):
                if (p / cand).is_file():
                    p = p / cand
                    break
        if not p.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {override}")
        if tok and tok.get("sha256") and file_sha256(p) != tok["sha256"]:
            raise ConfigError(f"tokenizer {p} is not the one the checkpoint was trained with (SHA-256 differs)")
        return p
    if tok and tok.get("path") and Path(tok["path"]).is_file():
        p = Path(tok["path"])
        if tok.get("sha256") and file_sha256(p) != tok["sha256"]:
            raise ConfigError(f"tokenizer {p} changed since training (SHA-256 differs); pass --tokenizer")
        return p
    return None


def write_tokenizer(out_dir: Path, path: Path, cfg: K3Config) -> dict:
    """Tokenizer files for ``AutoTokenizer``; returns the special-token ids."""
    from ..data.tokenizer import load_tokenizer

    tok = load_tokenizer(path)
    if tok.kind == "hf-tokenizers":
        shutil.copyfile(path, out_dir / "tokenizer.json")
        inv = {i: s for s, i in tok.tok.get_vocab(with_added_tokens=True).items()}
        tc = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False, "add_eos_token": False,
              "clean_up_tokenization_spaces": False, "model_max_length": cfg.max_position_embeddings}
        for key, i in (("bos_token", tok.bos_id), ("eos_token", tok.eos_id), ("pad_token", tok.pad_id)):
            if i is not None:
                tc[key] = inv[i]
        (out_dir / "tokenizer_config.json").write_text(json.dumps(tc, indent=2) + "\n")
    else:  # Kimi tiktoken: the ranks file + the release's tokenizer_config.json keys (special-token ids)
        shutil.copyfile(path, out_dir / "tiktoken.model")
        specials = {str(i): {"content": s, "special": True} for s, i in tok.enc._special_tokens.items()}
        eos = "<|im_end|>" if "<|im_end|>" in tok.enc._special_tokens else "[EOS]"
        tc = {"added_tokens_decoder": specials, "model_max_length": cfg.max_position_embeddings,
              "bos_token": "[BOS]", "eos_token": eos, "pad_token": "[PAD]", "clean_up_tokenization_spaces": False}
        (out_dir / "tokenizer_config.json").write_text(json.dumps(tc, indent=2) + "\n")
    return {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}


# ----------------------------------------------------------------------------------------------------
def export_hf(src: WeightSource, out_dir, layout: str = "k3", dtype: str = "fp32",
              shard_bytes: int = DEFAULT_SHARD_BYTES, tokenizer: str | None = None, progress: bool = True,
              overwrite: bool = False) -> dict:
    """Write the HF directory; returns a summary (tensors, bytes, shards, files).

    The directory is written under a temporary name beside ``out_dir`` and renamed into place when complete,
    so a failure (disk full, a bad shard in the source) leaves no partial export and, with ``overwrite``, the
    previous export intact. Files get the usual permissions (0644 under a 022 umask)."""
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype '{dtype}' (choose from: {', '.join(DTYPES)})")
    tdt = DTYPES[dtype]
    entries = plan(src, layout, tdt)
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"--output {out_dir} exists and is not a directory: name a new or empty directory")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise ConfigError(f"output directory {out_dir} exists and is not empty (pass --overwrite)")
    tok_path = resolve_tokenizer_file(src.tokenizer, tokenizer)
    parent = out_dir.parent
    blocker = next((q for q in [parent, *parent.parents] if q.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise ConfigError(f"--output {out_dir}: {blocker} is a file, not a directory")
    if not parent.exists():
        parent.mkdir(parents=True, exist_ok=True)
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"--output {out_dir}: its parent directory {parent} is not writable")
    tmp = parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        summary = _write_export(src, tmp, entries, layout, tdt, shard_bytes, tok_path, progress)
        umask = os.umask(0)
        os.umask(umask)
        for f in tmp.iterdir():
            os.chmod(f, 0o666 & ~umask)
        os.chmod(tmp, 0o777 & ~umask)
        if out_dir.exists():  # --overwrite: the old export goes only once the new one is complete
            old = parent / f".{out_dir.name}.old-{os.getpid()}"
            os.replace(out_dir, old)
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    summary["files"] = sorted(os.listdir(out_dir))
    return summary


def _write_export(src: WeightSource, out_dir: Path, entries, layout: str, tdt, shard_bytes: int, tok_path,
                  progress: bool) -> dict:
    from safetensors.torch import save_file
    from tqdm import tqdm

    shards = shard(entries, shard_bytes)
    n = len(shards)
    weight_map, total = {}, 0
    bar = tqdm(total=sum(e.nbytes for e in entries), unit="B", unit_scale=True, desc="export",
               disable=not progress)
    for k, group in enumerate(shards, start=1):
        fname = f"model-{k:05d}-of-{n:05d}.safetensors"
        data = src.get([e.src for e in group])
        out = {}
        for e in group:
            on, t = names.export_tensor(e.src, data.pop(e.src), src.cfg, layout)
            assert on == e.name and tuple(t.shape) == e.shape, (on, e.name, t.shape, e.shape)
            out[on] = t.detach().to(e.dtype).contiguous()
            weight_map[on] = fname
            total += e.nbytes
        save_file(out, str(out_dir / fname), metadata={"format": "pt"})
        bar.update(sum(e.nbytes for e in group))
        del out, data
    bar.close()
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")

    ids = {"bos_token_id": src.cfg.bos_token_id, "eos_token_id": src.cfg.eos_token_id,
           "pad_token_id": src.cfg.pad_token_id}
    if tok_path is not None:
        tok_ids = write_tokenizer(out_dir, tok_path, src.cfg)
        ids = {k: (v if v is not None else tok_ids[k]) for k, v in ids.items()}
    dname = DTYPE_NAMES[tdt]
    if layout == "k3":
        conf = config_map.k3_config_json(src.cfg, dname)
        conf.update(ids)  # the wrapper carries the tokenizer's ids; text_config keeps the model config's
        write_remote_code(out_dir)
    else:
        conf = config_map.kimi_linear_config_json(src.cfg, dname)
        for k, v in ids.items():
            if conf.get(k) is None:
                conf[k] = v
    (out_dir / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
    gen = {k: v for k, v in ids.items() if v is not None}
    gen.update({"do_sample": False, "max_new_tokens": 256})
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    shipped = None
    if tok_path is not None:  # the name written into the export, and the file it came from
        shipped = {"file": "tokenizer.json" if (out_dir / "tokenizer.json").exists() else "tiktoken.model",
                   "from": tok_path.name}
    summary = {"layout": layout, "dtype": dname, "tensors": len(entries), "bytes": total, "shards": n,
               "source": src.origin, "step": src.step, "config": src.cfg.name,
               "tokenizer": (src.tokenizer or {}) | {"shipped": shipped}}
    summary["tokenizer"].pop("path", None)
    (out_dir / "k3_export.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary


def dry_run(src: WeightSource, layout: str = "k3", dtype: str = "fp32") -> list[tuple[str, tuple, str]]:
    """(name, shape, dtype) of every tensor the export would write, without reading any tensor data."""
    return [(e.name, e.shape, DTYPE_NAMES.get(e.dtype, str(e.dtype))) for e in plan(src, layout, DTYPES[dtype])]
