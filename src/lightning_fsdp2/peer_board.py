"""Each rank's record in the process group's store, published now and then once a second by a thread, and the other
ranks' records read back: :class:`PeerBoard`. What a record says is ``lockstep.PeerWatch``'s concern; this module
only moves dicts.

Why a store and a thread: a rank waiting in a collective cannot ask its peers anything through collectives, and the
peer that moved on is not in one. The store (rank 0's TCP server that set the processes up) answers whoever still
runs, and the thread keeps publishing while the main thread is blocked. Its one ``store.set`` a second runs outside
the GIL.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist


class PeerBoard:
    """This rank's record (``record()``, a JSON-able dict, stamped with the ``time`` it was published) under its rank
    in the process group's store, every ``interval`` seconds from a thread and whenever :meth:`publish` is called;
    :meth:`read` returns the other ranks' last records."""

    def __init__(self, interval: float = 1.0) -> None:
        self.interval = interval
        self._store: Any = None  # the store, the lock, the thread and its stop event exist from start() on
        self._lock: Any = None  # the thread and a failing step publish in turn
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None

    def __getstate__(self) -> dict[str, Any]:
        # The strategy is pickled by Lightning's spawn launcher before any process group exists: nothing live goes.
        return {**self.__dict__, "_store": None, "_lock": None, "_stop": None, "_thread": None}

    @property
    def active(self) -> bool:
        """Started in this process: records are published and read (also after :meth:`halt`)."""
        return self._store is not None

    def start(self, record: Callable[[], dict[str, Any]]) -> None:
        """After the process group started: publish ``record()`` at once, then from a fresh thread every
        ``interval`` seconds until :meth:`halt`."""
        self.halt()
        self._store = dist.PrefixStore("lightning_fsdp2/peers/", dist.distributed_c10d._get_default_store())
        self._lock = threading.Lock()
        self.publish(record)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(self._stop, record), daemon=True,
                                        name="lightning_fsdp2-peer-watch")
        self._thread.start()

    def halt(self) -> None:
        """Stop the thread and wait for it, so that it publishes nothing after the record published next. The store
        stays: a stopped rank still publishes its last word and reads its peers'."""
        if self._stop is not None:
            self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.interval)
        self._stop = self._thread = None

    def publish(self, record: Callable[[], dict[str, Any]], unless: threading.Event | None = None) -> None:
        """Publish ``record()`` (raises if the store is gone: rank 0 exited). ``record`` is called under the lock,
        so that a beat computed before a failing step's record cannot overwrite it with an older state; ``unless``
        set (the thread halted meanwhile): nothing."""
        with self._lock:
            if unless is not None and unless.is_set():
                return
            self._store.set(str(dist.get_rank()), json.dumps({**record(), "time": time.time()}))

    def read(self) -> tuple[dict[int, dict[str, Any]], str | None]:
        """The other ranks' last records by rank (a rank that never published is left out), and why they could not
        all be read (rank 0, the store's server, may be gone), or None."""
        peers: dict[int, dict[str, Any]] = {}
        try:
            keys = [str(r) for r in range(dist.get_world_size()) if r != dist.get_rank()]
            present = [k for k in keys if self._store.check([k])]
            for key, value in zip(present, self._store.multi_get(present) if present else []):
                peers[int(key)] = json.loads(value)
        except Exception as failure:  # noqa: BLE001 - rank 0 (the store's server) may be gone
            return peers, f"{type(failure).__name__}: {str(failure).strip()[:200]}"
        return peers, None

    def _beat(self, stop: threading.Event, record: Callable[[], dict[str, Any]]) -> None:
        while not stop.wait(self.interval):
            try:
                self.publish(record, unless=stop)
            except Exception:  # noqa: BLE001 - the store is gone (rank 0 exited): nothing left to tell
                return
