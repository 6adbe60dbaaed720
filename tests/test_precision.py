"""FSDP2Precision: the supported modes, what each stores and computes in, and Lightning's plugin swap."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import Precision
from torch import nn

from lightning_fsdp2 import FSDP2Precision, FSDP2Strategy
from lightning_fsdp2._version_check import check_torch_version
from lightning_fsdp2.precision import clip_grad_norm_


@pytest.mark.parametrize(
    ("precision", "stored", "param_dtype", "reduce_dtype"),
    [
        ("32-true", torch.float32, None, None),
        ("bf16-true", torch.bfloat16, None, None),
        ("16-true", torch.float16, None, None),
        ("bf16-mixed", torch.float32, torch.bfloat16, torch.float32),
        ("16-mixed", torch.float32, torch.float16, torch.float32),
    ],
)
def test_modes(precision: str, stored: torch.dtype, param_dtype, reduce_dtype) -> None:
    plugin = FSDP2Precision(precision)  # type: ignore[arg-type]
    assert plugin.storage_dtype == stored
    policy = plugin.mixed_precision_policy
    assert (policy.param_dtype, policy.reduce_dtype) == (param_dtype, reduce_dtype)
    with torch.device("meta"):
        module = plugin.convert_module(nn.Linear(2, 2))
    assert module.weight.dtype == stored
    with plugin.module_init_context():
        assert nn.Linear(2, 2).weight.dtype == stored
    assert (plugin.scaler is not None) == (precision == "16-mixed")


def test_unsupported_precision_names_the_choices() -> None:
    with pytest.raises(ValueError, match="does not support precision='64-true'.*32-true, bf16-true, 16-true, bf16-mixed, 16-mixed"):
        FSDP2Precision("64-true")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="64-true"):
        L.Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy(), precision="64-true", logger=False)


@pytest.mark.parametrize("precision", ["32-true", "bf16-true", "16-true", "bf16-mixed"])
def test_trainer_precision_flag_becomes_fsdp2_precision(precision: str) -> None:
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="fsdp2", precision=precision, logger=False)
    assert isinstance(trainer.strategy, FSDP2Strategy)
    assert isinstance(trainer.precision_plugin, FSDP2Precision)
    assert trainer.precision_plugin.precision == precision


def test_explicit_plugin_is_kept_and_foreign_plugins_are_refused() -> None:
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="fsdp2", plugins=FSDP2Precision("16-mixed"), logger=False)
    assert trainer.precision_plugin.precision == "16-mixed"

    class CustomPrecision(Precision):
        pass

    with pytest.raises(TypeError, match="FSDP2Strategy works with FSDP2Precision, not CustomPrecision"):
        L.Trainer(accelerator="cpu", devices=2, strategy="fsdp2", plugins=CustomPrecision(), logger=False)


def test_clip_grad_norm_matches_torch_on_plain_tensors() -> None:
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.load_state_dict(a.state_dict())
    a(torch.randn(3, 4)).sum().backward()
    for pa, pb in zip(a.parameters(), b.parameters()):
        pb.grad = pa.grad.clone()
    ours = clip_grad_norm_(a.parameters(), 0.1)
    theirs = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.1)
    torch.testing.assert_close(ours, theirs)
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad)


def test_torch_older_than_2_6_is_refused_with_the_fix() -> None:
    with pytest.raises(ImportError, match=r"needs torch>=2.6, found torch 2.5.1.*pip install 'torch>=2.6'"):
        check_torch_version("2.5.1+cu121")
    check_torch_version("2.6.0")
    check_torch_version("2.13.0+cpu")
    check_torch_version("3.0.0a0")


# --------------------------------------------------------------------------- fp32 adapters on a bf16 base
def _layout_start() -> dict:
    """A LoRA Llama's start weights (lora_B non-zero, so the adapters have gradients at once)."""
    from tests.models import LlamaModule

    torch.manual_seed(1234)
    module = LlamaModule()
    module.configure_model()
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return {k: torch.randn_like(v) * 0.02 if "lora_B" in k else v for k, v in state.items()}


def _fit_layout(start: dict, adapter_dtype: torch.dtype | None) -> dict:
    from tests.models import LlamaModule, full_state, quiet_trainer_kwargs, world

    class Probe(LlamaModule):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1, momentum=0.9)

    module = Probe(start_state=start)
    trainer = L.Trainer(accelerator="cpu", devices=world(), strategy=FSDP2Strategy(), max_steps=3,
                        plugins=[FSDP2Precision("bf16-true", adapter_dtype=adapter_dtype)], limit_val_batches=0,
                        num_sanity_val_steps=0, **quiet_trainer_kwargs())
    trainer.fit(module)
    optimizer = trainer.optimizers[0]
    dtypes = lambda trainable: sorted({str(p.dtype) for p in module.parameters() if p.requires_grad == trainable})  # noqa: E731
    return {
        "base": dtypes(False), "adapters": dtypes(True),
        "momentum": sorted({str(s["momentum_buffer"].dtype) for s in optimizer.state.values()}),
        "module_dtype": [str(d) for d in module.seen_dtypes],
        "state": full_state(module), "losses": module.losses,
    }


def _reference_layout(start: dict) -> dict:
    """One process, no lightning_fsdp2: the LoRA Llama stored as peft stores it on a bf16 base (the model cast to
    bf16, the adapters back to fp32), trained by plain torch on the global batch."""
    from tests.models import LlamaModule, train_plainly

    module = LlamaModule()
    module.configure_model()
    model = module.model.to(torch.bfloat16)
    for name, param in model.named_parameters():
        if "lora_" in name:
            param.data = param.data.float()
    model.load_state_dict({k.removeprefix("model."): v for k, v in start.items()})
    losses = train_plainly(model, 3)
    return {"state": {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}, "losses": losses}


def test_bf16_true_keeps_peft_adapters_in_fp32_on_a_bf16_base() -> None:
    """Under bf16-true the base is stored in bf16 and the LoRA adapters in fp32 (peft's autocast_adapter_dtype
    convention), their optimizer state too, and `self.dtype` is the base's bf16. At world size 2 the adapters after 3
    SGD steps match one process with the same layout within 2e-5 (measured: 7e-9 on one CPU, where the base's bf16
    matmuls give each row the same result whatever the batch split; 3.4e-6 on an AMD EPYC, whose bf16 kernels round
    a half batch otherwise). Adapters stored and updated in bf16 instead (`adapter_dtype=None`) end 8e-4 away, their
    rounding: far outside that bound."""
    from tests.helpers import run_distributed

    start = _layout_start()
    want = _reference_layout(start)
    runs = [run_distributed(_fit_layout, 2, start, dtype) for dtype in (torch.float32, None)]
    fp32, bf16 = runs[0][0], runs[1][0]
    assert fp32["base"] == ["torch.bfloat16"] and fp32["adapters"] == ["torch.float32"]
    assert fp32["momentum"] == ["torch.float32"] and set(fp32["module_dtype"]) == {"torch.bfloat16"}
    assert bf16["adapters"] == ["torch.bfloat16"] and bf16["momentum"] == ["torch.bfloat16"]
    lora = [k for k in want["state"] if "lora_" in k]
    worst = max((fp32["state"][k].float() - want["state"][k].float()).abs().max().item() for k in lora)
    assert worst <= 2e-5, f"max abs diff of the adapters {worst}"
    # Each rank's loss is over its half of the global batch: their mean is the reference's loss.
    mean = [sum(r["losses"][i] for r in runs[0]) / 2 for i in range(3)]
    assert mean == pytest.approx(want["losses"], abs=1e-5)
    off = max((bf16["state"][k].float() - want["state"][k].float()).abs().max().item() for k in lora)
    assert off > 1e-4, "adapters stored in bf16 end elsewhere"


# --------------------------------------------------------------------------- autocast under *-mixed, as Lightning's
@pytest.mark.parametrize(
    ("precision", "policy", "autocast"),
    [("32-true", None, None), ("bf16-true", None, None), ("bf16-mixed", None, torch.bfloat16),
     ("16-mixed", None, torch.float16), ("bf16-mixed", torch.float16, torch.float16),
     ("32-true", torch.bfloat16, None)],
    ids=["32-true", "bf16-true", "bf16-mixed", "16-mixed", "bf16-mixed-fp16-policy", "32-true-bf16-policy"],
)
def test_forward_context_autocasts_mixed_precision_in_the_gathered_dtype(precision: str, policy, autocast) -> None:
    """`*-mixed` autocasts in the dtype FSDP2 gathers the parameters in: the precision's, or that of a user's
    `FSDP2Strategy(mixed_precision=...)` (told by `compute_as` when the model is sharded); `*-true` does not, with
    a user's policy neither."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    plugin = FSDP2Precision(precision)  # type: ignore[arg-type]
    if policy is not None:
        plugin.compute_as(MixedPrecisionPolicy(param_dtype=policy), torch.device("cpu"))
    with plugin.forward_context():
        assert torch.is_autocast_enabled("cpu") == (autocast is not None)
        if autocast is not None:
            assert torch.get_autocast_dtype("cpu") == autocast


class _Classifier(L.LightningModule):
    """A tiny classifier whose loss is computed in the step (outside the sharded modules), as Lightning code does;
    records whether each step ran under autocast, and in what."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
        self.losses: list[float] = []
        self.seen: list[list[str]] = []

    def _record(self, step: str) -> None:
        self.seen.append([step, str(torch.is_autocast_enabled("cpu")), str(torch.get_autocast_dtype("cpu"))])

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self._record("train")
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._record("val")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        g = torch.Generator().manual_seed(100 + self.global_rank)  # each rank its own deterministic half
        data = torch.utils.data.TensorDataset(torch.randn(64, 16, generator=g), torch.randint(0, 8, (64,), generator=g))
        return torch.utils.data.DataLoader(data, batch_size=16)

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return self.train_dataloader()


def _fit_classifier(strategy: str, precision: str) -> dict:
    from tests.models import quiet_trainer_kwargs

    module = _Classifier()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy() if strategy == "fsdp2" else strategy,
                        precision=precision, max_steps=4, val_check_interval=2, limit_val_batches=1,
                        num_sanity_val_steps=0, **quiet_trainer_kwargs())
    trainer.fit(module)
    return {"losses": module.losses, "seen": module.seen}


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_steps_run_under_autocast_with_mixed_precision_only(precision: str) -> None:
    """Under bf16-mixed, training_step and validation_step run under `torch.autocast("cpu", torch.bfloat16)`, as with
    Lightning's MixedPrecision (its own tests assert this); under bf16-true without autocast."""
    from tests.helpers import run_distributed

    for rank in run_distributed(_fit_classifier, 2, "fsdp2", precision):
        assert {step for step, _, _ in rank["seen"]} == {"train", "val"}
        for step, enabled, dtype in rank["seen"]:
            assert enabled == str(precision == "bf16-mixed"), (step, enabled)
            assert precision == "bf16-true" or dtype == "torch.bfloat16"


def test_bf16_mixed_losses_match_lightnings_ddp() -> None:
    """4 SGD steps of bf16-mixed at world size 2: each rank's losses are those of Lightning's own `strategy="ddp"`
    with bf16-mixed within 1e-3 (relative; a quarter of one bf16 rounding, 2^-8). Both compute the same bf16 matmuls
    on the same batches and the loss in fp32 (autocast upcasts cross_entropy); measured: equal. Without autocast the
    loss was computed in bf16 and ended up to 0.9% away (0.019 on 2.1)."""
    from tests.helpers import run_distributed

    ddp = run_distributed(_fit_classifier, 2, "ddp", "bf16-mixed")
    ours = run_distributed(_fit_classifier, 2, "fsdp2", "bf16-mixed")
    for got, want in zip(ours, ddp):
        assert len(got["losses"]) == 4
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-3)


def _fabric_forwards(precision: str) -> dict:
    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(8, 4)
            self.seen: list[str] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen += [str(torch.is_autocast_enabled("cpu")), str(torch.get_autocast_dtype("cpu"))]
            return self.net(x).softmax(-1)

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="fsdp2", precision=precision)
    fabric.launch()
    module = Probe()
    model = fabric.setup(module)
    out = model(torch.randn(4, 8))
    return {"seen": module.seen, "output": str(out.dtype)}


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_fabric_forwards_run_under_autocast_with_mixed_precision_only(precision: str) -> None:
    """Fabric's forwards under bf16-mixed run under `torch.autocast("cpu", torch.bfloat16)` (with the strategy's peer
    watch, which marks them too) and return fp32, as Fabric's MixedPrecision does; under bf16-true without autocast."""
    from tests.helpers import run_distributed

    for rank in run_distributed(_fabric_forwards, 2, precision):
        enabled, dtype = rank["seen"]
        assert enabled == str(precision == "bf16-mixed")
        assert precision == "bf16-true" or dtype == "torch.bfloat16"
        assert rank["output"] == "torch.float32"
