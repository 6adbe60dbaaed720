"""The example run as a user runs it: Lightning's own launchers start the processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("start_method", ["popen", "spawn"])
def test_example_runs_under_lightnings_launchers(start_method: str, smollm2_two_layers: Path, tmp_path: Path) -> None:
    """`popen` re-runs the script per rank (Lightning's default); `spawn` starts workers with torch.multiprocessing.
    The demo's task on two of SmolLM2's layers (its real tokenizer and shapes)."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "RANK", "NODE_RANK")}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "lora_finetune.py"), "--model", str(smollm2_two_layers),
         "--max-steps", "2", "--lr", "3e-3", "--show", "1", "--max-new-tokens", "4", "--start-method", start_method,
         "--precision", "bf16-true",
         "--out", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "validation loss:" in proc.stdout
    val_loss = json.loads((tmp_path / "answers.json").read_text())["val_loss"]
    assert val_loss["after"] < val_loss["before"]  # two steps at lr 3e-3 already help
    # The outputs it prints: peft adapters, the merged model, the loss plot, the report.
    for name in ("adapter/final/adapter_model.safetensors", "adapter/final/adapter_config.json",
                 "merged/config.json", "merged/model.safetensors", "loss.png", "report.md"):
        assert (tmp_path / name).is_file(), name
        assert str(tmp_path / name.split("/")[0]) in proc.stdout, name
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Both exports load without FSDP and agree (bf16 training: bf16 weights, hence the tolerance).
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tokens = torch.arange(64).view(2, 32)
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").float()(input_ids=tokens).logits
        base = AutoModelForCausalLM.from_pretrained(smollm2_two_layers)
        adapted = PeftModel.from_pretrained(base, tmp_path / "adapter" / "final")(input_ids=tokens).logits
    assert (merged - adapted).abs().max() < 0.2


@pytest.mark.slow
@pytest.mark.parametrize(("start_method", "where"), [("spawn", "configure_model"), ("fork", "init")])
def test_after_a_spawned_fit_the_main_process_holds_the_trained_weights(start_method: str, where: str,
                                                                      tmp_path: Path) -> None:
    """As Lightning does for DDP: after fit under spawn/fork, the user's module in the main process has the trained
    weights (equal to the checkpoint written at the end of fit), whether it was built in `__init__` or in
    `configure_model` (run again in the main process)."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "RANK", "NODE_RANK")}
    script = ROOT / "tests" / "integration" / "spawn_fit.py"
    proc = subprocess.run([sys.executable, str(script), start_method, str(tmp_path / "end.ckpt"), where],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = dict(item.split("=") for item in proc.stdout.split("RESULT ")[1].split())
    assert float(result["max_diff"]) == 0.0, result
    assert float(result["moved"]) > 1e-4, result  # trained, not the initial weights


@pytest.mark.slow
def test_fabric_example_runs_and_resumes_at_another_world_size(tmp_path: Path) -> None:
    """examples/fabric_lora.py under Fabric's own launcher (the script re-run per rank): it trains, writes a checkpoint
    and the exports; run again with `--resume` on one process, it continues from the saved step."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "RANK", "NODE_RANK")}
    script = str(ROOT / "examples" / "fabric_lora.py")
    first = subprocess.run([sys.executable, script, "--max-steps", "2", "--out", str(tmp_path)],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    before, after = map(float, (tmp_path / "val_loss.txt").read_text().split())
    assert after < before
    for name in ("checkpoint.pt", "adapter/adapter_model.safetensors", "adapter/adapter_config.json",
                 "merged/config.json", "merged/model.safetensors", "loss.png"):
        assert (tmp_path / name).is_file(), name
    resumed = subprocess.run([sys.executable, script, "--max-steps", "3", "--devices", "1", "--no-merge",
                              "--resume", str(tmp_path / "checkpoint.pt"), "--out", str(tmp_path)],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resumed from {tmp_path / 'checkpoint.pt'} at step 2" in resumed.stdout
    assert "after 3 steps" in resumed.stdout


@pytest.mark.slow
def test_example_with_qlora(smollm2_two_layers: Path, tmp_path: Path) -> None:
    """`examples/lora_finetune.py --qlora`: SmolLM2's MLP weights in NF4 (torchao; its attention projections, which NF4
    cannot split over 2 processes, left in bf16), LoRA trained in fp32 on it; the loss falls and the merged model
    (dequantized base, bf16) loads without peft or torchao."""
    pytest.importorskip("torchao")
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "RANK", "NODE_RANK")}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "lora_finetune.py"), "--qlora", "--model", str(smollm2_two_layers),
         "--max-steps", "3", "--lr", "3e-3", "--show", "1", "--max-new-tokens", "4", "--out", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads((tmp_path / "answers.json").read_text())
    assert record["nf4"] == ["down_proj", "gate_proj", "up_proj"]  # read from the parameters' storage
    assert "base in NF4: down_proj, gate_proj, up_proj" in (tmp_path / "report.md").read_text()
    assert "QLoRA: in NF4: down_proj, gate_proj, up_proj; left in bf16-true: k_proj, o_proj, q_proj, v_proj" in proc.stdout
    val_loss = record["val_loss"]
    assert val_loss["after"] < val_loss["before"]
    import torch
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert merged.model.layers[0].mlp.gate_proj.weight.dtype == torch.bfloat16
