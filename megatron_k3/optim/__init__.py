"""Optimizers: per-head Muon + AdamW (``muon``) and the chunked host-streamed AdamW offload (``offload``)."""
