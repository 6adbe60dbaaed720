"""A forward that only rank 0 runs fails within the bound on both ranks, with a message naming the cause
(``lockstep.py``); forwards every rank runs together are not disturbed."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from tests.helpers import run_distributed
from tests.models import tiny_llama_config, world

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
        outcome["error"] = str(err)
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


@pytest.mark.parametrize("value", [0, -1, "60", True])
def test_unmatched_forward_timeout_is_checked_at_construction(value: Any) -> None:
    from lightning_fsdp2 import FSDP2Strategy

    with pytest.raises(ValueError, match="unmatched_forward_timeout"):
        FSDP2Strategy(unmatched_forward_timeout=value)
