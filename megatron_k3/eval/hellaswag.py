"""HellaSwag zero-shot, with exactly the lm-eval harness's task definition (lm-eval 0.4.13, ``hellaswag``).

Per document (``lm_eval/tasks/hellaswag/utils.py``)::

    preprocess(t) = t.strip() -> replace " [title]" by ". " -> drop "[...]" spans (non-greedy) -> "  " -> " "
    query   = preprocess(activity_label + ": " + ctx_a + " " + ctx_b.capitalize())
    choices = [preprocess(e) for e in endings];  gold = int(label)

Each choice is one log-likelihood request ``(query, " " + choice)`` (the task's target delimiter). Encoding
follows lm-eval's causal ``_encode_pair``: trailing spaces of the context move to the continuation, the
whole string and the context are encoded, and the continuation tokens are ``whole[len(context_enc):]``; the
model sees ``(context + continuation)[-(max_length + 1):][:-1]`` and the score is the sum of the
continuation tokens' log-softmax. Metrics (``ConfigurableTask.process_results``)::

    acc      = [argmax_i ll_i == gold]
    acc_norm = [argmax_i ll_i / len(choice_i) == gold]        (characters of the preprocessed ending)

averaged over documents; ``*_stderr`` is lm-eval's closed form for a mean (sample std / sqrt(n)); the
``*_stderr_bootstrap`` values resample documents (1000 draws, seeded).

Scoring is batched: requests sorted by length (longest first), right-padded (causal models: padding on
the right never changes earlier positions), one forward per batch, progress bar.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from ..config import ConfigError

FIELDS = ("activity_label", "ctx_a", "ctx_b", "endings", "label")


def preprocess(text: str) -> str:
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    text = text.replace("  ", " ")
    return text


def process_doc(doc: dict) -> dict:
    ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
    return {"query": preprocess(doc["activity_label"] + ": " + ctx),
            "choices": [preprocess(e) for e in doc["endings"]],
            "gold": int(doc["label"])}


def load_docs(path, limit: int | None = None) -> list[dict]:
    """Rows of a ``.jsonl`` (optionally ``.gz``) or ``.parquet`` file in the HellaSwag schema."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--data {p}: no such file")
    name = p.name.lower()
    if name.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(p).to_pylist()
        except Exception as e:  # noqa: BLE001  (arrow's many error types -> one line)
            raise ConfigError(f"--data {p}: not a readable parquet file ({str(e).splitlines()[0][:200]})") from None
        where = [f"row {i}" for i in range(len(rows))]
    elif name.endswith((".jsonl", ".json", ".jsonl.gz")):
        import gzip

        opener = gzip.open if name.endswith(".gz") else open
        rows, where = [], []
        try:
            with opener(p, "rt", encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        r = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ConfigError(f"--data {p}: line {n} is not valid JSON ({e.msg} at column {e.colno})") from None
                    if not isinstance(r, dict):
                        raise ConfigError(f"--data {p}: line {n} is a JSON {type(r).__name__}, expected an object "
                                          f"with {', '.join(FIELDS)}")
                    rows.append(r)
                    where.append(f"line {n}")
        except (UnicodeDecodeError, OSError, EOFError) as e:
            raise ConfigError(f"--data {p}: cannot read as {'gzip-compressed ' if name.endswith('.gz') else ''}"
                              f"UTF-8 JSON lines ({e})") from None
    else:
        raise ConfigError(f"--data {p}: expected a .jsonl or .parquet file")
    if not rows:
        raise ConfigError(f"--data {p}: no rows")
    for w, r in zip(where, rows):
        miss = [k for k in FIELDS if k not in r]
        if miss:
            raise ConfigError(f"{p}: {w} lacks {', '.join(miss)} (HellaSwag schema: {', '.join(FIELDS)})")
        if str(r["label"]).strip() == "":
            raise ConfigError(f"{p}: {w} has no label (the test split is unlabelled; use validation rows)")
        endings = r["endings"]
        if not isinstance(endings, list) or len(endings) < 2 or not all(isinstance(e, str) for e in endings):
            raise ConfigError(f"{p}: {w}: 'endings' must be a list of at least two strings")
        try:
            label = int(str(r["label"]).strip())
        except ValueError:
            raise ConfigError(f"{p}: {w}: label {r['label']!r} is not an integer (0..{len(endings) - 1})") from None
        if not 0 <= label < len(endings):
            raise ConfigError(f"{p}: {w}: label {label} is out of range for {len(endings)} endings "
                              f"(0..{len(endings) - 1})")
    return rows[:limit] if limit is not None else rows


# ----------------------------------------------------------------------------------------------------
def encode_pair(encode: Callable[[str], list], context: str, continuation: str) -> tuple[list, list]:
    """lm-eval's causal ``_encode_pair``."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = encode(context + continuation)
    ctx = encode(context)
    return ctx, whole[len(ctx):]


def requests_for(docs: list[dict], encode, prefix_token_id: int | None) -> list[tuple[list, list]]:
    """(context tokens, continuation tokens) per (doc, choice), in doc-major order."""
    out = []
    for d in docs:
        for c in d["choices"]:
            if d["query"] == "":
                if prefix_token_id is None:
                    raise ConfigError("empty context and no BOS/EOS token to condition on")
                out.append(([prefix_token_id], encode(" " + c)))
            else:
                out.append(encode_pair(encode, d["query"], " " + c))
    return out


@torch.no_grad()
def loglikelihoods(reqs: list[tuple[list, list]], logits_fn: Callable[[torch.Tensor], torch.Tensor],
                   batch_size: int = 8, max_length: int = 2048, pad_id: int = 0, progress: bool = True,
                   device: str = "cpu") -> list[tuple[float, bool]]:
    """(sum of continuation log-probs, continuation is greedy) per request; batched, right-padded."""
    from tqdm import tqdm

    prepared = []
    for i, (ctx, cont) in enumerate(reqs):
        if not cont:
            raise ConfigError(f"request {i}: the continuation encodes to no tokens")
        inp = (ctx + cont)[-(max_length + 1):][:-1]
        prepared.append((i, inp, cont))
    order = sorted(prepared, key=lambda r: (-(len(r[1]) + len(r[2])), r[0]))
    out: list = [None] * len(reqs)
    bar = tqdm(total=len(reqs), desc="hellaswag", unit="req", disable=not progress)
    for s in range(0, len(order), batch_size):
        batch = order[s:s + batch_size]
        T = max(len(r[1]) for r in batch)
        ids = torch.full((len(batch), T), pad_id, dtype=torch.long)
        for j, (_, inp, _) in enumerate(batch):
            ids[j, :len(inp)] = torch.tensor(inp, dtype=torch.long)
        logp = F.log_softmax(logits_fn(ids.to(device)).float(), dim=-1).cpu()
        for j, (i, inp, cont) in enumerate(batch):
            n = len(inp)
            lp = logp[j, n - len(cont):n]                                # positions predicting the continuation
            tgt = torch.tensor(cont, dtype=torch.long)
            greedy = bool((lp.argmax(-1) == tgt).all())
            out[i] = (float(lp.gather(-1, tgt.unsqueeze(-1)).sum()), greedy)
        bar.update(len(batch))
    bar.close()
    return out


def bootstrap_stderr(xs, iters: int = 1000, seed: int = 1234) -> float:
    xs = np.asarray(xs, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = xs[rng.integers(0, len(xs), size=(iters, len(xs)))].mean(axis=1)
    return float(means.std(ddof=1))


def mean_stderr(xs) -> float:
    """lm-eval's stderr of a mean: sample standard deviation / sqrt(n)."""
    n = len(xs)
    if n < 2:
        return float("nan")
    mu = sum(xs) / n
    return math.sqrt(sum((x - mu) ** 2 for x in xs) / (n - 1)) / math.sqrt(n)


def metrics(docs: list[dict], lls: list[float], bootstrap_iters: int = 1000) -> tuple[dict, list[dict]]:
    """Aggregate and per-document results from the per-request log-likelihoods (doc-major order)."""
    acc, acc_norm, per_doc, k = [], [], [], 0
    for d in docs:
        n = len(d["choices"])
        ll = np.array(lls[k:k + n])
        k += n
        clen = np.array([float(len(c)) for c in d["choices"]])
        pred, pred_norm = int(np.argmax(ll)), int(np.argmax(ll / clen))
        acc.append(1.0 if pred == d["gold"] else 0.0)
        acc_norm.append(1.0 if pred_norm == d["gold"] else 0.0)
        per_doc.append({"gold": d["gold"], "pred": pred, "pred_norm": pred_norm, "loglikelihoods": ll.tolist()})
    res = {"task": "hellaswag", "n": len(docs), "num_fewshot": 0,
           "acc": float(np.mean(acc)), "acc_stderr": mean_stderr(acc),
           "acc_norm": float(np.mean(acc_norm)), "acc_norm_stderr": mean_stderr(acc_norm)}
    if bootstrap_iters > 0:
        res["acc_stderr_bootstrap"] = bootstrap_stderr(acc, bootstrap_iters)
        res["acc_norm_stderr_bootstrap"] = bootstrap_stderr(acc_norm, bootstrap_iters)
    return res, per_doc


# ----------------------------------------------------------------------------------------------------
# models
class Scorer:
    """What the evaluation needs from a model: ``encode``, ``prefix_token_id``, ``pad_id``, ``logits``."""

    def __init__(self, encode, logits_fn, prefix_token_id, pad_id=0, max_length=2048, device="cpu", name=""):
        self.encode, self.logits_fn, self.prefix_token_id = encode, logits_fn, prefix_token_id
        self.pad_id, self.max_length, self.device, self.name = pad_id, max_length, device, name


def hf_scorer(model_dir, dtype: str = "float32", device: str = "cpu", max_length: int | None = None) -> Scorer:
    """A HF directory through transformers (remote code allowed), tokenised as lm-eval's HFLM does."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), trust_remote_code=True,
                                                 dtype=getattr(torch, dtype)).to(device).eval()
    prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    bos_str = tok.decode(prefix) if prefix is not None else None

    def encode(s: str) -> list:
        kw = {"add_special_tokens": False} if bos_str and s.startswith(bos_str) else {}
        return tok.encode(s, **kw)

    def logits(ids):
        return model(ids).logits

    return Scorer(encode, logits, prefix, pad_id=tok.pad_token_id or 0,
                  max_length=max_length or _hf_max_length(model.config, tok), device=device, name=str(model_dir))


def _hf_max_length(config, tok, default: int = 2048) -> int:
    """lm-eval's ``resolve_max_length``: the config's context length, else the tokenizer's, else 2048."""
    for attr in ("n_positions", "max_position_embeddings", "n_ctx"):
        if hasattr(config, attr):
            return int(getattr(config, attr))
    if getattr(tok, "model_max_length", None) and tok.model_max_length < 1e30:
        return int(tok.model_max_length)
    return default


def checkpoint_scorer(path, step: int | None = None, tokenizer: str | None = None, device: str = "cpu",
                      dtype: str = "float32", max_length: int | None = None) -> Scorer:
    """A trainer checkpoint (any save layout) in the golden model; tokenizer from the checkpoint's record. The
    context window is the config's ``max_position_embeddings``, as ``hf_scorer`` resolves it for an export of
    the same checkpoint (lm-eval's rule), so both paths score alike."""
    from ..data.tokenizer import load_tokenizer
    from ..hf.export import resolve_tokenizer_file, source_from_checkpoint
    from ..model import K3ForCausalLM

    src = source_from_checkpoint(path, step)
    tf = resolve_tokenizer_file(src.tokenizer, tokenizer)
    if tf is None:
        raise ConfigError(f"{path}: the checkpoint records no usable tokenizer path; pass --tokenizer FILE")
    tok = load_tokenizer(tf)
    with torch.device("meta"):
        model = K3ForCausalLM(src.cfg, init=False)
    model = model.to_empty(device="cpu")
    sd = src.get(list(src.shapes))
    model.load_state_dict(sd, strict=True)
    if dtype != "float32":
        model.to_compute_dtype(getattr(torch, dtype))
    model = model.to(device).eval()
    prefix = tok.bos_id if tok.bos_id is not None else tok.eos_id
    return Scorer(tok.encode, lambda ids: model(ids), prefix, pad_id=tok.pad_id or 0,
                  max_length=max_length or int(src.cfg.max_position_embeddings), device=device, name=str(path))


def evaluate(scorer: Scorer, data, limit: int | None = None, batch_size: int = 8, progress: bool = True,
             bootstrap_iters: int = 1000) -> tuple[dict, list[dict]]:
    rows = load_docs(data, limit)
    docs = [process_doc(r) for r in rows]
    reqs = requests_for(docs, scorer.encode, scorer.prefix_token_id)
    lls = loglikelihoods(reqs, scorer.logits_fn, batch_size=batch_size, max_length=scorer.max_length,
                         pad_id=scorer.pad_id, progress=progress, device=scorer.device)
    res, per_doc = metrics(docs, [ll for ll, _ in lls], bootstrap_iters)
    res["model"] = scorer.name
    res["data"] = str(data)
    return res, per_doc
