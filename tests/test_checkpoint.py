"""Checkpoints: pretrained weights into the sharded model, full and sharded saves, resume at any world size, safety."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_fsdp2 import CheckpointError, FSDP2Strategy, load_pretrained
from lightning_fsdp2.checkpoint import check_sharded_files
from lightning_fsdp2.convert import read_full_checkpoint, sharded_to_full, to_hf_safetensors
from tests.helpers import run_distributed
from tests.models import LlamaModule, TokenDataset, full_state, quiet_trainer_kwargs, tiny_llama_config

GLOBAL_BATCH = 8  # split over the ranks, so every world size takes the same optimizer steps


def _world() -> int:
    # Lightning's environment deletes WORLD_SIZE when a Trainer tears down; later Trainers in the process ask torch.
    if torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _save_pretrained(path: Path, seed: int = 0, **config) -> Path:
    """A tiny Llama saved by `save_pretrained`, split into several safetensors files with an index."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(tiny_llama_config(**config)).save_pretrained(path, max_shard_size="100KB")
    return path


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    path = _save_pretrained(tmp_path_factory.mktemp("pretrained") / "tiny-llama")
    assert len(list(path.glob("*.safetensors"))) > 1 and (path / "model.safetensors.index.json").exists()
    return path


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=TokenDataset(4).data).logits.float()


# =========================================================================== load_pretrained
class PretrainedProbe(L.LightningModule):
    """Builds a (peft) Llama in configure_model, declares its weights with load_pretrained, records logits."""

    def __init__(self, source, when: str = "before-peft", lora: bool = True, **config) -> None:
        super().__init__()
        self.source, self.when, self.lora, self.config = source, when, lora, config
        self.model = None
        self.logits: list[torch.Tensor] = []
        self.facts: dict = {}

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM(tiny_llama_config(**self.config))
        if self.when == "before-peft":
            load_pretrained(model, self.source)
        if self.lora:
            model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        if self.when == "after-peft":
            load_pretrained(model, self.source)
        self.model = model

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        base = self.model.get_base_model() if self.lora else self.model
        self.facts = {
            "dtype": str(next(self.model.parameters()).dtype),
            "tied": base.lm_head.weight is base.model.embed_tokens.weight,
        }
        self.logits.append(self.model(input_ids=batch).logits.detach().float())

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TokenDataset(4), batch_size=4)


def _probe(cases: dict) -> dict:
    """Run each case's PretrainedProbe under FSDP2 (validate only: no training), return logits and facts."""
    out = {}
    for name, (kwargs, precision) in cases.items():
        module = PretrainedProbe(**kwargs)
        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy=FSDP2Strategy(), precision=precision, **quiet_trainer_kwargs()
        )
        trainer.validate(module, verbose=False)
        out[name] = {"logits": module.logits[0], **module.facts}
    return out


def test_load_pretrained_gives_the_logits_of_from_pretrained(pretrained: Path, tmp_path: Path) -> None:
    """Sharded safetensors, .bin and a whole peft model's weights, before/after get_peft_model, bf16 and tied: each
    rank reads its slices into the sharded model and the logits equal `from_pretrained` in one process."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(pretrained)
    torch.save(reference.state_dict(), tmp_path / "pytorch_model.bin")
    # A whole peft model under peft's names, with non-zero adapters so that loading them shows in the logits.
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(pretrained), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    save_file({k: v.contiguous() for k, v in peft_model.state_dict().items()}, tmp_path / "peft.safetensors")
    tied = _save_pretrained(tmp_path / "tied", seed=1, tie_word_embeddings=True)
    tied_reference = AutoModelForCausalLM.from_pretrained(tied, dtype=torch.bfloat16)

    cases = {
        "sharded-safetensors, before peft": (dict(source=str(pretrained)), "32-true"),
        "sharded-safetensors, after peft": (dict(source=str(pretrained), when="after-peft"), "32-true"),
        "pytorch_model.bin": (dict(source=str(tmp_path / "pytorch_model.bin")), "32-true"),
        "peft model weights": (dict(source=str(tmp_path / "peft.safetensors"), when="after-peft"), "32-true"),
        "bf16-true, tied": (dict(source=str(tied), lora=False, tie_word_embeddings=True), "bf16-true"),
    }
    results = run_distributed(_probe, 2, cases)
    expected = {
        "sharded-safetensors, before peft": _logits(reference),
        "sharded-safetensors, after peft": _logits(reference),
        "pytorch_model.bin": _logits(reference),
        "peft model weights": _logits(peft_model),
        "bf16-true, tied": _logits(tied_reference),
    }
    assert (expected["peft model weights"] - expected["pytorch_model.bin"]).abs().max() > 1e-3  # adapters matter
    for name, want in expected.items():
        for rank, result in enumerate(results):
            got = result[name]["logits"]
            tolerance = 2e-2 if "bf16" in name else 1e-5
            assert (got - want).abs().max() <= tolerance, f"{name}, rank {rank}: {(got - want).abs().max()}"
    assert results[0]["bf16-true, tied"]["dtype"] == "torch.bfloat16"
    assert results[0]["bf16-true, tied"]["tied"], "tied weights stay tied"


def test_load_pretrained_loads_at_once_on_a_real_model(pretrained: Path) -> None:
    """Without meta (one device, DDP) the same call loads immediately, so one LightningModule serves every strategy."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    model = LlamaForCausalLM(tiny_llama_config())
    load_pretrained(model, pretrained)
    assert torch.equal(_logits(model), _logits(AutoModelForCausalLM.from_pretrained(pretrained)))


def test_load_pretrained_names_what_does_not_fit(pretrained: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file
    from transformers import LlamaForCausalLM

    weights = {}
    for file in sorted(pretrained.glob("*.safetensors")):
        weights.update(load_file(file))
    model = LlamaForCausalLM(tiny_llama_config())

    partial = dict(weights)
    del partial["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(CheckpointError, match=r"not in the source: 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_pretrained(model, partial)

    extra = dict(weights, **{"model.layers.9.mlp.up_proj.weight": torch.zeros(1)})
    with pytest.raises(CheckpointError, match=r"fit nothing in the model: 'model\.layers\.9\.mlp\.up_proj\.weight'"):
        load_pretrained(model, extra)
    with pytest.warns(UserWarning, match="model.layers.9.mlp.up_proj.weight"):
        load_pretrained(model, extra, strict=False)

    wider = LlamaForCausalLM(tiny_llama_config(intermediate_size=96))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight' has shape \(128, 64\) in .*"
                       r"but 'model\.layers\.0\.mlp\.up_proj\.weight' has shape \(96, 64\)"):
        load_pretrained(wider, pretrained)

    # A truncated file (an interrupted download) is named.
    save_file(weights, tmp_path / "model.safetensors")
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*truncated or corrupt"):
        load_pretrained(model, tmp_path / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="holds no model weights"):
        load_pretrained(model, tmp_path / "nothing-here" if (tmp_path / "nothing-here").mkdir() is None else "")


# --------------------------------------------------------------------------- memory while loading
def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


class MemoryProbe(PretrainedProbe):
    """Resets the peak-RSS counter at the end of configure_model and reads it once the model is sharded+loaded."""

    def configure_model(self) -> None:
        super().configure_model()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        self.facts["rss_before_kb"] = _rss_kb("VmRSS")

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.facts["peak_kb"] = _rss_kb("VmHWM")

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TokenDataset(1), batch_size=1)


def _measure_load_and_save(source: str, config: dict, save_to: str) -> dict:
    module = MemoryProbe(source, lora=False, **config)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy(), **quiet_trainer_kwargs())
    trainer.validate(module, verbose=False)
    before_save = int(Path("/proc/self/clear_refs").write_text("5") and _rss_kb("VmRSS"))
    trainer.save_checkpoint(save_to)
    return {"load_kb": module.facts["peak_kb"] - module.facts["rss_before_kb"], "save_kb": _rss_kb("VmHWM") - before_save}


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak-RSS reset")
def test_memory_per_rank_while_loading_and_saving(tmp_path: Path) -> None:
    """68 MB of fp32 weights at world size 2. Loading: each rank's peak is its 34 MB shard plus about one tensor's
    slice, under one whole copy of the model (an eager build needs two). Saving a full checkpoint: rank 0 holds what
    it writes plus about one tensor, rank 1 about one tensor."""
    config = dict(vocab_size=8192, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, max_position_embeddings=64)
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(tiny_llama_config(**config))
    total_kb = sum(p.numel() * p.element_size() for p in model.parameters()) // 1024
    model.save_pretrained(tmp_path, max_shard_size="8MB")
    largest_kb = max(p.numel() * p.element_size() for p in model.parameters()) // 1024
    del model
    results = run_distributed(_measure_load_and_save, 2, str(tmp_path), config, str(tmp_path / "full.ckpt"))
    slack_kb = 24 * 1024  # allocator and bookkeeping
    for rank, result in enumerate(results):
        print(f"rank {rank}: +{result['load_kb'] / 1024:.1f} MB loading, +{result['save_kb'] / 1024:.1f} MB saving;"
              f" model {total_kb / 1024:.1f} MB, largest tensor {largest_kb / 1024:.1f} MB")
        assert result["load_kb"] <= total_kb // 2 + largest_kb + slack_kb, (rank, result)
        assert result["load_kb"] < total_kb, "a rank held as much as the whole model while loading"
    assert results[0]["save_kb"] <= total_kb + largest_kb + slack_kb, results[0]
    assert results[1]["save_kb"] <= largest_kb + slack_kb, results[1]


# =========================================================================== the primitives, on uneven shards
def _gather_and_reload_uneven() -> dict:
    """At world size 3 a 5-row weight is split 2/2/1 and a 2-row one 1/1/0: gather and slice-wise load both."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_fsdp2.checkpoint import gather_to_rank0, load_full_state_dict

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def build(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 2))
        model.register_buffer("scale", torch.arange(3.0))
        return fully_shard(model, mesh=mesh)

    source = build(0)
    expected = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in source.state_dict().items()}
    gathered = gather_to_rank0(source.state_dict())
    target = build(1)
    load_full_state_dict(target, expected)
    reloaded = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in target.state_dict().items()}
    dist.destroy_process_group()
    return {"expected": expected, "gathered": gathered, "reloaded": reloaded}


def test_gather_and_slice_load_handle_uneven_shards() -> None:
    results = run_distributed(_gather_and_reload_uneven, 3)
    expected = results[0]["expected"]
    assert results[0]["gathered"].keys() == expected.keys()
    assert all(r["gathered"] == {} for r in results[1:]), "only rank 0 receives the whole tensors"
    for key, value in expected.items():
        assert torch.equal(results[0]["gathered"][key], value), key
        for rank, result in enumerate(results):
            assert torch.equal(result["reloaded"][key], value), (rank, key)


# =========================================================================== save and resume
class ResumeModule(LlamaModule):
    """A tiny Llama (LoRA or fully trained) whose initial weights come from `load_pretrained`, with AdamW and a
    per-step LR schedule, so that a resume has weights, optimizer state, scheduler and loop progress to restore."""

    def __init__(self, pretrained: str, lora: bool = False, **kwargs) -> None:
        world = _world()
        # lr 1e-3: Adam turns rounding differences of near-zero gradients into steps of up to lr, and a single-device
        # run rounds differently from a sharded one; a resume that lost any state is off by about lr, 10x the 1e-4.
        super().__init__(lora=lora, batch_size=GLOBAL_BATCH // world, n_samples=16, lr=1e-3, **kwargs)
        self.pretrained = pretrained

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM(tiny_llama_config(**self.config_overrides))
        load_pretrained(model, self.pretrained)
        if self.lora:
            model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        self.model = model

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _train(pretrained: str, epochs: int, save_to: str | None = None, resume_from: str | None = None,
           strategy: dict | None = None, module: dict | None = None) -> dict:
    """Fit for `epochs` (in total, counting resumed ones) under FSDP2 at this process's world size."""
    world = _world()
    model = ResumeModule(pretrained, **(module or {}))
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=FSDP2Strategy(**(strategy or {})), max_epochs=epochs,
        limit_val_batches=0, num_sanity_val_steps=0, **quiet_trainer_kwargs(),
    )
    trainer.fit(model, ckpt_path=resume_from)
    if save_to:
        trainer.save_checkpoint(save_to)
    return {"state": full_state(model), "step": trainer.global_step, "lr": trainer.optimizers[0].param_groups[0]["lr"]}


def _train_single_device(pretrained: str, epochs: int, save_to: str | None = None, resume_from: str | None = None) -> dict:
    """The same in this process with Lightning's default single-device strategy."""
    model = ResumeModule(pretrained)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, limit_val_batches=0, num_sanity_val_steps=0,
                        **quiet_trainer_kwargs())
    trainer.fit(model, ckpt_path=resume_from)
    if save_to:
        trainer.save_checkpoint(save_to)
    return {"state": full_state(model), "step": trainer.global_step, "lr": trainer.optimizers[0].param_groups[0]["lr"]}


def _assert_same_run(resumed: dict, straight: dict, what: str) -> None:
    assert resumed["step"] == straight["step"], what
    assert resumed["lr"] == pytest.approx(straight["lr"]), f"{what}: LR schedule"
    assert resumed["state"].keys() == straight["state"].keys(), what
    worst = max((resumed["state"][k] - straight["state"][k]).abs().max().item() for k in straight["state"])
    assert worst <= 1e-4, f"{what}: max abs diff {worst}"


@pytest.fixture(scope="module")
def straight(pretrained: Path) -> dict:
    """Two epochs without interruption at world size 2: what every resumed run must end equal to."""
    return run_distributed(_train, 2, str(pretrained), 2)[0]


@pytest.fixture(scope="module")
def saved(pretrained: Path, tmp_path_factory) -> dict:
    """Checkpoints after one epoch at world size 2, in both formats."""
    root = tmp_path_factory.mktemp("saved")
    paths = {"full": root / "full.ckpt", "sharded": root / "sharded.ckpt"}
    for fmt, path in paths.items():
        run_distributed(_train, 2, str(pretrained), 1, str(path), None, {"state_dict_type": fmt})
    return paths


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_resume_at_1_2_and_4_processes_continues_exactly(fmt: str, pretrained: Path, saved: dict, straight: dict) -> None:
    """Saved at world size 2 after one epoch; resumed at 1, 2 and 4 for the second; equal to two epochs straight."""
    assert saved[fmt].is_dir() == (fmt == "sharded")
    for world in (1, 2, 4):
        resumed = run_distributed(_train, world, str(pretrained), 2, None, str(saved[fmt]))[0]
        _assert_same_run(resumed, straight, f"{fmt} checkpoint resumed at world size {world}")


def test_full_checkpoint_is_what_a_single_device_writes_and_both_ways_resume(
    pretrained: Path, saved: dict, straight: dict, tmp_path: Path
) -> None:
    single_path = tmp_path / "single.ckpt"
    _train_single_device(str(pretrained), 1, save_to=str(single_path))
    ours = torch.load(saved["full"], weights_only=True, map_location="cpu")
    theirs = torch.load(single_path, weights_only=True, map_location="cpu")
    assert ours["state_dict"].keys() == theirs["state_dict"].keys()
    for key in ("optimizer_states", "lr_schedulers", "loops", "epoch", "global_step"):
        assert key in ours, key
    ours_opt, theirs_opt = ours["optimizer_states"][0], theirs["optimizer_states"][0]
    assert ours_opt["state"].keys() == theirs_opt["state"].keys()
    assert [g["params"] for g in ours_opt["param_groups"]] == [g["params"] for g in theirs_opt["param_groups"]]
    for i, state in theirs_opt["state"].items():
        for name, value in state.items():
            assert torch.allclose(ours_opt["state"][i][name].float(), value.float(), atol=1e-5), (i, name)

    # A single-device checkpoint resumes under FSDP2, and ours resumes on a single device.
    fsdp2_resumed = run_distributed(_train, 2, str(pretrained), 2, None, str(single_path))[0]
    _assert_same_run(fsdp2_resumed, straight, "single-device checkpoint resumed under FSDP2")
    single_resumed = _train_single_device(str(pretrained), 2, resume_from=str(saved["full"]))
    _assert_same_run(single_resumed, straight, "FSDP2 checkpoint resumed on a single device")


def _train_lora_trainable_only(pretrained: str, root: str) -> dict:
    """LoRA with a frozen base: straight, then save trainable-only (both formats) after one epoch and resume."""
    lora = {"lora": True}
    out = {"straight": _train(pretrained, 2, module=lora)}
    for fmt in ("full", "sharded"):
        path = str(Path(root) / f"lora-{fmt}.ckpt")
        strategy = {"state_dict_type": fmt, "save_trainable_only": True}
        _train(pretrained, 1, save_to=path, strategy=strategy, module=lora)
        out[fmt] = _train(pretrained, 2, resume_from=path, strategy=strategy, module=lora)
    return out


def test_trainable_only_checkpoints_hold_the_adapters_and_resume_exactly(pretrained: Path, tmp_path: Path) -> None:
    results = run_distributed(_train_lora_trainable_only, 2, str(pretrained), str(tmp_path))[0]
    for fmt in ("full", "sharded"):
        _assert_same_run(results[fmt], results["straight"], f"trainable-only {fmt} checkpoint")
    full = torch.load(tmp_path / "lora-full.ckpt", weights_only=True, map_location="cpu")
    assert full["state_dict"] and all("lora_" in k for k in full["state_dict"]), list(full["state_dict"])[:3]
    n_lora = sum("lora_" in k for k in results["straight"]["state"])
    assert len(full["state_dict"]) == n_lora and len(full["optimizer_states"][0]["state"]) == n_lora
    sharded = read_full_checkpoint(tmp_path / "lora-sharded.ckpt")
    assert sharded["state_dict"].keys() == full["state_dict"].keys()


def _train_with_model_checkpoint(pretrained: str, dirpath: str) -> list[str]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    model = ResumeModule(pretrained)
    callback = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=1, save_top_k=1, save_last=True)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=FSDP2Strategy(state_dict_type="sharded"), max_epochs=1,
        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[callback],
        **{**quiet_trainer_kwargs(), "enable_checkpointing": True},
    )
    trainer.fit(model)
    resumed = L.Trainer(
        accelerator="cpu", devices=2, strategy=FSDP2Strategy(), max_epochs=2, limit_val_batches=0,
        num_sanity_val_steps=0, **quiet_trainer_kwargs(),
    )
    resumed.fit(ResumeModule(pretrained), ckpt_path=str(Path(dirpath) / "last.ckpt"))
    return [str(resumed.global_step), *sorted(p.name for p in Path(dirpath).iterdir())]


def test_model_checkpoint_keeps_and_removes_sharded_directories(pretrained: Path, tmp_path: Path) -> None:
    """ModelCheckpoint with save_top_k=1 saves a sharded directory every step and deletes the one it replaces."""
    step, *names = run_distributed(_train_with_model_checkpoint, 2, str(pretrained), str(tmp_path))[0]
    assert names == ["epoch=0-step=2.ckpt", "last.ckpt"], names
    assert all((tmp_path / n / ".metadata").is_file() for n in names)
    assert step == "4"


# =========================================================================== safety
def _train_then_die_while_saving(pretrained: str, path: str, fmt: str) -> None:
    """Save a good checkpoint at `path`, train on, then get SIGKILLed in the middle of saving over it."""
    import torch.distributed.checkpoint as dcp

    _train(pretrained, 1, save_to=path, strategy={"state_dict_type": fmt})
    if fmt == "full":
        real_save = torch.save

        def save_then_die(obj, f, *args, **kwargs):
            if hasattr(f, "write"):
                f.write(b"PK\x03\x04 half a checkpoint")
                f.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            return real_save(obj, f, *args, **kwargs)

        torch.save = save_then_die
    else:
        real_dcp_save = dcp.save

        def save_then_die(*args, **kwargs):
            real_dcp_save(*args, **kwargs)  # every rank's shards are written, nothing is renamed yet
            os.kill(os.getpid(), signal.SIGKILL)

        dcp.save = save_then_die
    _train(pretrained, 2, save_to=path, resume_from=path, strategy={"state_dict_type": fmt})


@pytest.mark.parametrize("fmt,world", [("full", 1), ("sharded", 2)])
def test_a_save_killed_midway_leaves_the_previous_checkpoint(fmt: str, world: int, pretrained: Path, tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    with pytest.raises(RuntimeError, match=f"exited with -{int(signal.SIGKILL)}"):
        run_distributed(_train_then_die_while_saving, world, str(pretrained), str(path), fmt)
    survivor = read_full_checkpoint(path)
    assert survivor["global_step"] == 2, "the checkpoint from after the first epoch is intact"
    good = read_full_checkpoint(path)["state_dict"]
    resumed = run_distributed(_train, world, str(pretrained), 2, None, str(path), {"state_dict_type": fmt})[0]
    assert resumed["step"] == 4 and good.keys() <= resumed["state"].keys()


def _resume_expecting_error(pretrained: str, path: str, config: dict) -> str:
    try:
        _train(pretrained, 2, resume_from=path, module=config)
    except Exception as err:  # noqa: BLE001 - the test asserts on the message
        return f"{type(err).__name__}: {err}"
    return "no error"


def test_corrupt_or_mismatched_checkpoints_are_named(pretrained: Path, saved: dict, tmp_path: Path) -> None:
    import shutil

    truncated = tmp_path / "truncated.ckpt"
    data = saved["full"].read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    short_shards = tmp_path / "short-shards.ckpt"
    shutil.copytree(saved["sharded"], short_shards)
    shard = next(short_shards.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])

    wider = _save_pretrained(tmp_path / "wider", intermediate_size=96)
    cases = {
        "truncated file": (str(pretrained), str(truncated), {}),
        "truncated shard": (str(pretrained), str(short_shards), {}),
        "full, other shapes": (str(wider), str(saved["full"]), {"intermediate_size": 96}),
        "sharded, other shapes": (str(wider), str(saved["sharded"]), {"intermediate_size": 96}),
    }
    messages = {name: run_distributed(_resume_expecting_error, 2, *args) for name, args in cases.items()}
    for name, per_rank in messages.items():
        assert per_rank[0] == per_rank[1], f"{name}: every rank raises the same error"
    assert "CheckpointError" in messages["truncated file"][0] and str(truncated) in messages["truncated file"][0]
    assert "CheckpointError" in messages["truncated shard"][0] and str(shard) in messages["truncated shard"][0]
    for name in ("full, other shapes", "sharded, other shapes"):
        message = messages[name][0]
        assert "CheckpointError" in message, message
        assert "'model.model.layers.0.mlp.up_proj.weight' has shape (128, 64) in" in message, message
        assert "(96, 64) in the model" in message, message


def test_checkpoints_are_read_without_unpickling_code(tmp_path: Path) -> None:
    """A pickle that would run code is refused by `weights_only=True`, naming the file."""
    from lightning_fsdp2.checkpoint import load_torch_file

    class Payload:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "x": Payload()}, path)
    with pytest.raises(CheckpointError, match=r"evil\.ckpt.*weights_only"):
        load_torch_file(path)


# =========================================================================== conversion
def test_sharded_checkpoint_converts_to_full_and_to_hugging_face(pretrained: Path, saved: dict, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    full = torch.load(saved["full"], weights_only=True, map_location="cpu")
    converted_path = sharded_to_full(saved["sharded"], tmp_path / "converted.ckpt")
    converted = torch.load(converted_path, weights_only=True, map_location="cpu")
    assert converted["state_dict"].keys() == full["state_dict"].keys()
    for key, value in full["state_dict"].items():
        assert torch.allclose(converted["state_dict"][key], value, atol=1e-6), key
    opt, ref_opt = converted["optimizer_states"][0], full["optimizer_states"][0]
    assert opt["state"].keys() == ref_opt["state"].keys()
    assert [g["params"] for g in opt["param_groups"]] == [g["params"] for g in ref_opt["param_groups"]]
    assert torch.allclose(opt["state"][0]["exp_avg"], ref_opt["state"][0]["exp_avg"], atol=1e-6)
    assert converted["loops"] == full["loops"] and converted["lr_schedulers"] == full["lr_schedulers"]

    # The command line writes Hugging Face safetensors that `from_pretrained` loads.
    hf_dir = tmp_path / "hf"
    command = ["-m", "lightning_fsdp2.convert", str(saved["sharded"]), str(hf_dir), "--to", "hf", "--config-from"]
    subprocess.run([sys.executable, *command, str(pretrained)], check=True, capture_output=True)
    expected = LlamaForCausalLM(tiny_llama_config())
    expected.load_state_dict({k.removeprefix("model."): v for k, v in full["state_dict"].items()})
    assert torch.allclose(_logits(AutoModelForCausalLM.from_pretrained(hf_dir)), _logits(expected), atol=1e-5)
    from_full = to_hf_safetensors(saved["full"], tmp_path / "hf-from-full", prefix="model.", config_from=pretrained)
    assert torch.allclose(_logits(AutoModelForCausalLM.from_pretrained(from_full)), _logits(expected), atol=1e-5)


def test_truncated_sharded_index_is_named(saved: dict, tmp_path: Path) -> None:
    import shutil

    broken = tmp_path / "broken.ckpt"
    shutil.copytree(saved["sharded"], broken)
    (broken / ".metadata").write_bytes((broken / ".metadata").read_bytes()[:20])
    with pytest.raises(CheckpointError, match=r"broken\.ckpt/\.metadata"):
        check_sharded_files(broken)
