"""NVIDIA DALI backend for the TokenLoader (``--data-backend dali``, extra ``dali``).

The same windows in the same order as the default backend (the window selection, epoch permutation, DP
sharding and position are the TokenLoader's); each micro-batch's window rows go through a DALI pipeline
(``fn.external_source``) which hands them out as tensors: on the CPU with ``device_id=None``, or copied to
the GPU by DALI when a device id is given (``.gpu()`` outputs, no host-side torch copy).
"""
from __future__ import annotations

from collections import deque

import numpy as np
import torch

from .loader import TokenLoader


class DALITokenLoader(TokenLoader):
    def __init__(self, *args, device_id: int | None = None, **kwargs):
        kwargs["prefetch"] = 0  # the window order is computed synchronously; DALI moves the data
        super().__init__(*args, **kwargs)
        from nvidia.dali import fn, pipeline_def, types

        self._pending = deque()
        self.device_id = device_id

        @pipeline_def(batch_size=self.mbs, num_threads=1, device_id=device_id, prefetch_queue_depth=1,
                      exec_async=False, exec_pipelined=False)
        def pipe():
            tokens, labels = fn.external_source(source=self._source, num_outputs=2, batch=True, dtype=types.INT64)
            if device_id is not None:
                tokens, labels = tokens.gpu(), labels.gpu()
            return tokens, labels

        self.pipe = pipe()
        self.pipe.build()

    def _source(self):
        m = self._pending.popleft()
        return np.ascontiguousarray(m["tokens"].numpy()), np.ascontiguousarray(m["labels"].numpy())

    def next_step(self):
        micro = super().next_step()  # window choice and position: identical to the default backend
        out = []
        for m in micro:
            self._pending.append(m)
            t, l = self.pipe.run()
            if self.device_id is not None:
                t, l = t.as_cpu(), l.as_cpu()
            out.append({"tokens": torch.from_numpy(np.array(t.as_array())),
                        "labels": torch.from_numpy(np.array(l.as_array()))})
        return out


def make_loader(backend: str, *args, **kwargs):
    if backend == "dali":
        return DALITokenLoader(*args, **kwargs)
    kwargs.pop("device_id", None)
    return TokenLoader(*args, **kwargs)
