"""Offline conversion: a sharded checkpoint into a full one, either format into Hugging Face safetensors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_fsdp2.convert import sharded_to_full, to_hf_safetensors
from tests.models import probe_logits, tiny_llama_config


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
    assert not [k for k in converted if k.startswith("_lightning_fsdp2")], "no package-private keys in the file"

    # The command line writes Hugging Face safetensors that `from_pretrained` loads.
    hf_dir = tmp_path / "hf"
    command = ["-m", "lightning_fsdp2.convert", str(saved["sharded"]), str(hf_dir), "--to", "hf", "--config-from"]
    subprocess.run([sys.executable, *command, str(pretrained)], check=True, capture_output=True)
    expected = LlamaForCausalLM(tiny_llama_config())
    expected.load_state_dict({k.removeprefix("model."): v for k, v in full["state_dict"].items()})
    assert torch.allclose(probe_logits(AutoModelForCausalLM.from_pretrained(hf_dir)), probe_logits(expected), atol=1e-5)
    from_full = to_hf_safetensors(saved["full"], tmp_path / "hf-from-full", prefix="model.", config_from=pretrained)
    assert torch.allclose(probe_logits(AutoModelForCausalLM.from_pretrained(from_full)), probe_logits(expected), atol=1e-5)


@pytest.mark.slow  # about 20 s: two training runs; `make test` time
def test_hf_export_of_a_lora_checkpoint_is_refused_with_a_pointer(pretrained: Path, tmp_path: Path) -> None:
    """A LoRA run's checkpoint holds peft's names, which from_pretrained cannot read: the converter refuses (exit 1,
    nothing written) and points at save_merged/save_adapter; with --keep-peft-names it writes them for
    load_pretrained, which gives the run's logits."""
    from transformers import LlamaForCausalLM

    from lightning_fsdp2 import load_pretrained
    from tests.helpers import run_distributed
    from tests.models import build_llama, fit_resumable

    ckpt = tmp_path / "lora.ckpt"
    trained = run_distributed(fit_resumable, 2, str(pretrained), 1, str(ckpt), None, None, {"lora": True})[0]["state"]
    command = [sys.executable, "-m", "lightning_fsdp2.convert", str(ckpt), str(tmp_path / "hf"), "--to", "hf"]
    refused = subprocess.run(command, capture_output=True, text=True)
    assert refused.returncode == 1 and "save_merged" in refused.stderr and "lora_A" in refused.stderr, refused.stderr
    assert not (tmp_path / "hf").exists()
    subprocess.run([*command, "--keep-peft-names"], check=True, capture_output=True)
    model = build_llama(lora=True)
    load_pretrained(model, tmp_path / "hf")
    reference = build_llama(lora=True)
    reference.load_state_dict({k.removeprefix("model."): v for k, v in trained.items()})
    assert torch.allclose(probe_logits(model), probe_logits(reference), atol=1e-6)
    assert isinstance(model.get_base_model(), LlamaForCausalLM)
