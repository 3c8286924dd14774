"""The MoE routers of a built model, found once per model chunk (no model import: graphs, runtime and the
trainer use it)."""
from __future__ import annotations

import weakref

_ROUTERS = weakref.WeakKeyDictionary()  # model chunk -> its [(layer name, router)]


def moe_routers(chunks):
    """(layer name, router) for every MoE router of these chunks ("7" for layers.7, "mtp0" for MTP head 0).
    Found once per chunk (the gradient finalisation asks every step; k3-mini has 4,396 modules to walk)."""
    from megatron.core.transformer.moe.router import TopKRouter

    out = []
    for c in chunks:
        if c not in _ROUTERS:
            found = []
            for name, m in c.named_modules():
                if isinstance(m, TopKRouter):
                    parts = name.split(".")
                    key = (parts[parts.index("layers") + 1] if "layers" in parts
                           else f"mtp{parts[parts.index('mtp_heads') + 1]}")
                    found.append((key, m))
            _ROUTERS[c] = found
        out.extend(_ROUTERS[c])
    return out
