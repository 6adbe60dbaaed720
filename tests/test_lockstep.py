"""A forward that only rank 0 runs fails within the bound on both ranks, with a message naming the cause
(``forward_guard.py``); forwards every rank runs together are not disturbed. A collective a peer never joins fails
within ``peer_timeout``, naming where every rank was (``lockstep.py``, ``peer_lost.py``)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_fsdp2.lockstep import (
    AHEAD, BEHIND, BETWEEN, DIVERGED, FAILED, FAILED_HERE, FINISHED, SAME_PLACE, PeerWatch, relation,
)
from tests.helpers import run_distributed
from tests.models import LlamaModule, quiet_trainer_kwargs, tiny_llama_config, world

BOUND = 5.0


def _rank0_samples_alone(how: str, out: str) -> None:
    """LitGPT's `if fabric.global_rank == 0: generate_example(...)`, then both ranks go on training."""
    from transformers import LlamaForCausalLM

    from lightning_fsdp2.fabric import FSDP2Strategy

    fabric = L.Fabric(accelerator="cpu", devices=world(),
                      strategy=FSDP2Strategy(unmatched_forward_timeout=BOUND))
    fabric.launch()
    with fabric.init_module():
        model = LlamaForCausalLM(tiny_llama_config())
    model = fabric.setup_module(model)
    prompt = torch.tensor([[1, 2, 3]])
    with torch.no_grad():  # every rank together: passes
        model.generate(prompt, max_new_tokens=2, do_sample=False)
    batch = torch.randint(0, 128, (2, 8))
    fabric.backward(model(input_ids=batch, labels=batch).loss)  # a training step: the root is sharded again after it
    start = time.monotonic()
    outcome: dict[str, Any] = {}
    try:
        if fabric.global_rank == 0:
            model.eval()
            with torch.no_grad():
                if how == "generate":
                    model.generate(prompt, max_new_tokens=3, do_sample=False)
                else:  # a hand-written sampling loop, as LitGPT's generate()
                    model(input_ids=prompt)
            model.train()
        fabric.backward(model(input_ids=batch, labels=batch).loss)  # the next training step
        outcome["error"] = None
    except Exception as err:  # noqa: BLE001 - the test reads what each rank saw
        outcome["error"], outcome["type"] = str(err), type(err).__name__
        raise
    finally:
        outcome["elapsed"] = time.monotonic() - start
        Path(out, f"{fabric.global_rank}.json").write_text(json.dumps(outcome))


@pytest.mark.parametrize("how", ["generate", "forward"])
def test_a_forward_on_rank_0_alone_fails_within_the_bound_on_both_ranks(how: str, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError):
        run_distributed(_rank0_samples_alone, 2, how, str(tmp_path), timeout=120)
    rank0 = json.loads((tmp_path / "0.json").read_text())
    rank1 = json.loads((tmp_path / "1.json").read_text())
    assert "every rank must run it" in rank0["error"], rank0["error"]
    assert "unmatched_forward_timeout" in rank0["error"]
    assert rank0["type"] == "PeerLostError", rank0  # the forward's peer-watch phase passed it on as it is
    assert BOUND - 0.5 <= rank0["elapsed"] <= BOUND + 10, rank0["elapsed"]
    # Rank 1 went on to its training step, whose all-gathers rank 0 never joins: it fails once rank 0 has exited,
    # not at the process group's timeout (30 minutes).
    assert rank1["error"], rank1
    assert rank1["elapsed"] <= BOUND + 30, rank1["elapsed"]


def _together() -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    from lightning_fsdp2.fabric import FSDP2Strategy

    fabric = L.Fabric(accelerator="cpu", devices=world(), strategy=FSDP2Strategy(unmatched_forward_timeout=BOUND))
    fabric.launch()
    torch.manual_seed(0)
    with fabric.init_module():
        model = LlamaForCausalLM(tiny_llama_config())
    model = fabric.setup_module(model)
    with torch.no_grad():
        tokens = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False)
    return {"tokens": tokens}


def test_forwards_every_rank_runs_pass_the_check() -> None:
    ranks = run_distributed(_together, 2)
    assert torch.equal(ranks[0]["tokens"], ranks[1]["tokens"])


@pytest.mark.parametrize(("value", "kind"), [(0, ValueError), (-1, ValueError), ("60", TypeError), (True, TypeError)])
def test_unmatched_forward_timeout_is_checked_at_construction(value: Any, kind: type) -> None:
    from lightning_fsdp2 import FSDP2Strategy

    with pytest.raises(kind, match="unmatched_forward_timeout"):  # a bad value; another type (every option's rule)
        FSDP2Strategy(unmatched_forward_timeout=value)


# ------------------------------------------------------------------------------- how a peer's record is read
def _record(seq: int, method: str | None = None, **more: Any) -> dict[str, Any]:
    """A record as a rank publishes it: ``seq`` phases entered between steps, inside the last one (``method``, its
    outermost phase) or done with it (None)."""
    return {"phase": "in it", "seq": seq, "trail": 0, "method": method, "saving": False, "lost": False,
            "final": False, **more}


_IN_STEP = _record(3, "training_step")  # waiting in the 3rd phase entered between steps, a training step
_IN_VALIDATION = _record(5, "validation_step")  # waiting in a validation step (a phase some ranks may skip)


@pytest.mark.parametrize(("mine", "theirs", "expected"), [
    (_IN_STEP, _record(3, "training_step"), SAME_PLACE),
    (_IN_STEP, _record(3, "validation_step"), DIVERGED),  # another phase at the same count: other collectives
    (_IN_STEP, _record(3), AHEAD),  # done with the phase this rank waits in
    (_IN_STEP, _record(4, "training_step"), AHEAD),
    (_IN_STEP, _record(3, "training_step", trail=7), DIVERGED),  # the same count after other phases
    (_IN_STEP, _record(2), BEHIND),  # between steps before it
    (_IN_STEP, _record(2, "training_step"), BEHIND),
    (_IN_VALIDATION, _record(4), BETWEEN),  # not there yet, or skipped the validation step: cannot tell
    (_IN_VALIDATION, _record(3), BEHIND),  # further behind: it has phases to enter before this one
    (_IN_VALIDATION, _record(4, "training_step"), BEHIND),  # in a step: it has not skipped anything yet
    (_IN_STEP, _record(3, "training_step", lost=True), FAILED_HERE),  # its wait failed here: a consequence
    (_IN_STEP, _record(2, "training_step", lost=True), DIVERGED),  # its wait failed elsewhere
    (_IN_STEP, _record(4, "training_step", lost=True), AHEAD),
    (_IN_STEP, _record(3, phase="finished (its run ended)", final=True), FINISHED),
    (_IN_STEP, _record(1, phase="finished (its run ended)", final=True), FINISHED),  # behind, yet it ended
    (_IN_STEP, _record(2, phase="stopped by ValueError (bad...)", final=True), FAILED),  # the cause
    # The Trainer's last word after a PeerLostError: where it waited counts, not that it stopped.
    (_IN_STEP, _record(3, "training_step", phase="stopped by PeerLostError (...)", final=True, lost=True),
     FAILED_HERE),
])
def test_a_peers_record_is_related_to_this_ranks(mine: dict[str, Any], theirs: dict[str, Any], expected: str) -> None:
    assert relation(mine, theirs) == expected


def test_a_peer_behind_is_compared_with_this_ranks_trail_at_its_count() -> None:
    """Behind by position, a peer is behind only if it entered the same phases as this rank up to there (its trail
    equals this rank's at its count); a count whose trail this rank no longer keeps is told by position alone."""
    mine, trails = _record(3, "training_step", trail=30), {2: 20, 3: 30}
    assert relation(mine, _record(2, trail=20), trails) == BEHIND
    assert relation(mine, _record(2, trail=99), trails) == DIVERGED
    assert relation(mine, _record(1, trail=99), trails) == BEHIND


def test_the_watch_pickles_without_its_live_parts() -> None:
    """Lightning's spawn launcher pickles the strategy before any process group exists: the watch drops the mesh's
    groups (a closure over the strategy), the board its store, lock and thread."""
    import pickle
    import threading

    watch = PeerWatch(7)
    watch._groups = lambda: [threading.Lock()]
    watch._board._lock, watch._board._stop = threading.Lock(), threading.Event()
    copy = pickle.loads(pickle.dumps(watch))
    assert copy.timeout == 7 and copy._groups() == () and not copy.active
    assert copy._board._lock is None and copy._board._stop is None


# ------------------------------------------------------------------------------- a peer that stopped taking part
class _Misbehaving(LlamaModule):
    """Rank 1 misbehaves at its third batch: ``stuck`` sleeps in its own code (4 bounds); ``swallow`` raises and
    catches an error, returning a loss the model took no part in (no all-gather, no reduce-scatter for that batch),
    and goes on to Lightning's broadcast before the next batch while rank 0 waits in the batch's all-gathers: either
    rank's wait may time out first (``swallow-late``: rank 1's, rank 0 being slow to reach its all-gathers)."""

    def __init__(self, how: str) -> None:
        super().__init__(lora=True)
        self.how = how

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor | None:
        if self.global_rank == 1 and batch_idx == 2:
            if self.how == "stuck":
                time.sleep(4 * BOUND)
            elif self.how.startswith("swallow"):
                try:
                    raise ValueError("a bad batch")
                except ValueError:
                    return torch.zeros((), requires_grad=True)  # "skip it": a loss the model took no part in
        if self.global_rank == 0 and batch_idx == 2 and self.how == "swallow-late":
            time.sleep(1.5 * BOUND)  # rank 1's wait (in Lightning's per-step broadcast) times out first
        return super().training_step(batch, batch_idx)

    def on_train_epoch_end(self) -> None:
        if self.global_rank == 0 and self.how == "barrier-alone" and self.current_epoch == 0:
            self.trainer.strategy.barrier()  # a collective between steps on one rank: the other goes on to its save

    def on_validation_start(self) -> None:
        if self.global_rank == 1 and self.how == "slow-validation" and not self.trainer.sanity_checking:
            time.sleep(4 * BOUND)  # a rank's own work between its last training batch and validation


def _misbehave(how: str, out: str) -> None:
    from lightning_fsdp2 import FSDP2Strategy

    module = _Misbehaving(how)
    # "slow-validation": rank 0's validation forward waits in its all-gathers, not in the unmatched-forward check.
    unmatched = None if how == "slow-validation" else 60
    kwargs = quiet_trainer_kwargs()
    if how == "barrier-alone":  # ModelCheckpoint saves at the epoch's end, after the LightningModule's hook
        kwargs.update(enable_checkpointing=True, default_root_dir=out)
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=6, **kwargs,
                        strategy=FSDP2Strategy(peer_timeout=BOUND, unmatched_forward_timeout=unmatched))
    _timed(lambda: trainer.fit(module), out, trainer.global_rank, lambda: how in ("save", "adapter"))
    if how in ("save", "adapter"):  # after fit, rank 0 alone saves (`if trainer.is_global_zero: ...`)
        if trainer.global_rank == 0:
            from lightning_fsdp2.lora import save_adapter

            save = (lambda: trainer.save_checkpoint(Path(out, "model.ckpt"))) if how == "save" else (
                lambda: save_adapter(module, Path(out, "adapter")))
            _timed(save, out, 0)
        else:
            time.sleep(4 * BOUND)  # then the helper's closing barrier: rank 0 has long failed


def _timed(run: Any, out: str, rank: int, quiet: Any = lambda: False) -> None:
    start = time.monotonic()
    outcome: dict[str, Any] = {"error": None}
    try:
        run()
    except Exception as err:  # noqa: BLE001 - the test reads what each rank saw
        outcome["error"], outcome["type"] = str(err), type(err).__name__
        raise
    finally:
        outcome["elapsed"] = time.monotonic() - start
        if not quiet():
            Path(out, f"{rank}.json").write_text(json.dumps(outcome))


def _waited(error: str) -> int:
    """The seconds a PeerLostError says its rank waited ("it failed S s after that phase began"): timed from the
    phase, not from a set-up that a loaded machine may slow down."""
    return int(re.search(r"it failed (\d+) s after that phase began", error).group(1))


def _misbehaved(how: str, tmp_path: Path) -> tuple[list[dict[str, Any]], str]:
    """Run :func:`_misbehave` (it fails); each rank's outcome, and all of them as text for assertion messages (every
    word: the assertion's own rendering cuts them)."""
    with pytest.raises(RuntimeError):
        run_distributed(_misbehave, 2, how, str(tmp_path), timeout=180)
    outcomes = _outcomes(tmp_path)
    return outcomes, json.dumps(outcomes, indent=1)


def _outcomes(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.slow  # ~22 s: it waits out the bound
def test_a_rank_stuck_in_its_own_code_is_named_within_the_bound(tmp_path: Path) -> None:
    """Rank 1 sleeps in training_step at batch 3: rank 0, in that batch's all-gathers, raises PeerLostError after
    the bound (not the process group's 30 minutes), saying rank 1 is at the same batch (stuck or slow)."""
    with pytest.raises(RuntimeError):
        run_distributed(_misbehave, 2, "stuck", str(tmp_path), timeout=180)
    rank0, rank1 = _outcomes(tmp_path)
    assert rank0["type"] == "PeerLostError", rank0
    assert "Rank 0 waited in a collective (in training_step (training batch 3))" in rank0["error"], rank0["error"]
    assert "(the bound: 5 s, FSDP2Strategy(peer_timeout=...))" in rank0["error"]
    assert "rank 1: in training_step (training batch 3)" in rank0["error"]
    assert "stuck in its own code" in rank0["error"]
    assert _waited(rank0["error"]) <= 2 * BOUND, rank0  # the bound, not rank 1's sleep (4 bounds)
    # Rank 1, back from its sleep, finds rank 0 (and the store it served) gone, and says so.
    assert rank1["type"] == "PeerLostError" and "rank 0, whose store holds them, has probably exited" in rank1["error"]


def _fabric_stuck(out: str, sleeper: int = 1) -> None:
    """A Fabric loop (forward, backward, step) in which rank ``sleeper`` sleeps in its own code before its third
    forward."""
    from transformers import LlamaForCausalLM

    from lightning_fsdp2.fabric import FSDP2Strategy

    fabric = L.Fabric(accelerator="cpu", devices=world(), strategy=FSDP2Strategy(peer_timeout=BOUND))
    fabric.launch()
    with fabric.init_module():
        model = LlamaForCausalLM(tiny_llama_config())
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=1e-3))
    batch = torch.randint(0, 128, (2, 8))

    def train() -> None:
        for step in range(4):
            if fabric.global_rank == sleeper and step == 2:
                time.sleep(4 * BOUND)
            fabric.backward(model(input_ids=batch, labels=batch).loss)
            optimizer.step()
            optimizer.zero_grad()

    _timed(train, out, fabric.global_rank)


@pytest.mark.slow  # ~22 s: it waits out the bound
def test_under_fabric_a_rank_stuck_before_its_forward_is_named_within_the_bound(tmp_path: Path) -> None:
    """Fabric's forwards are the user's calls: the precision plugin's forward_context (which Fabric's module wrapper
    runs around each) makes them phases. Rank 0, in its third forward's all-gather, raises PeerLostError after the
    bound, saying rank 1 is between steps at the batch before (stuck or slow), not gloo's bare timeout."""
    with pytest.raises(RuntimeError):
        run_distributed(_fabric_stuck, 2, str(tmp_path), timeout=180)
    rank0, rank1 = _outcomes(tmp_path)
    assert rank0["type"] == "PeerLostError", rank0
    assert "Rank 0 waited in a collective (in the model's forward (training batch 3))" in rank0["error"], rank0
    assert "rank 1: between steps (training batch 2 done)" in rank0["error"], rank0["error"]
    assert "stuck in its own code" in rank0["error"], rank0["error"]
    assert _waited(rank0["error"]) <= 2 * BOUND, rank0
    assert rank1["type"] == "PeerLostError", rank1


@pytest.mark.slow  # 4 bounds of sleep
def test_under_fabric_a_rank_whose_wait_failed_first_is_not_taken_for_one_behind(tmp_path: Path) -> None:
    """Rank 0 (the store's host) sleeps before its third forward; rank 1's wait fails first, and it exits. Fabric
    has no hook for a rank's failure: rank 1 publishes where it waited as it fails, so rank 0 reads it at the same
    point (not as "between steps (batch 2 done)", behind rank 0, its unwound state, as its thread published it)."""
    with pytest.raises(RuntimeError):
        run_distributed(_fabric_stuck, 2, str(tmp_path), 0, timeout=180)
    rank0, rank1 = outcomes = _outcomes(tmp_path)
    said = json.dumps(outcomes, indent=1)
    assert rank1.get("type") == "PeerLostError" and "rank 0: between steps (training batch 2 done)" in rank1["error"]
    assert "Another rank was behind this one" in rank1["error"], said
    assert rank0.get("type") == "PeerLostError", said
    assert "rank 1: in the model's forward (training batch 3): its collective failed" in rank0["error"], said
    assert "Another rank failed waiting at the same point" in rank0["error"], said


@pytest.mark.slow  # two bounds of waiting, like the test above
@pytest.mark.parametrize("how", ["swallow", "swallow-late"])
def test_a_rank_that_swallowed_an_error_and_moved_on_is_named(how: str, tmp_path: Path) -> None:
    """Rank 1 catches an error in training_step at batch 3 and skips that batch's collectives: the rank left waiting
    (rank 0, in batch 3) raises within the bound saying a rank moved on, whichever rank's wait failed first: rank 1,
    having failed first, is published as failed at batch 4, past rank 0, not as the cause. (Once, in CI, rank 0 read
    rank 1's failure before its own and blamed it: "Another rank stopped with an error".)"""
    outcomes, said = _misbehaved(how, tmp_path)
    rank0, rank1 = outcomes
    assert rank0.get("type") == "PeerLostError", said
    assert "Rank 0 waited in a collective (in training_step (training batch 3))" in rank0["error"], said
    assert "A rank moved on without this step's collectives" in rank0["error"], said
    assert rank1["error"] and "The ranks were at the same point" not in rank1["error"], said
    if how == "swallow-late":  # the order this case is for: rank 1's wait failed first, in batch 4
        assert ("Rank 1 waited in a collective (in training_step (training batch 4))" in rank0["error"]
                or "rank 1: in training_step (training batch 4): its collective failed" in rank0["error"]), said
    assert all(o["elapsed"] <= 60 for o in outcomes), said


@pytest.mark.slow  # 4 bounds of sleep on rank 1
def test_a_rank_still_before_validation_is_not_taken_for_one_that_moved_on(tmp_path: Path) -> None:
    """Rank 1 does its own work between batch 4 (the epoch's last) and validation; rank 0 waits in a validation
    step's all-gather. Rank 1, between steps, has not entered the validation step: the message says it has not
    reached the collective yet or went past it (skipped it), not that it surely skipped a step (which it said before:
    it read any rank between steps as past one in a phase)."""
    outcomes, said = _misbehaved("slow-validation", tmp_path)
    rank0 = outcomes[0]
    assert rank0.get("type") == "PeerLostError", said
    assert "Rank 0 waited in a collective (in validation_step (training batch 4))" in rank0["error"], said
    assert "rank 1: between steps (training batch 4 done)" in rank0["error"], said
    assert "Another rank was between steps: it has not reached this collective yet" in rank0["error"], said
    assert "A rank moved on" not in rank0["error"], said
    assert _waited(rank0["error"]) <= 2 * BOUND, said


@pytest.mark.slow  # a bound of waiting
def test_a_collective_between_steps_on_one_rank_is_named(tmp_path: Path) -> None:
    """Rank 0 alone calls a barrier at the epoch's end, then both go on to ModelCheckpoint's end-of-epoch work: gloo
    pairs the barrier with another rank's collective, and the ranks end up waiting in the collectives of phases
    entered at different counts, both in batch 4's aftermath. A rank says the other ran other collectives (comparing
    batches alone, they said "the same point" or blamed each other)."""
    outcomes, said = _misbehaved("barrier-alone", tmp_path)
    rank0 = outcomes[0]
    assert rank0.get("type") == "PeerLostError", said
    assert "(training batch 4))" in rank0["error"], said
    for outcome in outcomes:
        assert outcome.get("type") == "PeerLostError", said
        assert "The ranks were at the same point" not in outcome["error"], said
        assert _waited(outcome["error"]) <= 2 * BOUND, said
    # Rank 0 (whose store outlives it) reads rank 1 as having entered other phases than it did (not as behind, which
    # it reads by position alone: rank 0 ran one phase more), whichever rank's wait times out first.
    assert "A rank moved on without this step's collectives" in rank0["error"], said


def _rank0_alone(how: str, tmp_path: Path) -> dict[str, Any]:
    """Run :func:`_misbehave` with rank 0 alone saving after ``fit`` (``how``); what rank 0 saw."""
    with pytest.raises(RuntimeError):
        run_distributed(_misbehave, 2, how, str(tmp_path), timeout=180)
    return json.loads((tmp_path / "0.json").read_text())


@pytest.mark.slow  # ~22 s: it waits out the bound
def test_a_save_on_rank_0_alone_says_every_rank_must_call_it(tmp_path: Path) -> None:
    rank0 = _rank0_alone("save", tmp_path)
    assert rank0["type"] == "PeerLostError", rank0
    assert "Every rank must call trainer.save_checkpoint" in rank0["error"], rank0["error"]
    assert "rank 1: finished (its run ended)" in rank0["error"]
    assert rank0["elapsed"] <= 2 * BOUND + 10, rank0
    assert not list(tmp_path.glob("model.ckpt*")), "nothing left behind"


@pytest.mark.slow  # another fit and a bound of waiting
def test_an_adapter_export_on_rank_0_alone_says_every_rank_must_call_it(tmp_path: Path) -> None:
    rank0 = _rank0_alone("adapter", tmp_path)
    assert rank0["type"] == "PeerLostError", rank0
    assert "Every rank must call lora.save_adapter" in rank0["error"], rank0["error"]
    assert rank0["elapsed"] <= 2 * BOUND + 10, rank0
    assert not (tmp_path / "adapter").exists(), "nothing left behind"


def test_the_strategy_still_pickles_for_spawn() -> None:
    """Lightning's spawn launcher pickles the strategy: the watch's thread, event and store are not part of it."""
    import pickle

    from lightning_fsdp2 import FSDP2Strategy
    from lightning_fsdp2.lockstep import PeerWatch

    strategy = pickle.loads(pickle.dumps(FSDP2Strategy(peer_timeout=7)))
    assert isinstance(strategy._peer_watch, PeerWatch) and strategy._peer_watch.timeout == 7
