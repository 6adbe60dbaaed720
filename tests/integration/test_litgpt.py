"""LitGPT's own LoRA recipe (the pinned LitGPT's ``litgpt finetune_lora``), with only its strategy swapped.

The recipe runs as LitGPT's users run it (its command line and config file, Fabric's launcher starting rank 1 by
re-running the command), on a tiny checkpoint, tokenizer and Alpaca file written here (``litgpt_lora.py``). The
reference is the same recipe with Lightning's own ``DDPStrategy`` swapped in: no code of ours. (The recipe as shipped,
Lightning's ``ModelParallelStrategy``, is no reference: its ``load_checkpoint`` replaces the parameters with
``load_state_dict(..., assign=True)`` after the optimizer was made over the old ones, and the adapters it saves are
the ones it loaded, at every step; checked with this file's inputs.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.integration.litgpt_lora import write_config, write_inputs

pytest.importorskip("litgpt", reason="LitGPT's recipe: `make test` installs the pinned LitGPT")

SCRIPT = Path(__file__).with_name("litgpt_lora.py")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("litgpt")
    write_inputs(path)
    return path


def _recipe(root: Path, strategy: str, sample: bool = False, timeout: float = 300, **env: str) -> tuple[int, str]:
    """Run the recipe (``litgpt finetune_lora --config ...``) with ``strategy`` swapped in; its exit code and output."""
    name = f"{strategy}-sample" if sample else strategy
    config = write_config(root, name, sample)
    clean = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "RANK", "NODE_RANK")}
    proc = subprocess.run([sys.executable, str(SCRIPT), "finetune_lora", "--config", str(config)], cwd=root,
                          env={**clean, "LITGPT_STRATEGY": strategy, **env}, capture_output=True, text=True,
                          timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def _lora(root: Path, name: str, step: str) -> dict[str, torch.Tensor]:
    return torch.load(root / f"out-{name}" / step / "lit_model.pth.lora", weights_only=True)["model"]


@pytest.mark.slow
def test_litgpts_own_lora_recipe_with_fsdp2_saves_the_adapters_ddp_saves(root: Path) -> None:
    """Every LoRA checkpoint the recipe writes (steps 2 and 4, the final one) equals DDP's (<= 1e-4), and the
    adapters did train (they left the values they were loaded with). Before lazy loads were taken, the recipe failed
    in `load_checkpoint` ("aten.copy_.default got mixed torch.Tensor and DTensor")."""
    for strategy in ("ddp", "fsdp2"):
        code, out = _recipe(root, strategy)
        assert code == 0, out[-4000:]
    start = torch.load(root / "checkpoints" / "tiny-llama" / "lit_model.pth", weights_only=True)
    for step in ("step-000002", "step-000004", "final"):
        want, got = _lora(root, "ddp", step), _lora(root, "fsdp2", step)
        assert got.keys() == want.keys() and len(want) == 16
        worst = max((got[k] - want[k]).abs().max().item() for k in want)
        assert worst <= 1e-4, (step, worst)
        assert max((got[k] - start[k]).abs().max().item() for k in got) > 1e-3, step
    assert (root / "out-fsdp2" / "final" / "lit_model.pth").is_file()  # the recipe's merge_lora on rank 0


@pytest.mark.slow
def test_litgpts_sampling_on_rank_0_alone_fails_within_the_bound_naming_the_cause(root: Path) -> None:
    """The recipe's evaluation samples on rank 0 alone (`generate_example`) while rank 1 waits in a barrier: with
    FSDP2 that forward cannot run (it all-gathers from every rank). It fails within `unmatched_forward_timeout`,
    saying so and what to do, instead of hanging until the process group's 30-minute timeout."""
    started = time.monotonic()
    code, out = _recipe(root, "fsdp2", sample=True, UNMATCHED_FORWARD_TIMEOUT="10")
    assert code != 0
    assert "PeerLostError" in out and "ran a forward of the sharded" in out, out[-4000:]
    assert "sample (or evaluate, or `generate`) on all ranks" in out, out[-4000:]
    assert time.monotonic() - started < 150
