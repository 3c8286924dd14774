"""Routing probe: expert load and cross-domain specialisation of a trained model (``tools/probe_moe.py``).

Runs the golden model on windows of domain-tagged documents (``domain`` field of a .jsonl corpus; the
embedded corpus has tutorial / howto / faq / reference), counts the top-k expert choices per MoE layer and
domain, and reports per layer:

- load over all domains: normalised entropy, dead experts, max/mean (``megatron_k3.train.metrics``);
- specialisation: the mean Jensen-Shannon divergence (nats) between the expert-usage distributions of
  every pair of domains, against a noise floor: the mean JS divergence between the two halves (alternate
  windows) of the same domain. ``ratio = cross / floor``; ~1 means no specialisation.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from ..cli import ArgumentParser, UsageError, friendly_errors
from ..config import get_preset, load_config
from ..train.metrics import routing_stats


def js_divergence(p: torch.Tensor, q: torch.Tensor) -> float:
    p, q = p.double() / p.sum(), q.double() / q.sum()
    m = 0.5 * (p + q)

    def kl(a, b):
        mask = a > 0
        return float((a[mask] * (a[mask] / b[mask]).log()).sum())

    return 0.5 * kl(p, m) + 0.5 * kl(q, m)


def probe(model, domain_windows: dict, batch: int = 8) -> dict:
    """domain -> LongTensor [N, S] of token windows. Returns the per-layer report."""
    from ..model.moe import LatentMoE

    moes = {name.split(".")[2]: m for name, m in model.named_modules()
            if isinstance(m, LatentMoE) and name.startswith("model.layers.")}
    E = model.cfg.num_experts
    counts = {layer: {d: [torch.zeros(E), torch.zeros(E)] for d in domain_windows} for layer in moes}
    model.eval()
    with torch.no_grad():
        for d, wins in domain_windows.items():
            for i in range(0, len(wins), batch):
                chunk = wins[i:i + batch]
                model(chunk)
                for layer, m in moes.items():
                    idx = m.last_routing.view(chunk.shape[0], chunk.shape[1], -1)
                    for j in range(chunk.shape[0]):
                        half = (i + j) % 2
                        counts[layer][d][half] += torch.bincount(idx[j].flatten(), minlength=E).float()
    report = {}
    doms = list(domain_windows)
    for layer in sorted(moes, key=int):
        total = sum(c[0] + c[1] for c in counts[layer].values())
        per_dom = {d: c[0] + c[1] for d, c in counts[layer].items()}
        cross = [js_divergence(per_dom[a], per_dom[b]) for i, a in enumerate(doms) for b in doms[i + 1:]]
        floor = [js_divergence(*counts[layer][d]) for d in doms]
        c_mean, f_mean = sum(cross) / max(1, len(cross)), sum(floor) / len(floor)
        report[layer] = {**routing_stats(total), "js_cross_domain": c_mean, "js_within_domain_floor": f_mean,
                         "specialisation_ratio": c_mean / f_mean if f_mean > 0 else float("inf")}
    return report


@friendly_errors
def main(argv=None):
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", required=True, help="HF-named state dict (.pt), e.g. from pretrain --export-weights")
    ap.add_argument("--preset", default=None)
    ap.add_argument("--config", default=None)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--data", required=True, help=".jsonl(.gz) with 'text' and 'domain' fields")
    ap.add_argument("--seq-length", type=int, default=128)
    ap.add_argument("--windows-per-domain", type=int, default=64)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if bool(args.preset) == bool(args.config):
        raise UsageError("give exactly one of --preset or --config")
    cfg = get_preset(args.preset) if args.preset else load_config(args.config)
    from ..data.store import iter_documents
    from ..data.tokenizer import load_tokenizer
    from ..model import K3ForCausalLM
    from pathlib import Path

    tok = load_tokenizer(args.tokenizer)
    streams = {}
    for text, extra in iter_documents(Path(args.data)):
        if "domain" not in extra:
            raise UsageError(f"{args.data}: documents need a 'domain' field")
        streams.setdefault(extra["domain"], []).extend(tok.encode(text) + [tok.eos_id])
    if len(streams) < 2:
        raise UsageError("need at least two domains")
    S = args.seq_length
    wins = {}
    for d, ids in streams.items():
        n = min(args.windows_per_domain, len(ids) // S)
        if n < 2:
            raise UsageError(f"domain '{d}' has fewer than 2 windows of {S} tokens")
        wins[d] = torch.tensor(ids[:n * S]).view(n, S)
    sd = torch.load(args.weights, map_location="cpu", weights_only=True)
    model = K3ForCausalLM(cfg, init=False)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise UsageError(f"{args.weights} does not match the config: missing {missing[:3]}, unexpected {unexpected[:3]}")
    rep = probe(model, wins)
    if args.json:
        print(json.dumps({"domains": {d: int(w.shape[0]) for d, w in wins.items()}, "layers": rep}, indent=1))
    else:
        print(f"{'layer':>5} {'entropy':>8} {'dead':>5} {'max/mean':>9} {'JS cross':>9} {'JS floor':>9} {'ratio':>7}")
        for layer, r in rep.items():
            print(f"{layer:>5} {r['entropy']:8.3f} {r['dead']:5d} {r['max_mean']:9.2f} {r['js_cross_domain']:9.4f} "
                  f"{r['js_within_domain_floor']:9.4f} {r['specialisation_ratio']:7.2f}")
    sys.stdout.flush()
