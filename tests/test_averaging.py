"""Weight averaging (EMA, SWA) of the sharded model: lightning_fsdp2.averaging against Lightning's own callback in one
process, Lightning's own callbacks (given as they are to FSDP2Strategy) against Lightning's DDP, and their state
through both checkpoint formats."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_fsdp2 import FSDP2Strategy
from tests.helpers import run_distributed
from tests.models import LlamaModule, full_state, quiet_trainer_kwargs
from tests.test_strategy import _assert_same_weights, _start_state

# Two steps per epoch at any world size: 16 samples, 8 per optimizer step.
STEPS = dict(n_samples=16, lr=5e-2)


def _trainer(world: int, **kwargs) -> dict:
    return dict(accelerator="cpu", devices=world, limit_val_batches=1, num_sanity_val_steps=0,
                **{**quiet_trainer_kwargs(), **kwargs})


def _fit_sharded_ema(start: dict, epochs: int, save_dir: str | None = None, resume: str | None = None,
                     fmt: str = "full", variant: str = "") -> dict:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_fsdp2.averaging import EMAWeightAveraging

    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else int(
        __import__("os").environ["WORLD_SIZE"])
    # The start state is loaded at on_fit_start, before a checkpoint is restored: a resumed run then gets the frozen
    # base from it, as from load_pretrained, when the checkpoint holds only the trainable parameters.
    module = LlamaModule(start_state=start, batch_size=8 // world, **STEPS, **_config(variant))
    callbacks = [EMAWeightAveraging(decay=0.5)]
    if save_dir:
        callbacks.append(ModelCheckpoint(dirpath=save_dir, filename="{epoch}", every_n_epochs=1, save_top_k=-1))
    strategy = FSDP2Strategy(state_dict_type="full" if fmt == "full" else "sharded", async_save=fmt == "async",
                             save_trainable_only=variant == "trainable-only")
    trainer = L.Trainer(strategy=strategy, max_epochs=epochs, callbacks=callbacks,
                        **_trainer(world, enable_checkpointing=bool(save_dir)))
    trainer.fit(module, ckpt_path=resume)
    return {"state": full_state(module)}


def _config(variant: str) -> dict:
    return {"tie_word_embeddings": True} if variant == "tied" else {}


def _fit_reference_ema(start: dict, epochs: int) -> dict:
    """Lightning's own EMAWeightAveraging in one process (Lightning's default strategy)."""
    from lightning.pytorch.callbacks import EMAWeightAveraging

    module = LlamaModule(start_state=start, batch_size=8, **STEPS)
    trainer = L.Trainer(max_epochs=epochs, callbacks=[EMAWeightAveraging(decay=0.5)], **_trainer(1))
    trainer.fit(module)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_ema_of_the_sharded_model_equals_lightnings_ema_in_one_process() -> None:
    """Four steps with validation after each epoch (the averaged weights swapped in and out) and the average copied
    into the model at the end: the weights of Lightning's own EMAWeightAveraging in one process (<= 1e-4)."""
    start = _start_state()
    reference = _fit_reference_ema(start, epochs=2)
    for rank in run_distributed(_fit_sharded_ema, 2, start, 2):
        _assert_same_weights(rank["state"], reference)
    plain = LlamaModule(start_state=start, batch_size=8, **STEPS)  # the same run without averaging differs
    plain.configure_model()
    trainer = L.Trainer(max_epochs=2, **_trainer(1))
    trainer.fit(plain)
    worst = max((plain.state_dict()[k] - v).abs().max().item() for k, v in reference.items())
    assert worst > 1e-3, "averaging changed the result"


@pytest.mark.parametrize(("fmt", "variant"), [("full", ""), ("sharded", ""), ("async", ""),
                                             ("sharded", "tied"), ("full", "tied"), ("full", "trainable-only"),
                                             ("sharded", "trainable-only")])
def test_ema_state_resumes_from_either_format_at_another_world_size(fmt: str, variant: str, tmp_path: Path) -> None:
    """Two epochs at world size 2, saved after each (the averaged weights as `state_dict`, the model's own as
    `current_model_state`, as Lightning's callback writes them); resumed from the first at world size 1, the run
    ends as the uninterrupted one: both models and the update count came back. Also with tied embeddings (both
    names in both state dicts, as in the model's) and with `save_trainable_only` (only the adapters, in both)."""
    start = _start_state(**_config(variant))
    straight = run_distributed(_fit_sharded_ema, 2, start, 2, str(tmp_path), None, fmt, variant)[0]["state"]
    first = tmp_path / "epoch=0.ckpt"
    assert first.is_dir() == (fmt != "full")
    resumed = run_distributed(_fit_sharded_ema, 1, start, 2, None, str(first), fmt, variant)[0]["state"]
    _assert_same_weights(resumed, straight)
    # offline, either format reads as one dict with both state dicts (the converter's view)
    from lightning_fsdp2.convert import read_full_checkpoint

    whole = read_full_checkpoint(first)
    assert whole["current_model_state"].keys() == whole["state_dict"].keys()
    assert int(whole["averaging_state"]["n_averaged"]) == 2
    if variant == "tied":
        tied = [k for k in whole["state_dict"] if k.endswith(("lm_head.weight", "embed_tokens.weight"))]
        assert len(tied) == 2, tied  # both names of the tied weight, as the model's own state dict has them
    if variant == "trainable-only":
        assert all("lora_" in k for k in whole["state_dict"]), sorted(whole["state_dict"])[:3]


def test_the_ema_callback_pickles_for_spawn() -> None:
    """start_method="spawn" pickles the callbacks (Lightning's EMA holds a local closure of torch's and does not)."""
    import pickle

    from lightning_fsdp2.averaging import EMAWeightAveraging

    callback = pickle.loads(pickle.dumps(EMAWeightAveraging(decay=0.9)))
    averaged, current = torch.zeros(3), torch.ones(3)
    assert torch.allclose(callback._kwargs["avg_fn"](averaged, current, torch.tensor(1)), torch.full((3,), 0.1))


# --------------------------------------------------------------------------- stochastic weight averaging
def _fit_sharded_swa(start: dict, epochs: int, save_dir: str | None = None, resume: str | None = None,
                     fmt: str = "full") -> dict:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_fsdp2.averaging import StochasticWeightAveraging

    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else int(
        __import__("os").environ["WORLD_SIZE"])
    module = LlamaModule(start_state=start, batch_size=8 // world, **STEPS)
    callbacks = [StochasticWeightAveraging(swa_lrs=1e-2, swa_epoch_start=1, annealing_epochs=2)]
    if save_dir:
        callbacks.append(ModelCheckpoint(dirpath=save_dir, filename="{epoch}", every_n_epochs=1, save_top_k=-1))
    strategy = FSDP2Strategy(state_dict_type=fmt)
    trainer = L.Trainer(strategy=strategy, max_epochs=epochs, callbacks=callbacks,
                        **_trainer(world, enable_checkpointing=bool(save_dir)))
    trainer.fit(module, ckpt_path=resume)
    return {"state": full_state(module), "lr": trainer.optimizers[0].param_groups[0]["lr"]}


def test_swa_of_the_sharded_model_equals_lightnings_swa_in_one_process() -> None:
    """Three epochs, averaging from the second with SWA's annealed learning rate, the average copied into the model
    at the end: the weights of Lightning's own StochasticWeightAveraging in one process (<= 1e-4)."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    start = _start_state()
    module = LlamaModule(start_state=start, batch_size=8, **STEPS)
    module.configure_model()  # Lightning's SWA copies the model in `setup`, before the trainer calls this hook
    swa = StochasticWeightAveraging(swa_lrs=1e-2, swa_epoch_start=1, annealing_epochs=2)
    trainer = L.Trainer(max_epochs=3, callbacks=[swa], **_trainer(1))
    trainer.fit(module)
    reference = {k: v.detach().clone() for k, v in module.state_dict().items()}
    for rank in run_distributed(_fit_sharded_swa, 2, start, 3):
        _assert_same_weights(rank["state"], reference)
        assert rank["lr"] == pytest.approx(trainer.optimizers[0].param_groups[0]["lr"])


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_swa_state_resumes_mid_averaging_at_another_world_size(fmt: str, tmp_path: Path) -> None:
    """Saved after the second epoch at world size 2 (averaging under way: the running average, the update count and
    the SWA scheduler's state), resumed at world size 1: the run ends as the uninterrupted one."""
    start = _start_state()
    straight = run_distributed(_fit_sharded_swa, 2, start, 3, str(tmp_path), None, fmt)[0]
    resumed = run_distributed(_fit_sharded_swa, 1, start, 3, None, str(tmp_path / "epoch=1.ckpt"), fmt)[0]
    _assert_same_weights(resumed["state"], straight["state"])
    assert resumed["lr"] == pytest.approx(straight["lr"])


def test_an_averaged_copy_on_another_device_is_refused() -> None:
    """The copy is made of the shards and stays with them: `device` is refused by name, for each callback."""
    from lightning_fsdp2.averaging import EMAWeightAveraging, StochasticWeightAveraging, WeightAveraging

    for make in (lambda: EMAWeightAveraging(device="cpu"), lambda: WeightAveraging(device="cpu"),
                 lambda: StochasticWeightAveraging(swa_lrs=1e-2, device="cpu")):
        with pytest.raises(ValueError, match=r"\(device=.*cpu.*\): the averaged copy is sharded .* Leave `device` unset"):
            make()


# --------------------------------------------------------------------------- Lightning's own callbacks, as they are
def _user_averaging():
    """A user's `WeightAveraging` subclass, as Lightning's docs show one: its own `should_update` (every other
    optimizer step, from the second) and torch's default average (equal weights)."""
    from lightning.pytorch.callbacks import WeightAveraging

    class EveryOtherStepAveraging(WeightAveraging):
        def should_update(self, step_idx=None, epoch_idx=None) -> bool:
            return step_idx is not None and step_idx % 2 == 1

    return EveryOtherStepAveraging


def _lightning_callback(kind: str):
    """One of Lightning's own weight-averaging callbacks (or a user's subclass), imported from Lightning."""
    from lightning.pytorch.callbacks import EMAWeightAveraging, StochasticWeightAveraging

    if kind == "ema":
        return EMAWeightAveraging(decay=0.5)
    if kind == "swa":
        return StochasticWeightAveraging(swa_lrs=1e-2, swa_epoch_start=1, annealing_epochs=2)
    return _user_averaging()()


EPOCHS = {"ema": 2, "user": 2, "swa": 3}


class _ValLossModule(LlamaModule):
    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.val_losses = [*getattr(self, "val_losses", []), self.model(input_ids=batch, labels=batch).loss.detach()]


def _fit_with_lightnings_callback(kind: str, strategy: str, start: dict, save_dir: str | None = None,
                                  resume: str | None = None, fmt: str = "full") -> dict:
    """Lightning's own callback in a Trainer with `strategy` ("fsdp2" or Lightning's "ddp"); the model's and the
    averaged copy's weights (gathered) after fit, the losses validation saw, and whether the copy held shards."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.distributed.tensor import DTensor

    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else int(
        __import__("os").environ["WORLD_SIZE"])
    module = _ValLossModule(start_state=start, batch_size=8 // world, **STEPS)
    callback = _lightning_callback(kind)
    callbacks = [callback]
    if save_dir:
        callbacks.append(ModelCheckpoint(dirpath=save_dir, filename="{epoch}", every_n_epochs=1, save_top_k=-1))
    if strategy == "ddp":
        module.configure_model()  # Lightning's callbacks copy the model in `setup`, before the trainer calls this hook
    else:
        strategy = FSDP2Strategy(state_dict_type=fmt)
    trainer = L.Trainer(strategy=strategy, max_epochs=EPOCHS[kind], callbacks=callbacks,
                        **_trainer(world, enable_checkpointing=bool(save_dir)))
    trainer.fit(module, ckpt_path=resume)
    average = callback._average_model if kind == "swa" else callback._average_model.module
    tensors = dict(average.named_parameters())
    return {
        "state": full_state(module),
        "average": {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone()
                    for k, v in tensors.items()},
        "sharded": all(isinstance(v, DTensor) for v in tensors.values()),
        "local_numel": sum((v.to_local() if isinstance(v, DTensor) else v).numel() for v in tensors.values()),
        "numel": sum(v.numel() for v in tensors.values()),
        "val_losses": torch.stack(module.val_losses),
    }


def _worst(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize("kind", ["ema", "user", "swa"])
def test_lightnings_own_callbacks_average_the_sharded_model_as_under_ddp(kind: str) -> None:
    """`lightning.pytorch.callbacks.EMAWeightAveraging`, `StochasticWeightAveraging` and a user's `WeightAveraging`
    subclass with its own `should_update`, given as they are to a Trainer with FSDP2Strategy at world size 2: the
    averaged copy holds DTensor shards (half of the model on each rank), and it, the model after fit and the losses
    validation saw (the averaged weights, swapped in) are those of Lightning's own DDP with the same callback."""
    start = _start_state()
    ddp = run_distributed(_fit_with_lightnings_callback, 2, kind, "ddp", start)
    sharded = run_distributed(_fit_with_lightnings_callback, 2, kind, "fsdp2", start)
    for rank, reference in zip(sharded, ddp, strict=True):
        assert rank["sharded"] and not reference["sharded"]
        assert rank["local_numel"] < 0.6 * rank["numel"], (rank["local_numel"], rank["numel"])
        assert _worst(rank["average"], reference["average"]) <= 1e-5
        assert _worst(rank["state"], reference["state"]) <= 1e-5
        assert (rank["val_losses"] - reference["val_losses"]).abs().max().item() <= 1e-5
    # the weights moved: the comparison is not one of untouched start weights
    moved = _worst(sharded[0]["average"], {k: v for k, v in start.items() if k in sharded[0]["average"]})
    assert moved > 1e-3


@pytest.mark.parametrize("fmt", ["full", "sharded"])
@pytest.mark.parametrize("kind", ["ema", "user", "swa"])
def test_lightnings_own_callbacks_resume_from_either_format(kind: str, fmt: str, tmp_path: Path) -> None:
    """Lightning's own callbacks, saved at world size 2 after each epoch, resumed from the one before the last at
    world size 1: the run ends as the uninterrupted one, the averaged copy and the model both (the averaged and the
    current weights, the update count and, for SWA, its scheduler came back)."""
    straight = run_distributed(_fit_with_lightnings_callback, 2, kind, "fsdp2", _start_state(), str(tmp_path),
                               None, fmt)[0]
    checkpoint = tmp_path / f"epoch={EPOCHS[kind] - 2}.ckpt"
    assert checkpoint.is_dir() == (fmt == "sharded")
    resumed = run_distributed(_fit_with_lightnings_callback, 1, kind, "fsdp2", _start_state(), None,
                              str(checkpoint), fmt)[0]
    assert _worst(resumed["average"], straight["average"]) <= 1e-4
    _assert_same_weights(resumed["state"], straight["state"])


def test_adopting_keeps_the_users_class_and_overrides() -> None:
    """What the strategy does to each of Lightning's averaging callbacks at setup: the instance gets the sharded
    behaviour in front of its own class (Lightning's or a user's), keeps its `should_update`, its arguments and its
    checkpoint key, and pickles (for `start_method="spawn"`) back to an adopted callback; a `device` for the copy is
    ignored with a warning (Lightning's SWA has the CPU by default: ignored silently)."""
    import pickle

    from lightning.pytorch.callbacks import EMAWeightAveraging, StochasticWeightAveraging, WeightAveraging

    from lightning_fsdp2 import averaging

    user = _user_averaging()
    for callback, lightnings in ((EMAWeightAveraging(decay=0.5), EMAWeightAveraging),
                                 (WeightAveraging(), WeightAveraging), (user(), user),
                                 (StochasticWeightAveraging(swa_lrs=1e-2), StochasticWeightAveraging)):
        key = callback.state_key
        assert averaging.adopt(callback) and not averaging.adopt(callback)
        assert isinstance(callback, lightnings) and type(callback) is not lightnings
        assert isinstance(callback, (averaging._ShardedAveraging, averaging._ShardedSWA))
        assert callback.state_key == key and type(callback).__name__ == lightnings.__name__
        assert callback._device is None
    adopted = user()
    averaging.adopt(adopted)
    assert [adopted.should_update(step_idx=i) for i in range(4)] == [False, True, False, True]
    assert type(adopted).setup is averaging._ShardedAveraging.setup  # no deep copy of the model in `setup`
    assert type(adopted)._swap_models is averaging._ShardedAveraging._swap_models
    swa = StochasticWeightAveraging(swa_lrs=1e-2)
    averaging.adopt(swa)
    again = pickle.loads(pickle.dumps(swa))
    assert type(again) is type(swa) and again._swa_lrs == 1e-2
    assert not averaging.adopt(torch.nn.Module())
    offloaded = WeightAveraging(device="cpu")  # the copy stays with the shards: said, not refused
    with pytest.warns(UserWarning, match=r"WeightAveraging\(device=.*cpu.*\) is ignored with FSDP2Strategy"):
        averaging.adopt(offloaded)
    assert offloaded._device is None

    class OwnSetup(WeightAveraging):  # a hook the sharded form replaces: named, not silently skipped
        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            raise AssertionError("not called")

    with pytest.warns(UserWarning, match=r"OwnSetup overrides setup, which FSDP2Strategy runs in its sharded form"):
        averaging.adopt(OwnSetup())
