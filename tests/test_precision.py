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
