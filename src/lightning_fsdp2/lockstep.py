"""Where each rank is, so that a collective that fails for want of a peer names the cause: :class:`PeerWatch`.

Each rank counts the strategy's phases (``training_step``, ``backward``, a save...) it enters and publishes where it is
in the process group's store, from a thread, once a second. From the second training step on the process groups'
timeout is lowered to ``peer_timeout``; a collective that then fails raises :class:`~.peer_lost.PeerLostError` with
this rank's phase, every other rank's last published one, and which case they point to (a rank behind, stuck in its
own code; a rank that moved on without this step's collectives; a rank that failed first).
"""

from __future__ import annotations

import functools
import json
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_fsdp2.peer_lost import peer_lost, torch_said


_SAVING = ("lightning_module_state_dict", "optimizer_state", "save_checkpoint")
# The phases of a training batch (Fabric's forwards included). Any other phase entered between steps (a barrier, a
# reduce, a validation step, a save) is one that some ranks may skip, or reach late.
_TRAINING = ("training_step", "backward", "optimizer_step", "forward")
_TRAILS_KEPT = 1024  # seqs whose trail a rank keeps: a peer further behind is told apart by position alone
_PHASES = {  # the strategy's methods, as a user knows them
    "lightning_module_state_dict": "saving a checkpoint", "optimizer_state": "saving a checkpoint",
    "save_checkpoint": "saving a checkpoint", "load_checkpoint": "loading a checkpoint",
    "load_model_state_dict": "loading a checkpoint", "load_optimizer_state_dict": "loading a checkpoint",
    "forward": "in the model's forward",
}


class PeerWatch:
    """Each rank's last phase (``training_step`` #5, ``backward``, saving a checkpoint, finished), published to the
    process group's store every ``interval`` seconds by a thread; from the second training step on, the process
    groups' timeout lowered to ``timeout`` (torchtitan's ``train_timeout_seconds``: the first step may compile and
    warm up for longer); and a collective that fails inside a phase re-raised as :class:`PeerLostError`, naming what
    the other ranks last published.

    Why a store and a thread: a rank waiting in a collective cannot ask its peers anything through collectives, and
    the peer that moved on is not in one. The store (rank 0's TCP server that set the processes up) answers whoever
    still runs, and the thread keeps publishing while the main thread is blocked. The training step pays a few
    attribute assignments per phase; the thread's one ``store.set`` a second runs outside the GIL."""

    def __init__(self, timeout: float | None, base_timeout: timedelta | None = None, interval: float = 1.0) -> None:
        self.timeout, self.interval = timeout, interval
        self._base = base_timeout  # the process group's own timeout (FSDP2Strategy(timeout=...)): restored by start()
        self._store: Any = None
        self._phase: tuple[str, int] | None = None  # (method, its count): what this rank is doing now
        self._since = time.monotonic()  # when the current phase began
        self._counts: dict[str, int] = {}
        self._saving = 0  # phases of a save entered and not left (the collectives of a save run in inner phases)
        self._seq = 0  # phases entered between steps (outermost): in lockstep every rank enters the same ones
        self._trail = 0  # a checksum of the outermost phases entered, in order: equal on ranks that ran the same ones
        self._trails: dict[int, int] = {0: 0}  # the trail after each recent seq: compared with a peer's at its seq
        self._outer: str | None = None  # the outermost phase this rank is in (None: between steps)
        self._opened: int | None = None  # training_step calls when the Trainer's optimizer step began the next batch
        self._lost: dict[str, Any] | None = None  # where this rank's first failed collective waited, as published
        self._armed = False
        self._final: str | None = None  # this rank's last word (finished, stopped by ...) once published
        self._groups: Callable[[], Sequence[Any]] = tuple
        self._stop: threading.Event | None = None  # made by start(): neither it nor the thread is pickled
        self._thread: threading.Thread | None = None
        self._lock: Any = None  # made by start(): the thread and a failing step publish in turn

    def __getstate__(self) -> dict[str, Any]:
        # The strategy is pickled by Lightning's spawn launcher before any process group exists: nothing live goes.
        state = dict(self.__dict__)
        state.update(_store=None, _stop=None, _thread=None, _groups=tuple, _lock=None)
        return state

    @property
    def active(self) -> bool:
        return self._store is not None

    def start(self, groups: Callable[[], Sequence[Any]] = tuple) -> None:
        """After the process group started (each ``fit``/``validate``), on every rank: the process group's own
        timeout back on the default group, ``setting up`` published, a fresh thread. ``groups()``: the process groups
        (besides the default one) whose timeout is lowered from the second step (the mesh's, which
        ``device_mesh="auto"`` builds only with the model)."""
        if self.timeout is None or not dist.is_initialized() or dist.get_world_size() == 1:
            return
        self._halt()
        if self._base is not None:  # a previous run in this process may have lowered it
            dist.distributed_c10d._set_pg_timeout(self._base, None)
        self._store = dist.PrefixStore("lightning_fsdp2/peers/", dist.distributed_c10d._get_default_store())
        self._groups, self._counts, self._armed, self._final, self._phase = groups, {}, False, None, None
        self._lost = self._opened = self._outer = None
        self._seq, self._trail, self._trails, self._lock = 0, 0, {0: 0}, threading.Lock()
        self._publish("setting up")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(self._stop,), name="lightning_fsdp2-peer-watch",
                                        daemon=True)
        self._thread.start()

    def stop(self, state: str) -> None:
        """Publish ``state`` (``finished``, ``stopped by ValueError``) as this rank's last word, unless one is
        published already (a failed run's teardown does not overwrite why it failed), and stop the thread. Phases
        are still watched (a save after ``fit``: the lowered timeout stays until the next start), and the peers'
        states still read."""
        if not self.active or self._final is not None:
            return
        self._halt()
        self._final, self._phase = state, None
        try:
            self._publish(state)
        except Exception:  # noqa: BLE001 - the store is gone (rank 0 exited): nobody is left to read it
            pass

    def _halt(self) -> None:
        """Stop the thread and wait for it, so that it publishes nothing after the state published next."""
        if self._stop is not None:
            self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.interval)
        self._stop = self._thread = None

    @contextmanager
    def phase(self, method: str, begins_batch: bool = False) -> Iterator[None]:
        """Run the block as ``method`` (counted); a collective failing in it raises :class:`PeerLostError`.
        ``begins_batch``: the phase, entered between steps, begins the next training batch before its
        ``training_step`` does (the Trainer's optimizer step, whose closure runs the training step)."""
        if not self.active:
            yield
            return
        count = self._counts[method] = self._counts.get(method, 0) + 1
        if method in ("training_step", "backward") and count == 2 and not self._armed:
            self._arm()
        outermost = self._phase is None
        if outermost:
            self._seq, self._outer = self._seq + 1, method
            self._trail = zlib.crc32(f"{self._trail}:{method}".encode())  # not hash(): it differs between processes
            self._trails[self._seq] = self._trail
            self._trails.pop(self._seq - _TRAILS_KEPT, None)
            if method in _TRAINING:  # a later training batch: a PeerLostError that user code caught lies behind it
                self._lost = None
        opens = begins_batch and outermost
        if opens:
            self._opened = self._counts.get("training_step", 0)
        (outer, since), self._phase, self._since = (self._phase, self._since), (method, count), time.monotonic()
        self._saving += method in _SAVING
        went_on = False
        try:
            with peer_lost(self.report):
                yield
            went_on = True
        finally:
            self._phase, self._since = outer, since
            self._saving -= method in _SAVING
            if outermost:
                self._outer = None
                if went_on:  # a PeerLostError inside it was caught by user code: the rank went on, and says where
                    self._lost = None
            if opens:
                self._opened = None

    def report(self, err: BaseException) -> str:
        """What this rank was doing, what torch said, and what every other rank last published."""
        rank, now, waited = dist.get_rank(), time.time(), time.monotonic() - self._since
        mine = self._describe(self._phase)
        if self._lost is None:  # the first failure is where the ranks parted; what follows are its consequences
            self._lost = {**self._where(), "phase": f"{mine}: its collective failed (PeerLostError)"}
            try:  # at once: the rank may exit before the thread's next beat (Fabric has no hook for its failure)
                self._publish()
            except Exception:  # noqa: BLE001 - the store is gone (rank 0 exited): nobody is left to read it
                pass
        peers, unreadable = {}, None
        try:
            keys = [str(r) for r in range(dist.get_world_size()) if r != rank]
            present = [k for k in keys if self._store.check([k])]
            for key, value in zip(present, self._store.multi_get(present) if present else []):
                peers[int(key)] = json.loads(value)
        except Exception as failure:  # noqa: BLE001 - rank 0 (the store's server) may be gone
            unreadable = f"{type(failure).__name__}: {str(failure).strip()[:200]}"
        seen = []
        for peer, state in sorted(peers.items()):
            ago = now - state["time"]
            silent = ago > 10 * self.interval + 5 and not state["final"]
            seen.append(f"rank {peer}: {state['phase'].rstrip('.')}" + (
                f" (not heard from for {ago:.0f} s: the process died, or hangs outside Python)" if silent else ""))
        if unreadable:
            seen.append(f"the other ranks' states could not be read: rank 0, whose store holds them, has probably"
                        f" exited ({unreadable})")
        hint = self._hint(list(peers.values()), unreadable is not None)
        bound = (f" (the bound: {self._bound():g} s, FSDP2Strategy(peer_timeout=...))" if self._armed else "")
        return (
            f"Rank {rank} waited in a collective ({mine}), and it failed {waited:.0f} s after that phase began{bound}"
            f" (time in this rank's own code included): another rank did not take part. Last seen: {'; '.join(seen) or 'no other rank published its state'}. {hint} Torch"
            f" reported: {torch_said(err)}"
        )

    def _hint(self, theirs: list[dict], unreadable: bool) -> str:
        """Which case the peers' last states point to. In lockstep every rank enters the same phases in the same order
        (:func:`_position`): a peer may be behind this rank (still in its own code), but a peer past the phase this
        rank waits in, in another phase at the same count, finished, or failed waiting elsewhere ran other collectives
        than this rank. A rank whose own collective failed (``lost``) is a consequence, not a cause: it counts where
        it waited."""
        failed = [t for t in theirs if t["final"] and t["phase"].startswith("stopped by") and not t["lost"]]
        if failed:
            return "Another rank stopped with an error: its own message (in its log) is the cause."
        if unreadable:
            return ("If rank 0 stopped with an error, its own message (in its log) is the cause; if it finished, it ran"
                    " fewer collectives than this rank: every rank must run the same ones.")
        here, mine = _position(self._where()), self._outer

        def past(t: dict) -> bool:
            return (t["final"] and not t["lost"]) or _position(t) > here

        def other_path(t: dict) -> bool:  # it entered other phases than this rank did, up to where it is
            then = self._trails.get(t["seq"]) if t["seq"] <= self._seq else None
            return then is not None and t.get("trail") is not None and t["trail"] != then

        elsewhere = [t for t in theirs if past(t) or (_position(t) == here and t["method"] != mine)
                     or (t["lost"] and _position(t) != here) or other_path(t)]
        if elsewhere:
            if self._saving and any(past(t) and not t["saving"] for t in elsewhere):
                return ("Every rank must call trainer.save_checkpoint (and fabric.save): the shards come from all of"
                        " them; on rank 0 alone, the others never send theirs. (If every rank calls it, one is late:"
                        " its own work after its run; make it shorter or raise peer_timeout.)")
            return ("A rank moved on without this step's collectives: every rank must run the same steps. An"
                    " exception caught on some ranks only (a try/except in training_step or a callback), a"
                    " training_step that returns None on some ranks only, a different number of batches per rank, or"
                    " a collective between steps on some ranks only (a self.log(..., sync_dist=True), a validation, a"
                    " barrier or a save under an `if`) does this. Let the exception propagate (then every rank"
                    " stops), or skip a batch (or run the collective) on every rank alike.")
        behind = [t for t in theirs if _position(t) < here]
        if behind:
            # Only a peer one position behind may have skipped this phase: it entered the same ones up to it.
            if mine not in _TRAINING and any(t["method"] is None and not t["lost"] and _position(t) == here - 1
                                             for t in behind):
                # Between steps, it has not reached this phase, or it skipped it and waits in a collective that is no
                # phase (Lightning's own broadcast before each batch): what it published cannot tell which.
                return ("Another rank was between steps: it has not reached this collective yet (slow or stuck in its"
                        " own code, e.g. rank-0-only work before validation: make it shorter or raise peer_timeout),"
                        " or it went past it without taking part (a self.log(..., sync_dist=True), a validation or a"
                        " barrier run on some ranks only): every rank must run the same collectives.")
            return ("Another rank was behind this one: it is slow or stuck in its own code (not in a collective), or"
                    " its step takes longer than the bound (raise peer_timeout); or this rank skipped collectives"
                    " that it ran (then its own message says so).")
        if any(t["lost"] for t in theirs):
            return "Another rank failed waiting at the same point: its own message (in its log) says for whom."
        return ("The ranks were at the same point: one is slow or stuck in its own code (not in a collective), or"
                " its step takes longer than the bound: raise peer_timeout.")

    def _bound(self) -> float:
        """The lowered timeout: ``peer_timeout``, or the process group's own where that is shorter."""
        base = self._base.total_seconds() if self._base is not None else float("inf")
        return min(self.timeout, base)  # type: ignore[type-var]

    def _arm(self) -> None:
        self._armed = True
        bound = timedelta(seconds=self._bound())
        for group in [None, *self._groups()]:
            dist.distributed_c10d._set_pg_timeout(bound, group)

    def _batch(self) -> int:
        """Training batches begun: ``training_step`` calls (the Trainer; one more in an optimizer step whose closure
        has not run it yet), else ``backward`` calls (Fabric), one more inside a forward (Fabric's: it begins the
        batch that its ``backward`` counts)."""
        steps = self._counts.get("training_step", 0)
        if steps or self._opened is not None:
            return steps + (steps == self._opened)
        return self._counts.get("backward", 0) + (self._phase is not None and self._phase[0] == "forward")

    def _describe(self, phase: tuple[str, int] | None) -> str:
        batch = self._batch()
        at = f"training batch {batch}" if batch else "before training"
        if phase is None:
            return f"between steps ({at} done)" if batch else "setting up"
        method, _ = phase
        if self._saving and method not in _SAVING:
            method = "save_checkpoint"  # a collective of the save (its broadcast, its gathers)
        return f"{_PHASES.get(method, f'in {method}')} ({at})"

    def _where(self) -> dict[str, Any]:
        """This rank's state as the peers read it (besides its time and whether it is final)."""
        return {"phase": self._describe(self._phase), "seq": self._seq, "trail": self._trail,
                "method": self._outer, "saving": bool(self._saving)}

    def _publish(self, state: str | None = None, unless: threading.Event | None = None) -> None:
        # Once a collective of this rank failed, it publishes where (also while its error unwinds, and under Fabric,
        # which has no hook for it), so that no peer reads the unwound state as a rank that fell behind. One record
        # at a time: the thread's beat must not overwrite a failing step's record with an older state.
        with self._lock:
            if unless is not None and unless.is_set():
                return
            lost = self._lost
            where = {**(self._where() if lost is None else lost), "lost": lost is not None}
            final = state != "setting up" if state is not None else self._final is not None
            text = json.dumps({**where, "phase": state or where["phase"], "time": time.time(), "final": final})
            self._store.set(str(dist.get_rank()), text)

    def _beat(self, stop: threading.Event) -> None:
        while not stop.wait(self.interval):
            try:
                self._publish(unless=stop)
            except Exception:  # noqa: BLE001 - the store is gone (rank 0 exited): nothing left to tell
                return


def _position(state: dict[str, Any]) -> int:
    """A rank's progress as one number: inside its k-th phase (entered between steps: a training step, a validation
    step, a barrier, a save) comes after the (k-1)-th is done, and before the k-th is."""
    return 2 * state["seq"] - (state["method"] is not None)



def watched(method: Callable[..., Any]) -> Callable[..., Any]:
    """A strategy method run as a :meth:`PeerWatch.phase` of its own name (the strategy's ``_peer_watch``)."""

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._peer_watch.phase(method.__name__):
            return method(self, *args, **kwargs)

    return run
