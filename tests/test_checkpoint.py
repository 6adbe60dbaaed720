"""Checkpoints: pretrained weights into the sharded model, full and sharded saves, resume at any world size, safety."""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_fsdp2 import CheckpointFileError, FSDP2Strategy, load_pretrained
from lightning_fsdp2.checkpoint.safe_dcp import check_sharded_files
from tests.helpers import run_distributed
from tests.models import (
    fit_resumable,
    TokenDataset, probe_logits, quiet_trainer_kwargs, save_tiny_pretrained, tiny_llama_config, tiny_model, training_inputs,
)


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
    tied = save_tiny_pretrained(tmp_path / "tied", seed=1, tie_word_embeddings=True)
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
        "sharded-safetensors, before peft": probe_logits(reference),
        "sharded-safetensors, after peft": probe_logits(reference),
        "pytorch_model.bin": probe_logits(reference),
        "peft model weights": probe_logits(peft_model),
        "bf16-true, tied": probe_logits(tied_reference),
    }
    assert (expected["peft model weights"] - expected["pytorch_model.bin"]).abs().max() > 1e-3  # adapters matter
    for name, want in expected.items():
        for rank, result in enumerate(results):
            got = result[name]["logits"]
            tolerance = 2e-2 if "bf16" in name else 1e-5
            assert (got - want).abs().max() <= tolerance, f"{name}, rank {rank}: {(got - want).abs().max()}"
    assert results[0]["bf16-true, tied"]["dtype"] == "torch.bfloat16"
    assert results[0]["bf16-true, tied"]["tied"], "tied weights stay tied"


def test_load_pretrained_reads_a_lora_runs_own_checkpoint(pretrained: Path, tmp_path: Path) -> None:
    """A LoRA run's full Lightning checkpoint (names `model.base_model.model....`, adapters included) is a source for
    a new run, declared before or after get_peft_model: the new model gives the trained run's logits."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    ckpt = tmp_path / "lora-run.ckpt"
    trained = run_distributed(fit_resumable, 2, str(pretrained), 1, str(ckpt), None, None, {"lora": True})[0]["state"]
    reference = get_peft_model(LlamaForCausalLM(tiny_llama_config()),
                               LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    reference.load_state_dict({k.removeprefix("model."): v for k, v in trained.items()})
    cases = {
        "before peft": (dict(source=str(ckpt)), "32-true"),
        "after peft": (dict(source=str(ckpt), when="after-peft"), "32-true"),
    }
    expected = probe_logits(reference)
    for result in run_distributed(_probe, 2, cases):
        for name in cases:
            assert torch.allclose(result[name]["logits"], expected, atol=1e-5), name
    # Loading at once into a model without adapters: the adapter tensors have nowhere to go, and the error says why.
    with pytest.raises(CheckpointFileError, match="8 of them are peft adapter tensors and the model has no peft adapters"):
        load_pretrained(LlamaForCausalLM(tiny_llama_config()), ckpt)


def test_load_pretrained_loads_at_once_on_a_real_model(pretrained: Path) -> None:
    """Without meta (one device, DDP) the same call loads immediately, so one LightningModule serves every strategy."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    model = LlamaForCausalLM(tiny_llama_config())
    load_pretrained(model, pretrained)
    assert torch.equal(probe_logits(model), probe_logits(AutoModelForCausalLM.from_pretrained(pretrained)))


def test_load_pretrained_names_what_does_not_fit(pretrained: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file
    from transformers import LlamaForCausalLM

    weights = {}
    for file in sorted(pretrained.glob("*.safetensors")):
        weights.update(load_file(file))
    model = LlamaForCausalLM(tiny_llama_config())

    partial = dict(weights)
    del partial["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(CheckpointFileError, match=r"not in the source: 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_pretrained(model, partial)

    extra = dict(weights, **{"model.layers.9.mlp.up_proj.weight": torch.zeros(1)})
    with pytest.raises(CheckpointFileError, match=r"fit nothing in the model: 'model\.layers\.9\.mlp\.up_proj\.weight'"):
        load_pretrained(model, extra)
    with pytest.warns(UserWarning, match="model.layers.9.mlp.up_proj.weight"):
        load_pretrained(model, extra, strict=False)

    wider = LlamaForCausalLM(tiny_llama_config(intermediate_size=96))
    with pytest.raises(CheckpointFileError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight' has shape \(128, 64\) in .*"
                       r"but 'model\.layers\.0\.mlp\.up_proj\.weight' has shape \(96, 64\)"):
        load_pretrained(wider, pretrained)

    # A truncated file (an interrupted download) is named.
    save_file(weights, tmp_path / "model.safetensors")
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointFileError, match=r"model\.safetensors.*truncated or corrupt"):
        load_pretrained(model, tmp_path / "model.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no model weights"):
        load_pretrained(model, tmp_path / "empty")


def _weights(pretrained: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights = {}
    for file in sorted(pretrained.glob("*.safetensors")):
        weights.update(load_file(file))
    return weights


def test_load_pretrained_refuses_integer_bool_and_non_finite_sources(pretrained: Path, tmp_path: Path) -> None:
    """An int64 or bool tensor for a float parameter (a file that does not hold weights), or a NaN/infinity in a
    weight, is an error naming the tensor and the file, unless allowed; float32 into bf16 stays a plain cast."""
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    weights = _weights(pretrained)
    name = "model.layers.0.mlp.up_proj.weight"
    for dtype in (torch.int64, torch.bool):
        bad = dict(weights, **{name: (weights[name] * 100).to(dtype)})
        save_file(bad, tmp_path / "bad.safetensors")
        model = LlamaForCausalLM(tiny_llama_config())
        with pytest.raises(CheckpointFileError, match=rf"'{name}' is {str(dtype)[6:]} in .*bad\.safetensors but '{name}'"
                           r" is float32 in the model.*allow_cast=True"):
            load_pretrained(model, tmp_path / "bad.safetensors")
        load_pretrained(model, tmp_path / "bad.safetensors", allow_cast=True)  # asked for: cast as copy_ casts
        assert torch.equal(model.get_parameter(name), bad[name].float())
    with pytest.raises(CheckpointFileError, match="would be cast into floating-point.*is int64 in the given state dict"):
        load_pretrained(LlamaForCausalLM(tiny_llama_config()), dict(weights, **{name: weights[name].long()}))

    for value in (float("nan"), float("inf")):
        bad = dict(weights, **{name: weights[name].clone()})
        bad[name][-1, 3] = value
        save_file(bad, tmp_path / "bad.safetensors")
        model = LlamaForCausalLM(tiny_llama_config())
        with pytest.raises(CheckpointFileError, match=rf"NaN or infinite values into 1 parameter\(s\) of"
                           rf" LlamaForCausalLM: '{name}' \(from '{name}' in .*bad\.safetensors\).*allow_non_finite"):
            load_pretrained(model, tmp_path / "bad.safetensors")
        load_pretrained(model, tmp_path / "bad.safetensors", allow_non_finite=True)
        assert torch.equal(model.get_parameter(name).isfinite(), bad[name].isfinite())

    halves = LlamaForCausalLM(tiny_llama_config()).to(torch.bfloat16)
    load_pretrained(halves, pretrained)  # float32 -> bf16: the usual cast, no error
    assert torch.equal(halves.get_parameter(name), weights[name].to(torch.bfloat16))


def _load_nan(source: str) -> str:
    module = PretrainedProbe(source, lora=False)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy(), **quiet_trainer_kwargs())
    try:
        trainer.validate(module, verbose=False)
    except CheckpointFileError as err:
        return str(err)
    return "loaded"


def test_a_nan_in_one_ranks_slice_fails_every_rank(pretrained: Path, tmp_path: Path) -> None:
    """Under FSDP2 each rank reads only its rows: a NaN in the last row is seen by rank 1 alone, and both ranks raise
    the same error, naming the tensor and the rank that found it, before any step."""
    from safetensors.torch import save_file

    weights = _weights(pretrained)
    name = "model.layers.1.mlp.down_proj.weight"
    weights[name][-1, 0] = float("nan")  # the last row: rank 1's shard of dim 0
    save_file(weights, tmp_path / "model.safetensors")
    messages = run_distributed(_load_nan, 2, str(tmp_path / "model.safetensors"))
    assert messages[0] == messages[1]
    assert f"'{name}' (from '{name}' in {tmp_path / 'model.safetensors'})" in messages[0]
    assert "found by rank(s) 1 in their slices" in messages[0]


def test_load_pretrained_matches_prefixes_and_keeps_buffers_it_lacks(pretrained: Path) -> None:
    """A ...ForCausalLM checkpoint into its base model, a Lightning checkpoint's names, and a persistent buffer the
    source does not hold (kept, not an error)."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM, LlamaModel

    reference = AutoModelForCausalLM.from_pretrained(pretrained)
    base = LlamaModel(tiny_llama_config())
    with pytest.warns(UserWarning, match="lm_head.weight"):
        load_pretrained(base, pretrained, strict=False)  # the head has no place in the base model
    assert torch.equal(base.layers[1].mlp.up_proj.weight, reference.model.layers[1].mlp.up_proj.weight)

    lightning_names = {f"model.{k}": v for k, v in reference.state_dict().items()}  # as LightningModule.state_dict()
    model = LlamaForCausalLM(tiny_llama_config())
    model.register_buffer("calibration", torch.full((3,), 7.0))  # persistent, in no checkpoint
    load_pretrained(model, lightning_names)
    assert torch.equal(probe_logits(model), probe_logits(reference))
    assert torch.equal(model.calibration, torch.full((3,), 7.0))


def test_load_pretrained_on_meta_outside_fsdp2_is_refused(pretrained: Path) -> None:
    """A load deferred where nothing would run it later would be lost; say so instead."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(tiny_llama_config())
    with pytest.raises(CheckpointFileError, match="nothing will materialize it"):
        load_pretrained(model, pretrained)


def test_full_state_dict_load_names_unexpected_and_missing_keys() -> None:
    from lightning_fsdp2.checkpoint.formats import load_full_state_dict

    model = torch.nn.Sequential(torch.nn.Linear(2, 3))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointFileError, match=r"1 key\(s\) in it fit nothing in the model: 'extra'"):
        load_full_state_dict(model, {**state, "extra": torch.zeros(1)})
    with pytest.raises(CheckpointFileError, match=r"not in it: '0\.bias'"):
        load_full_state_dict(model, {"0.weight": state["0.weight"]})
    load_full_state_dict(model, {"0.weight": state["0.weight"] + 1}, strict=False)
    assert torch.equal(model[0].weight, state["0.weight"] + 1)


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
@pytest.mark.parametrize("layers", [4, 12])
def test_memory_per_rank_while_loading_and_saving(layers: int, tmp_path: Path) -> None:
    """68 MB (4 layers) and 140 MB (12 layers) of fp32 weights at world size 2. Loading: each rank's peak is its shard
    plus about one tensor's slice, at 12 layers under one whole copy of the model (an eager build needs two). Saving a full
    checkpoint: rank 0 holds about one tensor (the file is streamed), whatever the model size; rank 1 about nothing."""
    config = dict(
        vocab_size=8192, hidden_size=512, intermediate_size=1024, num_hidden_layers=layers, max_position_embeddings=64
    )
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(tiny_llama_config(**config))
    total_kb = sum(p.numel() * p.element_size() for p in model.parameters()) // 1024
    model.save_pretrained(tmp_path, max_shard_size="8MB")
    largest_kb = max(p.numel() * p.element_size() for p in model.parameters()) // 1024
    del model
    results = run_distributed(_measure_load_and_save, 2, str(tmp_path), config, str(tmp_path / "full.ckpt"))
    slack_kb = 32 * 1024  # allocator, arenas and bookkeeping: 13-16 MB here, 20 MB once on a busy CI machine
    # Shard + one tensor + slack: at 12 layers under one whole copy of the model (what an eager load holds besides
    # the shard); at 4 layers the slack is too large a part of the model for that comparison.
    bound_kb = total_kb // 2 + largest_kb + slack_kb
    if layers == 12:
        assert bound_kb < 0.9 * total_kb, "the bound must show that no rank holds the whole model"
    for rank, result in enumerate(results):
        print(f"rank {rank}: +{result['load_kb'] / 1024:.1f} MB loading, +{result['save_kb'] / 1024:.1f} MB saving;"
              f" model {total_kb / 1024:.1f} MB, largest tensor {largest_kb / 1024:.1f} MB")
        assert result["load_kb"] <= bound_kb, (rank, result)
    assert results[0]["save_kb"] <= largest_kb + slack_kb, f"rank 0 held more than one tensor while saving: {results[0]}"
    assert results[1]["save_kb"] <= slack_kb, results[1]
    saved = torch.load(tmp_path / "full.ckpt", weights_only=True, mmap=True)["state_dict"]
    assert sum(t.numel() * t.element_size() for t in saved.values()) // 1024 == total_kb, "the whole model is in the file"


# =========================================================================== the primitives, on uneven shards
def _gather_and_reload_uneven() -> dict:
    """At world size 3 a 5-row weight is split 2/2/1 and a 2-row one 1/1/0: gather and slice-wise load both."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_fsdp2.checkpoint.formats import load_full_state_dict
    from lightning_fsdp2.checkpoint.shards import gather_to_rank0

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


# =========================================================================== reading safely
def test_checkpoints_are_read_without_unpickling_code(tmp_path: Path) -> None:
    """A pickle that would run code is refused by `weights_only=True`, naming the file."""
    from lightning_fsdp2.checkpoint.files import load_torch_file

    class Payload:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "x": Payload()}, path)
    with pytest.raises(CheckpointFileError, match=r"evil\.ckpt.*weights_only"):
        load_torch_file(path)




def test_truncated_sharded_index_is_named(saved: dict, tmp_path: Path) -> None:
    import shutil

    broken = tmp_path / "broken.ckpt"
    shutil.copytree(saved["sharded"], broken)
    (broken / ".metadata").write_bytes((broken / ".metadata").read_bytes()[:20])
    with pytest.raises(CheckpointFileError, match=r"broken\.ckpt/\.metadata"):
        check_sharded_files(broken)


class _TouchOnUnpickle:
    """A pickle that creates `marker` when it is unpickled: what a malicious checkpoint would do, harmlessly."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _evil_copy(saved: dict, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the sharded checkpoint whose `.metadata` would create a marker file if unpickled."""
    import pickle
    import shutil

    evil, marker = tmp_path / "evil.ckpt", tmp_path / "MARKER"
    shutil.copytree(saved["sharded"], evil)
    payload = pickle.dumps(_TouchOnUnpickle(marker))
    pickle.loads(payload)  # the payload works: plain unpickling runs it
    assert marker.exists()
    marker.unlink()
    (evil / ".metadata").write_bytes(payload)
    return evil, marker


def test_crafted_sharded_index_is_refused(saved: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A `.metadata` that would run code when unpickled is refused, naming the file and the global, on every path
    that reads it: the checks before a load, the safe DCP reader, the converter and its command line."""
    import re

    from lightning_fsdp2.checkpoint import safe_dcp
    from lightning_fsdp2.convert import main, read_full_checkpoint

    evil, marker = _evil_copy(saved, tmp_path)
    refused = r"evil\.ckpt/\.metadata refers to `pathlib\.Path\.touch`.*may be malicious"
    with pytest.raises(CheckpointFileError, match=refused):
        check_sharded_files(evil)
    with pytest.raises(CheckpointFileError, match=refused):
        safe_dcp.load({"state_dict": {}}, evil)  # DCP's own load path, past our checks
    with pytest.raises(CheckpointFileError, match=refused):
        read_full_checkpoint(evil)
    with pytest.raises(SystemExit) as exited:
        main([str(evil), str(tmp_path / "out.ckpt")])
    assert exited.value.code == 1 and re.search(refused, capsys.readouterr().err)
    assert not marker.exists() and not (tmp_path / "out.ckpt").exists()
    assert read_full_checkpoint(saved["sharded"])["state_dict"]  # a real one still reads


def test_crafted_sharded_item_is_refused(tmp_path: Path) -> None:
    """A non-tensor item that would run code is read with `weights_only=True` (torch's planner would run it)."""
    import torch.distributed.checkpoint as dcp

    from lightning_fsdp2.checkpoint import safe_dcp
    from lightning_fsdp2.convert import read_full_checkpoint

    evil, marker = tmp_path / "evil.ckpt", tmp_path / "MARKER"
    dcp.save({"state_dict": {"w": torch.ones(2)}, "x": _TouchOnUnpickle(marker)}, checkpoint_id=evil, no_dist=True)
    torch.save({"epoch": 0}, evil / "meta.pt")
    dcp.load({"state_dict": {"w": torch.zeros(2)}, "x": None}, checkpoint_id=evil, no_dist=True)
    assert marker.exists()  # torch's own planner runs the payload
    marker.unlink()

    with pytest.raises(CheckpointFileError, match=r"'x' in .*evil\.ckpt holds objects .*weights_only=True"):
        safe_dcp.load({"state_dict": {"w": torch.zeros(2)}, "x": None}, evil)
    with pytest.raises(CheckpointFileError, match=r"'x' in .*evil\.ckpt holds objects .*weights_only=True"):
        read_full_checkpoint(evil)
    assert not marker.exists()


@pytest.mark.parametrize("where", ["../outside.distcp", "absolute"])
def test_sharded_index_pointing_outside_is_refused(saved: dict, tmp_path: Path, where: str) -> None:
    """An index entry naming a file outside the checkpoint directory is refused, even when that file exists."""
    import pickle
    import shutil

    from lightning_fsdp2.checkpoint.safe_dcp import read_dcp_metadata

    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved["sharded"], ckpt)
    metadata = read_dcp_metadata(ckpt)
    info = next(iter(metadata.storage_data.values()))
    shutil.copy(ckpt / info.relative_path, tmp_path / "outside.distcp")  # so that only the path is wrong
    info.relative_path = str(tmp_path / "outside.distcp") if where == "absolute" else where
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointFileError, match=r"ckpt/\.metadata points .* at '.*outside\.distcp'.*not a file inside"):
        check_sharded_files(ckpt)


@pytest.mark.parametrize("where", ["../outside.safetensors", "absolute"])
def test_weight_index_pointing_outside_is_refused(pretrained: Path, tmp_path: Path, where: str) -> None:
    """A `model.safetensors.index.json` entry naming a file outside the model directory is refused; a normal index
    still opens."""
    import json
    import shutil

    from lightning_fsdp2.checkpoint.sources import open_source

    model = tmp_path / "model"
    shutil.copytree(pretrained, model)
    assert open_source(model).keys()
    index = json.loads((model / "model.safetensors.index.json").read_text())
    key, name = next(iter(index["weight_map"].items()))
    shutil.copy(model / name, tmp_path / "outside.safetensors")  # so that only the path is wrong
    index["weight_map"][key] = str(tmp_path / "outside.safetensors") if where == "absolute" else where
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointFileError, match=rf"index\.json maps '{key}' to '.*outside\.safetensors'.*not a file inside"):
        open_source(model)
    with pytest.raises(CheckpointFileError, match=r"outside\.safetensors"):
        load_pretrained(torch.nn.Linear(1, 1), model)


# =========================================================================== nested peft wrappers
def _moe_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    )


def _moe_lora(model: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    # all-linear wraps the fused experts twice: the experts module and the projection inside it.
    return get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules="all-linear"))


class MoEProbe(L.LightningModule):
    def __init__(self, source: str) -> None:
        super().__init__()
        self.source, self.model = source, None
        self.logits: list[torch.Tensor] = []

    def configure_model(self) -> None:
        if self.model is None:
            from transformers import Qwen3MoeForCausalLM

            self.model = _moe_lora(Qwen3MoeForCausalLM(_moe_config()))
            load_pretrained(self.model, self.source)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.logits.append(self.model(input_ids=batch).logits.detach().float())

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TokenDataset(4), batch_size=4)


def _moe_probe(source: str) -> torch.Tensor:
    module = MoEProbe(source)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy(), **quiet_trainer_kwargs())
    trainer.validate(module, verbose=False)
    return module.logits[0]


def test_twice_wrapped_adapters_keep_distinct_names_and_load(tmp_path: Path) -> None:
    """LoRA all-linear on Qwen3-MoE: `experts.base_layer.lora_A` and `experts.lora_A` are different tensors; a whole
    peft state dict with non-zero adapters loads into the sharded model and gives the eager model's logits."""
    from transformers import Qwen3MoeForCausalLM

    from lightning_fsdp2.peft_support import canonical_name

    torch.manual_seed(0)
    eager = _moe_lora(Qwen3MoeForCausalLM(_moe_config()))
    with torch.no_grad():
        for name, param in eager.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)  # adapters that change the output, each its own values
    names = [n for n, _ in eager.named_parameters()]
    assert any(".experts.base_layer.lora_A." in n for n in names) and any(".experts.lora_A." in n for n in names)
    assert len({canonical_name(n) for n in names}) == len(names), "two tensors share a canonical name"
    torch.save(eager.state_dict(), tmp_path / "moe-lora.pt")
    logits = run_distributed(_moe_probe, 2, str(tmp_path / "moe-lora.pt"))
    expected = probe_logits(eager)
    for rank_logits in logits:
        assert torch.allclose(rank_logits, expected, atol=1e-5), (rank_logits - expected).abs().max()


def test_load_pretrained_after_get_peft_model_with_modules_to_save(pretrained: Path) -> None:
    """With modules_to_save the base layer and its trainable copy both start from the checkpoint's weight, from a
    Hugging Face directory and from a whole peft state dict alike (peft saves the copy under the base layer's name in
    adapter files only)."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    def build():
        config = LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
        return get_peft_model(LlamaForCausalLM(tiny_llama_config()), config)

    head = {}
    for file in pretrained.glob("*.safetensors"):
        head.update({k: v for k, v in load_file(file).items() if k == "lm_head.weight"})
    model = build()
    load_pretrained(model, pretrained)
    lm_head = model.base_model.model.lm_head
    assert torch.equal(lm_head.original_module.weight, head["lm_head.weight"])
    assert torch.equal(lm_head.modules_to_save["default"].weight, head["lm_head.weight"])
    with torch.no_grad():
        lm_head.modules_to_save["default"].weight.mul_(2)  # the copy trained away from the base
    state = model.state_dict()
    again = build()
    load_pretrained(again, state)
    for key, value in again.state_dict().items():
        assert torch.equal(value, state[key]), key


# =========================================================================== architectures, and checkpoints transformers converts
class ArchitectureProbe(L.LightningModule):
    def __init__(self, name: str, source: str, inputs: dict) -> None:
        super().__init__()
        self.name, self.source, self.inputs, self.model = name, source, inputs, None
        self.outputs: list[torch.Tensor] = []

    def configure_model(self) -> None:
        if self.model is None:
            self.model, _ = tiny_model(self.name)
            load_pretrained(self.model, self.source)

    def validation_step(self, batch, batch_idx: int) -> None:
        self.outputs.append(self.model(**self.inputs).logits.float())

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TokenDataset(1), batch_size=1)


def _sharded_outputs(name: str, source: str, inputs: dict) -> torch.Tensor:
    module = ArchitectureProbe(name, source, inputs)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy(), **quiet_trainer_kwargs())
    trainer.validate(module, verbose=False)
    return module.outputs[0]


ARCHITECTURES = ["gpt2", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "phi3", "opt", "bert", "t5", "bart",
                 "qwen3_moe", "qwen2_moe", "mixtral", "vit"]


class _Recording:
    """A tensor source that notes which keys are read."""

    def __init__(self, source) -> None:
        self.source, self.read_keys = source, set()

    def __getattr__(self, name: str):
        return getattr(self.source, name)

    def read(self, key: str, index):
        self.read_keys.add(key)
        return self.source.read(key, index)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_a_slice_of_fused_experts_reads_only_those_experts(name: str, tmp_path: Path) -> None:
    """Experts stored one tensor each and fused in memory (stacked along dim 0, FSDP2's shard dim): rows a:b of the
    fused tensor are built from experts a:b alone, and equal those rows of what from_pretrained builds."""
    from lightning_fsdp2.checkpoint.sources import ConvertedSource, open_source

    torch.manual_seed(0)
    model, _ = tiny_model(name)
    model.save_pretrained(tmp_path)
    reference = type(model).from_pretrained(tmp_path).state_dict()
    recording = _Recording(open_source(tmp_path))
    converted = ConvertedSource(recording, model)
    for target in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        recording.read_keys.clear()
        rows = converted.read(target, (slice(2, 4), slice(None), slice(None)))
        assert torch.equal(rows, reference[target][2:4])
        experts = {int(k.split(".experts.")[1].split(".")[0]) for k in recording.read_keys}
        assert experts == {2, 3}, sorted(recording.read_keys)


def test_a_load_that_does_not_fit_after_conversion_says_the_names_are_converted(tmp_path: Path) -> None:
    """A Mixtral checkpoint with an expert missing: the error names the fused tensor whose shape differs and says
    the source's names are those after transformers' conversions, with one stored key and what it became."""
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model, _ = tiny_model("mixtral")
    model.save_pretrained(tmp_path)
    weights = {}
    for file in sorted(tmp_path.glob("*.safetensors")):
        weights.update(load_file(file))
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in weights  # how Mixtral's checkpoints store them
    for key in [k for k in weights if ".experts.3." in k and k.startswith("model.layers.0.")]:
        del weights[key]
    fresh, _ = tiny_model("mixtral")
    with pytest.raises(CheckpointFileError) as error:
        load_pretrained(fresh, weights)
    message = str(error.value)
    assert "'model.layers.0.mlp.experts.gate_up_proj' has shape (3, " in message
    assert "after transformers' checkpoint conversions" in message
    assert "'model.layers.0.block_sparse_moe.experts.0.w1.weight' and 5 more -> 'model.layers.0.mlp.experts.gate_up_proj'" \
        in message


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_load_pretrained_gives_from_pretrained_outputs_across_architectures(name: str, tmp_path: Path) -> None:
    """A save_pretrained directory, built on meta, sharded at world size 2 and loaded with load_pretrained, gives the
    outputs of from_pretrained's model in one process. MoE models (experts stored one tensor per expert, fused in
    memory) and ViT (checkpoint names) go through transformers' own conversions."""
    torch.manual_seed(0)
    model, inputs = tiny_model(name)
    model.save_pretrained(tmp_path)
    reference = type(model).from_pretrained(tmp_path)
    with torch.no_grad():
        expected = reference(**inputs).logits.float()
    for outputs in run_distributed(_sharded_outputs, 2, name, str(tmp_path), inputs):
        assert torch.allclose(outputs, expected, atol=1e-5), (outputs - expected).abs().max()


class ArchitectureTraining(ArchitectureProbe):
    """Three SGD steps on fixed batches (this rank's half of each), with dropout off (eval mode) so that one process
    and two give the same numbers."""

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.model.eval()  # no dropout: the sharded run and the reference draw different masks
        rank, world = self.global_rank, self.trainer.world_size
        inputs = {k: v[rank::world].contiguous() for k, v in training_inputs(self.name, self.inputs).items()}
        return self.model(**inputs).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TokenDataset(3), batch_size=1)  # three steps; the batch itself comes from self.inputs


def _train_sharded(name: str, source: str, inputs: dict) -> dict:
    from tests.models import full_state

    module = ArchitectureTraining(name, source, inputs)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=FSDP2Strategy(), max_steps=3, limit_val_batches=0,
        num_sanity_val_steps=0, **quiet_trainer_kwargs(),
    )
    trainer.fit(module)
    return full_state(module.model)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_training_parity_with_one_process_across_architectures(name: str, tmp_path: Path) -> None:
    """Three SGD steps at world size 2 (each rank half of every batch) end with the weights of three steps in one
    process on the whole batches, from the same save_pretrained weights (fp32, max abs diff <= 1e-4)."""
    torch.manual_seed(0)
    model, inputs = tiny_model(name)
    model.save_pretrained(tmp_path)
    reference = type(model).from_pretrained(tmp_path)
    reference.eval()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        reference(**training_inputs(name, inputs)).loss.backward()
        optimizer.step()
    expected = {k: v.detach() for k, v in reference.state_dict().items()}
    sharded = run_distributed(_train_sharded, 2, name, str(tmp_path), inputs)[0]
    assert sharded.keys() <= expected.keys()
    worst = max((sharded[k] - expected[k]).abs().max().item() for k in sharded)
    assert worst <= 1e-4, f"{name}: max abs diff {worst}"
    moved = max((expected[k] - v).abs().max().item() for k, v in type(model).from_pretrained(tmp_path).state_dict().items())
    assert moved > 1e-3, "the steps changed the weights"
