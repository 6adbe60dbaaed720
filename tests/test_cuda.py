"""The CUDA-only paths: NCCL, `cpu_offload` (pinned and pageable), `bf16-mixed` and `16-mixed` on a GPU, activation
offloading, and `compile` with inductor's GPU backend. Marked
`cuda`: skipped without a CUDA device; `make gpu-check` runs them. One GPU is enough (world size 1: NCCL's
process group and FSDP2's hooks run as at any world size)."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_fsdp2 import FSDP2Strategy
from tests.helpers import run_distributed
from tests.models import LlamaModule, full_state
from tests.test_strategy import _assert_same_weights, _start_state, _trainer_kwargs

pytestmark = pytest.mark.cuda


def _fit_on_gpu(start_state: dict, strategy_kwargs: dict, precision: str = "32-true") -> dict:
    from torch.distributed.tensor import DTensor

    module = LlamaModule(start_state=start_state)
    seen: list[torch.dtype] = []

    def record(layer: torch.nn.Module, args: tuple) -> None:
        seen.append(layer.weight.dtype)  # the dtype FSDP2 gathered the weight in (the compute dtype)

    class Hook(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            layer = pl_module.model.base_model.model.model.layers[0].mlp.down_proj
            self.handle = layer.register_forward_pre_hook(record)

        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self.handle.remove()

    trainer = L.Trainer(accelerator="cuda", devices=1, strategy=FSDP2Strategy(**strategy_kwargs), precision=precision,
                        callbacks=[Hook()], **_trainer_kwargs())
    trainer.fit(module)
    local = [p.to_local() if isinstance(p, DTensor) else p for p in module.parameters()]
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return {
        "state": {k: v.cpu() for k, v in full_state(module).items()},
        "backend": torch.distributed.get_backend(),
        "devices": sorted({str(t.device.type) for t in local}),
        "pinned": all(t.is_pinned() for t in local if t.device.type == "cpu"),
        "stored": sorted({str(p.dtype) for p in module.parameters()}),
        "computed": sorted({str(d) for d in seen}),
        "losses": module.losses,
        "scaler": type(scaler).__name__ if scaler is not None else None,
    }


def _reference_on_gpu(start_state: dict) -> dict:
    """Lightning's own single-device strategy on the same GPU, the same global batches."""
    module = LlamaModule(start_state=start_state)
    module.configure_model()
    L.Trainer(accelerator="cuda", devices=1, **_trainer_kwargs()).fit(module)
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


@pytest.fixture(scope="module")
def start() -> dict:
    return _start_state()  # (TF32 matmuls are off by default in both runs: fp32 is compared with fp32)


def test_nccl_at_world_size_1_matches_one_gpu(start: dict) -> None:
    reference = _reference_on_gpu(start)
    (result,) = run_distributed(_fit_on_gpu, 1, start, {})
    assert result["backend"] == "nccl"
    assert result["devices"] == ["cuda"]
    _assert_same_weights(result["state"], reference)


@pytest.mark.parametrize("pin_memory", [True, False])
def test_cpu_offload_keeps_the_shards_in_cpu_memory_and_matches_one_gpu(start: dict, pin_memory: bool) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy

    reference = _reference_on_gpu(start)
    (result,) = run_distributed(_fit_on_gpu, 1, start, {"cpu_offload": CPUOffloadPolicy(pin_memory=pin_memory)})
    assert result["devices"] == ["cpu"]
    assert result["pinned"] == pin_memory
    _assert_same_weights(result["state"], reference)


@pytest.mark.parametrize(("precision", "low", "scaler"), [("bf16-mixed", "torch.bfloat16", None),
                                                          ("16-mixed", "torch.float16", "ShardedGradScaler")])
def test_mixed_precision_on_gpu_stores_fp32_and_computes_low(start: dict, precision: str, low: str,
                                                             scaler: str | None) -> None:
    (result,) = run_distributed(_fit_on_gpu, 1, start, {}, precision)
    assert result["stored"] == ["torch.float32"]
    assert result["computed"] == [low]
    assert result["scaler"] == scaler
    assert all(torch.isfinite(torch.tensor(result["losses"])))
    assert result["losses"][-1] < result["losses"][0]


class _ActivationMemory(LlamaModule):
    """Records the GPU memory allocated just after each forward, before its backward: what it saved for backward."""

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        before = torch.cuda.memory_allocated()
        loss = self.model(input_ids=batch, labels=batch).loss
        self.saved = getattr(self, "saved", []) + [torch.cuda.memory_allocated() - before]
        self.losses.append(float(loss.detach()))
        return loss


def _fit_recording_activations(start_state: dict, strategy_kwargs: dict) -> dict:
    module = _ActivationMemory(start_state=start_state, batch_size=16)
    trainer = L.Trainer(accelerator="cuda", devices=1, strategy=FSDP2Strategy(**strategy_kwargs), **_trainer_kwargs())
    trainer.fit(module)
    return {"state": {k: v.cpu() for k, v in full_state(module).items()}, "saved": module.saved}


def test_offloaded_activations_leave_the_gpu_and_the_numbers_unchanged(start: dict) -> None:
    """With offload_activations=True what a forward leaves on the GPU for backward shrinks (the saved activations are
    in CPU memory), and the weights are those of the run without it."""
    (kept,) = run_distributed(_fit_recording_activations, 1, start, {})
    (offloaded,) = run_distributed(_fit_recording_activations, 1, start, {"offload_activations": True})
    assert max(offloaded["saved"]) < 0.5 * min(kept["saved"])
    _assert_same_weights(offloaded["state"], kept["state"])


def test_compiled_blocks_on_gpu_match_one_gpu(start: dict) -> None:
    """compile=True with inductor's GPU backend (Triton kernels): within 1e-4 of Lightning's single-device run."""
    reference = _reference_on_gpu(start)
    (result,) = run_distributed(_fit_on_gpu, 1, start, {"compile": True})
    _assert_same_weights(result["state"], reference)
