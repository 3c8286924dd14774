"""TokenLoader: epoch-exact, shuffled, data-parallel-sharded windows of a token store.

The stream of N tokens is cut into ``W = N // (S + 1)`` non-overlapping windows of ``S + 1`` tokens (inputs
are the first S, labels the last S). Epoch ``e`` visits the windows in the order of a permutation drawn from
``numpy.random.PCG64(seed, e)``, so an epoch touches every window exactly once and each epoch has its own
order. A training step takes the next ``global_batch`` windows of that global order (continuing into the
next epoch when one ends); data-parallel rank ``r`` gets its contiguous ``global_batch / DP`` slice, cut
into micro-batches. DP shards of a step are disjoint by construction.

A background thread prefetches steps. An exception in it (a read error on the store, a corrupt shard) is
handed to the main thread and raised by the next ``next_step`` as ``DataLoaderError`` naming the step's
position; ``next_step`` never waits without bound (it checks that the thread is alive while it waits).

The position is ``(epoch, cursor)``: ``state_dict()`` gives the position of the next step *not yet handed
out* (prefetched steps do not count), and ``load_state_dict`` resumes the identical stream. Labels equal
to the tokenizer's pad id are masked (``-100``).
"""
from __future__ import annotations

import queue
import threading

import numpy as np
import torch

from ..cli import RunError
from ..config import ConfigError
from ..model.k3 import IGNORE_INDEX
from .store import open_store


class DataLoaderError(RunError):
    """Reading the token store failed (in the prefetch thread or inline); names where (exit code 1)."""


class TokenLoader:
    def __init__(self, path, seq_length: int, micro_batch_size: int, global_batch_size: int, dp_rank: int = 0,
                 dp_size: int = 1, seed: int = 1234, pad_id: int | None = None, prefetch: int = 2,
                 in_memory: bool | None = None):
        tokens, _, self.manifest = open_store(path)
        self.path = path
        self.S, self.mbs, self.gb = seq_length, micro_batch_size, global_batch_size
        self.dp_rank, self.dp_size, self.seed, self.pad_id = dp_rank, dp_size, seed, pad_id
        if global_batch_size % (micro_batch_size * dp_size):
            raise ConfigError(f"global batch {global_batch_size} is not divisible by micro batch x DP = "
                              f"{micro_batch_size * dp_size}")
        self.num_micro = global_batch_size // (micro_batch_size * dp_size)
        n = int(self.manifest["token_count"])
        self.num_windows = n // (seq_length + 1)
        if self.num_windows < global_batch_size:
            raise ConfigError(f"the token store has {n} tokens = {self.num_windows} windows of {seq_length + 1}, "
                              f"fewer than one global batch ({global_batch_size})")
        if in_memory is None:
            in_memory = n * 4 <= (1 << 31)
        self.tokens = np.asarray(tokens[:]) if in_memory else tokens
        self.epoch, self.cursor = 0, 0
        self._perm_epoch, self._perm = None, None
        self.prefetch = prefetch
        self._q, self._thread, self._stop = None, None, threading.Event()

    # ------------------------------------------------------------------------------------------------
    def permutation(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:
            self._perm = np.random.Generator(np.random.PCG64([self.seed, epoch])).permutation(self.num_windows)
            self._perm_epoch = epoch
        return self._perm

    def _take_global(self, epoch: int, cursor: int):
        """Window ids of one global batch starting at (epoch, cursor), and the position after it."""
        ids = []
        while len(ids) < self.gb:
            perm = self.permutation(epoch)
            k = min(self.gb - len(ids), self.num_windows - cursor)
            ids.extend(perm[cursor:cursor + k].tolist())
            cursor += k
            if cursor == self.num_windows:
                epoch, cursor = epoch + 1, 0
        return ids, epoch, cursor

    def _read(self, window_ids) -> np.ndarray:
        L = self.S + 1
        return np.stack([np.asarray(self.tokens[w * L:(w + 1) * L], dtype=np.int64) for w in window_ids])

    def _build_step(self, epoch: int, cursor: int):
        ids, epoch2, cursor2 = self._take_global(epoch, cursor)
        per = self.gb // self.dp_size
        mine = ids[self.dp_rank * per:(self.dp_rank + 1) * per]
        arr = torch.from_numpy(self._read(mine))
        micro = []
        for m in range(self.num_micro):
            w = arr[m * self.mbs:(m + 1) * self.mbs]
            tokens, labels = w[:, :-1].clone(), w[:, 1:].clone()
            if self.pad_id is not None:
                labels[labels == self.pad_id] = IGNORE_INDEX
            micro.append({"tokens": tokens, "labels": labels})
        return micro, mine, epoch2, cursor2

    # ------------------------------------------------------------------------------------------------
    def _producer(self, epoch, cursor):
        while not self._stop.is_set():
            try:
                micro, ids, e2, c2 = self._build_step(epoch, cursor)
                item = (micro, ids, (epoch, cursor), (e2, c2))
            except BaseException as e:  # noqa: BLE001  (handed to the main thread, which raises it)
                item = ("error", e, (epoch, cursor), None)
                e2, c2 = epoch, cursor
            while not self._stop.is_set():
                try:
                    self._q.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[0] == "error":
                return
            epoch, cursor = e2, c2

    def _ensure_thread(self):
        if self.prefetch > 0 and self._thread is None:
            self._q = queue.Queue(maxsize=self.prefetch)
            self._stop.clear()
            self._thread = threading.Thread(target=self._producer, args=(self.epoch, self.cursor), daemon=True)
            self._thread.start()

    def next_step(self):
        """The micro-batches of this DP rank for the next step (list of dicts of [mbs, S] tensors)."""
        if self.prefetch > 0:
            self._ensure_thread()
            while True:
                try:
                    micro, ids, start, end = self._q.get(timeout=1.0)
                    break
                except queue.Empty:
                    if not self._thread.is_alive():
                        self._thread = None
                        raise DataLoaderError(f"the data prefetch thread stopped without a result at epoch "
                                              f"{self.epoch}, window {self.cursor} of {self.path}") from None
            if micro == "error":
                self.close()
                raise DataLoaderError(f"reading the token store {self.path} at epoch {start[0]}, window "
                                      f"{start[1]} failed: {type(ids).__name__}: {ids}") from ids
            assert start == (self.epoch, self.cursor), "prefetch went out of sync"
        else:
            try:
                micro, ids, e2, c2 = self._build_step(self.epoch, self.cursor)
            except (OSError, ValueError, KeyError, RuntimeError) as e:
                raise DataLoaderError(f"reading the token store {self.path} at epoch {self.epoch}, window "
                                      f"{self.cursor} failed: {type(e).__name__}: {e}") from e
            end = (e2, c2)
        self.epoch, self.cursor = end
        self.last_window_ids = ids
        return micro

    def close(self):
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._thread = None

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "num_windows": self.num_windows,
                "seq_length": self.S, "global_batch_size": self.gb}

    def load_state_dict(self, sd: dict):
        mine = self.state_dict()
        for k in ("seed", "num_windows", "seq_length", "global_batch_size"):
            if sd[k] != mine[k]:
                raise ConfigError(f"loader state mismatch: saved {k}={sd[k]}, this run has {mine[k]}")
        self.close()
        self.epoch, self.cursor = int(sd["epoch"]), int(sd["cursor"])
