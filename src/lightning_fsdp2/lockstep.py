"""Where each rank is, so that a collective that fails for want of a peer names the cause: :class:`PeerWatch`.

Each rank keeps the stack of the strategy's phases (``training_step``, ``backward``, a save...) it is in and counts
them; :class:`~.peer_board.PeerBoard` publishes that record in the process group's store, from a thread, once a
second. From the second training step on the process groups' timeout is lowered to ``peer_timeout``; a collective
that then fails raises :class:`~.peer_lost.PeerLostError` with this rank's phase, every other rank's last published
one, and which case they point to (:func:`relation`: a rank behind, stuck in its own code; a rank that moved on
without this step's collectives; a rank that failed first).
"""

from __future__ import annotations

import functools
import time
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from datetime import timedelta
from typing import Any, NamedTuple

import torch.distributed as dist

from lightning_fsdp2.peer_board import PeerBoard
from lightning_fsdp2.peer_lost import peer_lost, torch_said


_SAVING = ("lightning_module_state_dict", "optimizer_state", "save_checkpoint")
# The phases of a training batch (Fabric's forwards included). Any other phase entered between steps (a barrier, a
# reduce, a validation step, a save) is one that some ranks may skip, or reach late.
_TRAINING = ("training_step", "backward", "optimizer_step", "forward")
_ARMING = ("training_step", "backward")  # the second of either (the Trainer's, Fabric's) lowers the timeout
_TRAILS_KEPT = 1024  # seqs whose trail a rank keeps: a peer further behind is told apart by position alone
_PHASES = {  # the strategy's methods, as a user knows them
    "lightning_module_state_dict": "saving a checkpoint", "optimizer_state": "saving a checkpoint",
    "save_checkpoint": "saving a checkpoint", "load_checkpoint": "loading a checkpoint",
    "load_model_state_dict": "loading a checkpoint", "load_optimizer_state_dict": "loading a checkpoint",
    "forward": "in the model's forward",
}
# What a peer's record is to this rank's (:func:`relation`). The first three: it ran other collectives than this rank.
FAILED, FINISHED, AHEAD, DIVERGED = "failed", "finished", "ahead", "diverged"
BETWEEN, BEHIND, FAILED_HERE, SAME_PLACE = "between", "behind", "failed here", "same place"


class _Entered(NamedTuple):
    """A phase this rank entered and has not left (a tuple: the thread reads the stack while the step changes it)."""

    method: str
    since: float  # time.monotonic() when it was entered: a failure in it says how long after
    # The training batch it begins, when it begins one before its training_step does (the Trainer's optimizer step:
    # its closure runs the training step). Counts cannot tell: Fabric's optimizer step comes after its batch.
    opens: int | None = None


class PeerWatch:
    """This rank's phases, published to the process group's store every ``interval`` seconds (:class:`PeerBoard`);
    from the second training step on, the process groups' timeout lowered to ``timeout`` (torchtitan's
    ``train_timeout_seconds``: the first step may compile and warm up for longer); and a collective that fails inside
    a phase re-raised as :class:`PeerLostError`, naming what the other ranks last published. The training step pays
    a few attribute assignments per phase."""

    def __init__(self, timeout: float | None, base_timeout: timedelta | None = None, interval: float = 1.0) -> None:
        self.timeout = timeout
        self._base = base_timeout  # the process group's own timeout (FSDP2Strategy(timeout=...)): restored by start()
        self._board = PeerBoard(interval)
        self._groups: Callable[[], Sequence[Any]] = tuple
        self._counts: dict[str, int] = {}  # calls of each phase since start()
        self._stack: tuple[_Entered, ...] = ()  # the phases this rank is in, outermost first (empty: between steps)
        # Phases entered between steps (outermost), and a checksum of them in order: in lockstep every rank enters the
        # same ones, so equal counts with other checksums mean other collectives. One tuple: the thread reads it.
        self._at = (0, 0)
        self._trails: dict[int, int] = {0: 0}  # the checksum after each recent count, for a peer's at its count
        self._lost: dict[str, Any] | None = None  # where this rank's first failed collective waited, as published
        self._final: str | None = None  # this rank's last word (finished, stopped by ...) once published

    def __getstate__(self) -> dict[str, Any]:
        # The strategy is pickled by Lightning's spawn launcher before any process group exists: nothing live goes
        # (the board drops its own).
        return {**self.__dict__, "_groups": tuple}

    @property
    def active(self) -> bool:
        return self._board.active

    def start(self, groups: Callable[[], Sequence[Any]] = tuple) -> None:
        """After the process group started (each ``fit``/``validate``), on every rank: the process group's own
        timeout back on the default group, ``setting up`` published, a fresh thread. ``groups()``: the process groups
        (besides the default one) whose timeout is lowered from the second step (the mesh's, which
        ``device_mesh="auto"`` builds only with the model)."""
        if self.timeout is None or not dist.is_initialized() or dist.get_world_size() == 1:
            return
        self._board.halt()
        if self._base is not None:  # a previous run in this process may have lowered it
            dist.distributed_c10d._set_pg_timeout(self._base, None)
        self._groups, self._counts, self._stack, self._lost, self._final = groups, {}, (), None, None
        self._at, self._trails = (0, 0), {0: 0}
        self._board.start(self._record)

    def stop(self, state: str) -> None:
        """Publish ``state`` (``finished``, ``stopped by ValueError``) as this rank's last word, unless one is
        published already (a failed run's teardown does not overwrite why it failed), and stop the thread. Phases
        are still watched (a save after ``fit``: the lowered timeout stays until the next start), and the peers'
        states still read."""
        if not self.active or self._final is not None:
            return
        self._board.halt()
        self._final = state
        with suppress(Exception):  # the store is gone (rank 0 exited): nobody is left to read it
            self._board.publish(lambda: {**self._record(), "phase": state})

    @contextmanager
    def phase(self, method: str, begins_batch: bool = False) -> Iterator[None]:
        """Run the block as ``method`` (counted); a collective failing in it raises :class:`PeerLostError`.
        ``begins_batch``: the phase, entered between steps, begins the next training batch before its
        ``training_step`` does (the Trainer's optimizer step, whose closure runs the training step)."""
        if not self.active:
            yield
            return
        armed = self._armed
        self._counts[method] = self._counts.get(method, 0) + 1
        if not armed and self._armed:  # this phase is the second training step (or backward): lower the timeout
            self._arm()
        outer = self._stack
        if not outer:  # entered between steps
            seq, trail = self._at
            self._at = seq + 1, zlib.crc32(f"{trail}:{method}".encode())  # not hash(): it differs between processes
            self._trails[seq + 1] = self._at[1]
            self._trails.pop(seq + 1 - _TRAILS_KEPT, None)
            if method in _TRAINING:  # a later training batch: a PeerLostError that user code caught lies behind it
                self._lost = None
        opens = self._counts.get("training_step", 0) + 1 if begins_batch and not outer else None
        self._stack = (*outer, _Entered(method, time.monotonic(), opens))
        try:
            with peer_lost(self.report):
                yield
        finally:
            self._stack = outer
        if not outer:  # reached only when the block ended normally: a PeerLostError caught by user code inside it
            self._lost = None  # lies behind this rank, which went on, and says where it is now

    def report(self, err: BaseException) -> str:
        """What this rank was doing, what torch said, and what every other rank last published."""
        rank, now, waited = dist.get_rank(), time.time(), time.monotonic() - self._stack[-1].since
        mine = self._describe(self._stack)
        if self._lost is None:  # the first failure is where the ranks parted; what follows are its consequences
            self._lost = {**self._where(), "phase": f"{mine}: its collective failed (PeerLostError)"}
            # At once: the rank may exit before the thread's next beat (Fabric has no hook for its failure).
            with suppress(Exception):  # the store is gone (rank 0 exited): nobody is left to read it
                self._board.publish(self._record)
        peers, unreadable = self._board.read()
        seen = []
        for peer, state in sorted(peers.items()):
            ago = now - state["time"]
            silent = ago > 10 * self._board.interval + 5 and not state["final"]
            seen.append(f"rank {peer}: {state['phase'].rstrip('.')}" + (
                f" (not heard from for {ago:.0f} s: the process died, or hangs outside Python)" if silent else ""))
        if unreadable:
            seen.append(f"the other ranks' states could not be read: rank 0, whose store holds them, has probably"
                        f" exited ({unreadable})")
        hint = self._hint(list(peers.values()), unreadable is not None)
        bound = (f" (the bound: {self._bound():g} s, FSDP2Strategy(peer_timeout=...))" if self._armed else "")
        last_seen = "; ".join(seen) or "no other rank published its state"
        return (
            f"Rank {rank} waited in a collective ({mine}), and it failed {waited:.0f} s after that phase began{bound}"
            f" (time in this rank's own code included): another rank did not take part. Last seen: {last_seen}."
            f" {hint} Torch reported: {torch_said(err)}"
        )

    def _hint(self, theirs: list[dict[str, Any]], unreadable: bool) -> str:
        """The message for the peers' relations to this rank (:func:`relation`), the most telling first: a peer that
        failed on its own is the cause; one that ran other collectives explains this rank's wait more surely than one
        that is merely behind; a peer whose own wait failed here is a consequence."""
        mine = self._where()
        related = [(t, relation(mine, t, self._trails)) for t in theirs]
        found = {r for _, r in related}
        if FAILED in found:
            return "Another rank stopped with an error: its own message (in its log) is the cause."
        if unreadable:
            return ("If rank 0 stopped with an error, its own message (in its log) is the cause; if it finished, it ran"
                    " fewer collectives than this rank: every rank must run the same ones.")
        if found & {FINISHED, AHEAD, DIVERGED}:
            if mine["saving"] and any(r in (FINISHED, AHEAD) and not t["saving"] for t, r in related):
                return ("Every rank must call trainer.save_checkpoint (and fabric.save): the shards come from all of"
                        " them; on rank 0 alone, the others never send theirs. (If every rank calls it, one is late:"
                        " its own work after its run; make it shorter or raise peer_timeout.)")
            return ("A rank moved on without this step's collectives: every rank must run the same steps. An"
                    " exception caught on some ranks only (a try/except in training_step or a callback), a"
                    " training_step that returns None on some ranks only, a different number of batches per rank, or"
                    " a collective between steps on some ranks only (a self.log(..., sync_dist=True), a validation, a"
                    " barrier or a save under an `if`) does this. Let the exception propagate (then every rank"
                    " stops), or skip a batch (or run the collective) on every rank alike.")
        if BETWEEN in found:
            return ("Another rank was between steps: it has not reached this collective yet (slow or stuck in its"
                    " own code, e.g. rank-0-only work before validation: make it shorter or raise peer_timeout),"
                    " or it went past it without taking part (a self.log(..., sync_dist=True), a validation or a"
                    " barrier run on some ranks only): every rank must run the same collectives.")
        if BEHIND in found:
            return ("Another rank was behind this one: it is slow or stuck in its own code (not in a collective), or"
                    " its step takes longer than the bound (raise peer_timeout); or this rank skipped collectives"
                    " that it ran (then its own message says so).")
        if FAILED_HERE in found:
            return "Another rank failed waiting at the same point: its own message (in its log) says for whom."
        return ("The ranks were at the same point: one is slow or stuck in its own code (not in a collective), or"
                " its step takes longer than the bound: raise peer_timeout.")

    @property
    def _armed(self) -> bool:
        """Whether the timeout is lowered: from the second training step (the Trainer) or backward (Fabric) on."""
        return any(self._counts.get(method, 0) >= 2 for method in _ARMING)

    def _bound(self) -> float:
        """The lowered timeout: ``peer_timeout``, or the process group's own where that is shorter."""
        base = self._base.total_seconds() if self._base is not None else float("inf")
        return min(self.timeout, base)  # type: ignore[type-var]

    def _arm(self) -> None:
        bound = timedelta(seconds=self._bound())
        for group in [None, *self._groups()]:
            dist.distributed_c10d._set_pg_timeout(bound, group)

    def _batch(self, stack: tuple[_Entered, ...]) -> int:
        """Training batches begun: ``training_step`` calls (the Trainer; one more in an optimizer step whose closure
        has not run it yet), else ``backward`` calls (Fabric), one more inside a forward (Fabric's: it begins the
        batch that its ``backward`` counts)."""
        steps = self._counts.get("training_step", 0)
        opens = stack[0].opens if stack else None
        if steps or opens:
            return max(steps, opens or 0)
        return self._counts.get("backward", 0) + (bool(stack) and stack[-1].method == "forward")

    def _describe(self, stack: tuple[_Entered, ...]) -> str:
        batch = self._batch(stack)
        at = f"training batch {batch}" if batch else "before training"
        if not stack:
            return f"between steps ({at} done)" if batch else "setting up"
        method = stack[-1].method
        if method not in _SAVING and _saving(stack):
            method = "save_checkpoint"  # a collective of the save (its broadcast, its gathers)
        return f"{_PHASES.get(method, f'in {method}')} ({at})"

    def _where(self) -> dict[str, Any]:
        """This rank's state as the peers read it (besides whether it failed or is final, and its time)."""
        stack, (seq, trail) = self._stack, self._at  # once each: the thread calls this while the step runs
        return {"phase": self._describe(stack), "seq": seq, "trail": trail,
                "method": stack[0].method if stack else None, "saving": _saving(stack)}

    def _record(self) -> dict[str, Any]:
        """What the board publishes. Once a collective of this rank failed, where it waited (also while its error
        unwinds, and under Fabric, which has no hook for it), so that no peer reads the unwound state as a rank that
        fell behind."""
        lost = self._lost
        return {**(self._where() if lost is None else lost), "lost": lost is not None, "final": self._final is not None}


def relation(mine: Mapping[str, Any], theirs: Mapping[str, Any], trails: Mapping[int, int] | None = None) -> str:
    """What a peer's record (``theirs``, as read from the store) is to this rank's (``mine``: ``PeerWatch._where``),
    while this rank waits in a collective. ``trails``: this rank's trail after each recent seq (else ``mine``'s own).

    In lockstep every rank enters the same phases in the same order (:func:`_position`), so a peer may be behind this
    rank (still in its own code), but one past the phase this rank waits in (``ahead``), finished (``finished``), in
    another phase at the same position, with another trail at its seq, or failed waiting elsewhere (``diverged``) ran
    other collectives than this rank. ``failed``: it stopped with an error of its own, the cause. ``between``: behind
    by one position, between steps, while this rank waits in a phase between steps (a validation step, a barrier):
    it has not reached it yet, or skipped it. ``behind``; ``failed here``: its own collective failed at this rank's
    position (a consequence); ``same place``. A rank whose collective failed (``lost``) counts where it waited."""
    if theirs["final"] and not theirs["lost"]:
        return FAILED if theirs["phase"].startswith("stopped by") else FINISHED
    here, there = _position(mine), _position(theirs)
    if there > here:
        return AHEAD
    then = (trails or {mine["seq"]: mine["trail"]}).get(theirs["seq"]) if theirs["seq"] <= mine["seq"] else None
    if ((there == here and theirs["method"] != mine["method"]) or (theirs["lost"] and there != here)
            or (then is not None and theirs.get("trail") is not None and theirs["trail"] != then)):
        return DIVERGED
    if there < here:
        # Only a peer one position behind may have skipped this phase: it entered the same ones up to it. Between
        # steps, it has not reached this phase, or it skipped it and waits in a collective that is no phase
        # (Lightning's own broadcast before each batch): what it published cannot tell which.
        skipped = mine["method"] not in _TRAINING and theirs["method"] is None and there == here - 1
        return BETWEEN if skipped else BEHIND
    return FAILED_HERE if theirs["lost"] else SAME_PLACE


def _position(state: Mapping[str, Any]) -> int:
    """A rank's progress as one number: inside its k-th phase (entered between steps: a training step, a validation
    step, a barrier, a save) comes after the (k-1)-th is done, and before the k-th is."""
    return 2 * state["seq"] - (state["method"] is not None)


def _saving(stack: tuple[_Entered, ...]) -> bool:
    """Inside a save (the collectives of a save run in its inner phases)."""
    return any(entered.method in _SAVING for entered in stack)


def watched(method: Callable[..., Any]) -> Callable[..., Any]:
    """A strategy method run as a :meth:`PeerWatch.phase` of its own name (the strategy's ``_peer_watch``)."""

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._peer_watch.phase(method.__name__):
            return method(self, *args, **kwargs)

    return run
