"""Whole `Trainer.fit` runs that save and resume: any world size, both formats, single device, trainable-only,
ModelCheckpoint, a save killed midway, checkpoints that are corrupt or do not fit."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_fsdp2 import FSDP2Strategy
from lightning_fsdp2.convert import read_full_checkpoint
from tests.helpers import run_distributed
from tests.models import (
    ResumeModule,
    assert_same_run,
    fit_resumable,
    fit_resumable_single_device,
    quiet_trainer_kwargs,
    save_tiny_pretrained,
)

pytestmark = pytest.mark.slow  # every test here runs several fits


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_resume_at_1_2_and_4_processes_continues_exactly(fmt: str, pretrained: Path, saved: dict, straight: dict) -> None:
    """Saved at world size 2 after one epoch; resumed at 1, 2 and 4 for the second; equal to two epochs straight."""
    assert saved[fmt].is_dir() == (fmt == "sharded")
    for world in (1, 2, 4):
        resumed = run_distributed(fit_resumable, world, str(pretrained), 2, None, str(saved[fmt]))[0]
        assert_same_run(resumed, straight, f"{fmt} checkpoint resumed at world size {world}")


def test_full_checkpoint_is_what_a_single_device_writes_and_both_ways_resume(
    pretrained: Path, saved: dict, straight: dict, tmp_path: Path
) -> None:
    single_path = tmp_path / "single.ckpt"
    fit_resumable_single_device(str(pretrained), 1, save_to=str(single_path))
    ours = torch.load(saved["full"], weights_only=True, map_location="cpu")
    theirs = torch.load(single_path, weights_only=True, map_location="cpu")
    assert ours.keys() == theirs.keys()
    assert ours["state_dict"].keys() == theirs["state_dict"].keys()
    ours_opt, theirs_opt = ours["optimizer_states"][0], theirs["optimizer_states"][0]
    assert ours_opt["state"].keys() == theirs_opt["state"].keys()
    assert [g["params"] for g in ours_opt["param_groups"]] == [g["params"] for g in theirs_opt["param_groups"]]
    for i, state in theirs_opt["state"].items():
        for name, value in state.items():
            assert torch.allclose(ours_opt["state"][i][name].float(), value.float(), atol=1e-5), (i, name)

    # A single-device checkpoint resumes under FSDP2, and ours resumes on a single device.
    fsdp2_resumed = run_distributed(fit_resumable, 2, str(pretrained), 2, None, str(single_path))[0]
    assert_same_run(fsdp2_resumed, straight, "single-device checkpoint resumed under FSDP2")
    single_resumed = fit_resumable_single_device(str(pretrained), 2, resume_from=str(saved["full"]))
    assert_same_run(single_resumed, straight, "FSDP2 checkpoint resumed on a single device")


def _tied_save_and_resume(pretrained: str, root: str) -> dict:
    tied = {"tie_word_embeddings": True}
    out = {"straight": fit_resumable(pretrained, 2, module=tied)}
    for fmt in ("full", "sharded"):
        path = str(Path(root) / f"tied-{fmt}.ckpt")
        fit_resumable(pretrained, 1, save_to=path, strategy={"state_dict_type": fmt}, module=tied)
        out[fmt] = fit_resumable(pretrained, 2, resume_from=path, module=tied)
    return out


def test_tied_weights_save_once_and_resume_strictly(tmp_path: Path) -> None:
    """A tied lm_head/embedding: both names in the file sharing one tensor (as a single device writes it), and a
    strict resume that does not call the second name unexpected."""
    pretrained = save_tiny_pretrained(tmp_path / "tied-pretrained", tie_word_embeddings=True)
    results = run_distributed(_tied_save_and_resume, 2, str(pretrained), str(tmp_path))[0]
    for fmt in ("full", "sharded"):
        assert_same_run(results[fmt], results["straight"], f"tied weights, {fmt}")
    state = torch.load(tmp_path / "tied-full.ckpt", weights_only=True, map_location="cpu")["state_dict"]
    embed, head = state["model.model.embed_tokens.weight"], state["model.lm_head.weight"]
    assert embed.untyped_storage().data_ptr() == head.untyped_storage().data_ptr()


def _lora_trainable_only(pretrained: str, root: str) -> dict:
    """LoRA with a frozen base: straight, then save trainable-only (both formats) after one epoch and resume."""
    lora = {"lora": True}
    out = {"straight": fit_resumable(pretrained, 2, module=lora)}
    for fmt in ("full", "sharded"):
        path = str(Path(root) / f"lora-{fmt}.ckpt")
        strategy = {"state_dict_type": fmt, "save_trainable_only": True}
        fit_resumable(pretrained, 1, save_to=path, strategy=strategy, module=lora)
        out[fmt] = fit_resumable(pretrained, 2, resume_from=path, strategy=strategy, module=lora)
    return out


def test_trainable_only_checkpoints_hold_the_adapters_and_resume_exactly(pretrained: Path, tmp_path: Path) -> None:
    results = run_distributed(_lora_trainable_only, 2, str(pretrained), str(tmp_path))[0]
    for fmt in ("full", "sharded"):
        assert_same_run(results[fmt], results["straight"], f"trainable-only {fmt} checkpoint")
    full = torch.load(tmp_path / "lora-full.ckpt", weights_only=True, map_location="cpu")
    assert full["state_dict"] and all("lora_" in k for k in full["state_dict"]), list(full["state_dict"])[:3]
    n_lora = sum("lora_" in k for k in results["straight"]["state"])
    assert len(full["state_dict"]) == n_lora and len(full["optimizer_states"][0]["state"]) == n_lora
    sharded = read_full_checkpoint(tmp_path / "lora-sharded.ckpt")
    assert sharded["state_dict"].keys() == full["state_dict"].keys()


def _train_with_model_checkpoint(pretrained: str, dirpath: str, async_save: bool) -> dict:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.models import full_state

    callback = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=1, save_top_k=1, save_last=True)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=FSDP2Strategy(state_dict_type="sharded", async_save=async_save),
        max_epochs=1, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[callback],
        **{**quiet_trainer_kwargs(), "enable_checkpointing": True},
    )
    trainer.fit(ResumeModule(pretrained))
    names = sorted(p.name for p in Path(dirpath).iterdir())
    module = ResumeModule(pretrained)
    resumed = L.Trainer(
        accelerator="cpu", devices=2, strategy=FSDP2Strategy(), max_epochs=2, limit_val_batches=0,
        num_sanity_val_steps=0, **quiet_trainer_kwargs(),
    )
    resumed.fit(module, ckpt_path=str(Path(dirpath) / "last.ckpt"))
    lr = resumed.optimizers[0].param_groups[0]["lr"]
    return {"names": names, "step": resumed.global_step, "lr": lr, "state": full_state(module)}


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_model_checkpoint_keeps_and_removes_sharded_directories(
    async_save: bool, pretrained: Path, straight: dict, tmp_path: Path
) -> None:
    """ModelCheckpoint with save_top_k=1 saves a sharded directory every step (in the background with async_save)
    and deletes the one it replaces; resuming from last.ckpt continues exactly."""
    result = run_distributed(_train_with_model_checkpoint, 2, str(pretrained), str(tmp_path), async_save)[0]
    assert result["names"] == ["epoch=0-step=2.ckpt", "last.ckpt"], result["names"]
    assert sorted(p.name for p in tmp_path.iterdir()) == result["names"], "no .tmp-/.old- leftovers"
    assert all((tmp_path / n / ".metadata").is_file() for n in result["names"])
    assert_same_run(result, straight, f"ModelCheckpoint, async_save={async_save}")


# --------------------------------------------------------------------------- safety
class _SaveAtEpochEnd(L.Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.save_checkpoint(self.path)


def _train_then_die_while_saving(pretrained: str, path: str, fmt: str) -> None:
    """Save a good checkpoint at `path`, train on, then get SIGKILLed in the middle of saving over it."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    strategy = {"state_dict_type": "full" if fmt == "full" else "sharded", "async_save": fmt == "async"}
    fit_resumable(pretrained, 1, save_to=path, strategy=strategy)
    if fmt == "full":
        from lightning_fsdp2.checkpoint import stream

        real_add = stream._Writer.add
        count = [0]

        def add_then_die(self, whole):
            real_add(self, whole)
            count[0] += 1
            if count[0] == 3:  # rank 0, three tensors into the file: the kill
                self.file.flush()
                os.kill(os.getpid(), signal.SIGKILL)

        stream._Writer.add = add_then_die
    elif fmt == "sharded":
        real_dcp_save = dcp.save

        def save_then_die(*args, **kwargs):
            real_dcp_save(*args, **kwargs)  # every rank's shards are written, nothing is in place yet
            dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)

        dcp.save = save_then_die
    else:  # async: rank 0 dies in the background writer, halfway through its shards, while training goes on
        real_write_data = FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            if dist.get_rank() == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            return real_write_data(self, plan, planner)

        FileSystemWriter.write_data = write_then_die
    model = ResumeModule(pretrained)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=FSDP2Strategy(**strategy), max_epochs=2, limit_val_batches=0,
        num_sanity_val_steps=0, callbacks=[_SaveAtEpochEnd(path)], **quiet_trainer_kwargs(),
    )
    trainer.fit(model, ckpt_path=path)


@pytest.mark.parametrize("fmt", ["full", "sharded", "async"])
def test_a_save_killed_midway_leaves_the_previous_checkpoint(fmt: str, pretrained: Path, tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    with pytest.raises(RuntimeError, match=f"rank 0 exited with -{int(signal.SIGKILL)}"):
        run_distributed(_train_then_die_while_saving, 2, str(pretrained), str(path), fmt, timeout=120)
    survivor = read_full_checkpoint(path)
    assert survivor["global_step"] == 2, "the checkpoint from after the first epoch is intact"
    strategy = {"state_dict_type": "full" if fmt == "full" else "sharded"}
    resumed = run_distributed(fit_resumable, 2, str(pretrained), 2, None, str(path), strategy)[0]
    assert resumed["step"] == 4 and survivor["state_dict"].keys() <= resumed["state"].keys()
    # The next successful save of that path cleans up what the killed one left.
    run_distributed(fit_resumable, 2, str(pretrained), 2, str(path), str(path), strategy)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def _resume_expecting_error(pretrained: str, path: str, module: dict, strategy: dict | None = None) -> str:
    try:
        fit_resumable(pretrained, 2, resume_from=path, strategy=strategy, module=module)
    except Exception as err:  # noqa: BLE001 - the test asserts on the message
        return f"{type(err).__name__}: {err}"
    return "no error"


def test_corrupt_or_mismatched_checkpoints_are_named(pretrained: Path, saved: dict, tmp_path: Path) -> None:
    truncated = tmp_path / "truncated.ckpt"
    data = saved["full"].read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    short_shards = tmp_path / "short-shards.ckpt"
    shutil.copytree(saved["sharded"], short_shards)
    shard = next(short_shards.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    wider = save_tiny_pretrained(tmp_path / "wider", intermediate_size=96)

    cases = {
        "truncated file": (str(pretrained), str(truncated), {}),
        "truncated shard": (str(pretrained), str(short_shards), {}),
        "full, other shapes": (str(wider), str(saved["full"]), {"intermediate_size": 96}),
        "sharded, other shapes": (str(wider), str(saved["sharded"]), {"intermediate_size": 96}),
        "full, adapters missing": (str(pretrained), str(saved["full"]), {"lora": True}),
    }
    messages = {name: run_distributed(_resume_expecting_error, 2, *args) for name, args in cases.items()}
    for name, per_rank in messages.items():
        assert per_rank[0] == per_rank[1], f"{name}: every rank raises the same error"
    assert "CheckpointFileError" in messages["truncated file"][0] and str(truncated) in messages["truncated file"][0]
    assert "may be truncated or corrupt" in messages["truncated file"][0]
    assert "CheckpointFileError" in messages["truncated shard"][0] and str(shard) in messages["truncated shard"][0]
    assert "bytes but its index needs" in messages["truncated shard"][0]
    for name in ("full, other shapes", "sharded, other shapes"):
        message = messages[name][0]
        assert "CheckpointFileError" in message, message
        assert "'model.model.layers.0.mlp.up_proj.weight' has shape (128, 64) in" in message, message
        assert "(96, 64) in the model" in message, message
    message = messages["full, adapters missing"][0]
    assert "CheckpointFileError" in message and "are not in it" in message and "lora_A.default.weight" in message, message
