"""Meta construction, materialization, initialization and the check for tensors left without values."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_fsdp2 import FSDP2Strategy
from lightning_fsdp2.init import meta_init_context
from tests.helpers import run_distributed
from tests.models import (
    LlamaModule,
    TokenDataset,
    build_llama,
    full_state,
    probe_logits,
    quiet_trainer_kwargs,
    tiny_llama_config,
)


def test_meta_init_context_sends_parameters_to_meta_and_keeps_buffers_real() -> None:
    with meta_init_context():
        model = build_llama(lora=True)
    assert all(p.is_meta for p in model.parameters())
    eager = build_llama(lora=True)
    buffers = dict(model.named_buffers())
    assert buffers, "a Llama has rotary buffers"
    for name, buffer in eager.named_buffers():
        assert not buffers[name].is_meta
        torch.testing.assert_close(buffers[name], buffer, rtol=0, atol=0)
    # requires_grad survives the move: peft froze the base, the adapters train.
    assert [n for n, p in model.named_parameters() if p.requires_grad] == [
        n for n, p in eager.named_parameters() if p.requires_grad
    ]
    # and the patch is gone afterwards
    assert not nn.Linear(2, 2).weight.is_meta


class _CpuTensorBytes(TorchDispatchMode):
    """Counts the bytes of every CPU tensor an operation creates while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.device.type == "cpu" and func not in _VIEWS:
            self.nbytes += out.untyped_storage().nbytes()
        return out


_VIEWS = {torch.ops.aten.view.default, torch.ops.aten.expand.default, torch.ops.aten.detach.default,
          torch.ops.aten.t.default, torch.ops.aten.transpose.int, torch.ops.aten.unsqueeze.default,
          torch.ops.aten.slice.Tensor, torch.ops.aten.alias.default}


class _BufferFromEmpty(nn.Module):
    """A module of one's own that builds a buffer with `torch.empty` and fills it: the buffer must stay real."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.empty(4).fill_(2.0))
        self.proj = nn.Linear(4, 4)


def test_meta_init_context_allocates_no_cpu_storage_for_torchs_layers() -> None:
    """Parameters of torch's layers are created on meta, not allocated on the CPU and freed at once (glibc kept such
    chunks in its heap: 1.5 GB for a 672M model, touched by later training steps); other tensors stay real."""
    with _CpuTensorBytes() as counted, meta_init_context():
        model = build_llama(lora=True, hidden_size=256, intermediate_size=512, vocab_size=4096)
        own = _BufferFromEmpty()
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    buffer_bytes = sum(b.untyped_storage().nbytes() for b in model.buffers())
    assert all(p.is_meta for p in [*model.parameters(), *own.parameters()])
    assert counted.nbytes < parameter_bytes / 50, (counted.nbytes, parameter_bytes, buffer_bytes)
    assert not own.table.is_meta and torch.equal(own.table, torch.full((4,), 2.0))
    # A torch function mode entered inside the block (here torch.device's) passes the calls on: still nothing.
    with _CpuTensorBytes() as counted, meta_init_context(), torch.device("cpu"):
        nn.Linear(256, 512)
    assert counted.nbytes == 0


class BufferProbe(LlamaModule):
    """Records buffers and parameter statistics after the strategy built and initialized the model."""

    def __init__(self, user_meta: bool, **kwargs) -> None:
        super().__init__(**kwargs)
        self.user_meta = user_meta

    def configure_model(self) -> None:
        if self.model is None:
            if self.user_meta:
                with torch.device("meta"):
                    super().configure_model()
            else:
                super().configure_model()


def _build_and_report(user_meta: bool) -> dict:
    module = BufferProbe(user_meta)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy(), max_steps=1, **quiet_trainer_kwargs())
    trainer.validate(module, dataloaders=module.val_dataloader(), verbose=False)
    state = full_state(module)
    return {
        "buffers": {k: v.cpu().clone() for k, v in module.named_buffers()},
        "state": state,
    }


@pytest.mark.parametrize("user_meta", [False, True], ids=["strategy-meta", "user-meta"])
def test_meta_built_llama_buffers_equal_an_eager_build(user_meta: bool) -> None:
    """RoPE inv_freq (non-persistent, in no checkpoint) comes out exactly as an eager build computes it."""
    results = run_distributed(_build_and_report, 2, user_meta)
    eager = LlamaModule()
    eager.configure_model()
    expected = dict(eager.named_buffers())
    assert any("inv_freq" in k for k in expected)
    for rank in results:
        assert rank["buffers"].keys() == expected.keys()
        for name, value in expected.items():
            torch.testing.assert_close(rank["buffers"][name], value, rtol=0, atol=0)


def test_initialization_follows_hf_and_peft_rules() -> None:
    """Base weights get Hugging Face's init, LoRA B is zero, A is kaiming; shards of one weight are not copies."""
    state = run_distributed(_build_and_report, 2, False)[0]["state"]
    eager = LlamaModule()
    eager.configure_model()
    reference = eager.state_dict()
    assert state.keys() == reference.keys()
    for name, value in state.items():
        assert torch.isfinite(value).all(), name
        if "lora_B" in name:
            assert torch.count_nonzero(value) == 0, name
        elif "norm" in name:
            assert torch.equal(value, torch.ones_like(value)), name
        elif value.dim() == 2:
            # same distribution as the eager build (std 0.02 for HF's normal_, kaiming-uniform for lora_A)
            assert value.std().item() == pytest.approx(reference[name].std().item(), rel=0.25), name
    weight = state["model.base_model.model.model.layers.0.mlp.gate_proj.weight"]
    top, bottom = weight.chunk(2)
    assert not torch.equal(top, bottom), "the two ranks drew the same random numbers for their shards"


class Scaler(nn.Module):
    """A module with a parameter that nothing initializes: no reset_parameters, not a known class."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


class UninitializedModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net: nn.Module | None = None

    def configure_model(self) -> None:
        self.net = nn.Sequential(nn.Linear(8, 8), Scaler(8), nn.Linear(8, 2))

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.net(batch)


def _build_uninitialized() -> str:
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy(), **quiet_trainer_kwargs())
    try:
        trainer.validate(UninitializedModule(), dataloaders=[torch.zeros(1, 8)], verbose=False)
    except Exception as err:  # noqa: BLE001 - the message is what the test checks
        return f"{type(err).__name__}: {err}"
    return "no error"


def test_uninitialized_parameter_is_reported_by_name_on_every_rank() -> None:
    messages = run_distributed(_build_uninitialized, 2)
    for message in messages:
        assert message.startswith("UninitializedError")
        assert "built on the meta device were given no values" in message and "'net.1.gain'" in message
        assert "net.0.weight" not in message and "net.2.bias" not in message
        assert "reset_parameters" in message


def test_from_pretrained_under_meta_init_is_refused_not_silently_dropped(tmp_path) -> None:
    from transformers import LlamaForCausalLM

    from tests.models import tiny_llama_config

    LlamaForCausalLM(tiny_llama_config()).save_pretrained(tmp_path)
    with meta_init_context(), pytest.raises(RuntimeError, match="from_pretrained was called in `configure_model`"):
        LlamaForCausalLM.from_pretrained(tmp_path)
    # outside the context it loads as usual
    assert not any(p.is_meta for p in LlamaForCausalLM.from_pretrained(tmp_path).parameters())


# =========================================================================== peft tuners beyond LoRA
METHODS = ["dora", "ia3", "loha", "lokr", "vera", "adalora", "rslora", "modules_to_save", "embedding"]
# Adapter tensors peft draws at random (so not comparable with an eager build): every other one is compared.
RANDOM = {"lora_A", "lora_embedding_B", "hada_w1_a", "hada_w1_b", "hada_w2_a", "lokr_w2", "lokr_w1_b", "lokr_w2_a"}


def _peft_config(method: str):
    import peft

    targets = ["q_proj", "v_proj"]
    return {
        "dora": lambda: peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, use_dora=True),
        "ia3": lambda: peft.IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]),
        "loha": lambda: peft.LoHaConfig(r=4, target_modules=targets),
        "lokr": lambda: peft.LoKrConfig(r=4, target_modules=targets),
        "vera": lambda: peft.VeraConfig(r=4, target_modules=targets, save_projection=True),
        "adalora": lambda: peft.AdaLoraConfig(r=4, target_modules=targets, total_step=10),
        "rslora": lambda: peft.LoraConfig(r=4, target_modules=targets, use_rslora=True),
        "modules_to_save": lambda: peft.LoraConfig(r=4, target_modules=targets, modules_to_save=["lm_head"]),
        "embedding": lambda: peft.LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"]),
    }[method]()


def _deterministic(method: str, names) -> list[str]:
    random = RANDOM | ({"lora_B"} if method == "adalora" else set())
    return [n for n in names if not random.intersection(n.split("."))]


class PeftProbe(L.LightningModule):
    """A Llama built on meta, its weights from load_pretrained, then a fresh peft adapter of the given method."""

    def __init__(self, pretrained: str, method: str) -> None:
        super().__init__()
        self.pretrained, self.method, self.model = pretrained, method, None
        self.facts: dict = {}

    def configure_model(self) -> None:
        if self.model is None:
            from peft import get_peft_model
            from transformers import LlamaForCausalLM

            from lightning_fsdp2 import load_pretrained

            base = LlamaForCausalLM(tiny_llama_config())
            load_pretrained(base, self.pretrained)
            self.model = get_peft_model(base, _peft_config(self.method))

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        tensors = [*self.model.named_parameters(), *self.model.named_buffers()]
        adapters = {  # trainable adapters, and VeRA's frozen shared projections
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in tensors
            if p.requires_grad or ".vera_" in n
        }
        self.facts = {"logits": probe_logits(self.model), "adapters": adapters}

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TokenDataset(2), batch_size=2)


def _fresh_adapters(pretrained: str, method: str) -> dict:
    module = PeftProbe(pretrained, method)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy(), **quiet_trainer_kwargs())
    trainer.validate(module, verbose=False)
    return module.facts


def _eager_adapters(model) -> dict:
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return {n: p.detach() for n, p in tensors if p.requires_grad or ".vera_" in n}


@pytest.mark.parametrize("method", METHODS)
def test_peft_adapters_start_as_peft_starts_them_on_the_loaded_base(method: str, pretrained) -> None:
    """Every peft tuner's own initialization, on the sharded model after load_pretrained: DoRA's magnitudes are the
    row norms of the *loaded* weights, IA3's vectors ones, LoHa/LoKr/AdaLoRA zero factors, VeRA's projections from its
    PRNG key: equal to peft's eager initialization on `from_pretrained`'s model (random draws aside), and so are the
    logits."""
    from peft import get_peft_model
    from transformers import LlamaForCausalLM

    result = run_distributed(_fresh_adapters, 2, str(pretrained), method)[0]
    torch.manual_seed(0)
    eager = get_peft_model(LlamaForCausalLM.from_pretrained(pretrained), _peft_config(method))
    expected = _eager_adapters(eager)
    assert result["adapters"].keys() == expected.keys()
    deterministic = _deterministic(method, expected)
    assert deterministic, "nothing to compare"
    for name in deterministic:
        assert torch.allclose(result["adapters"][name], expected[name], atol=1e-6), name
    assert torch.allclose(result["logits"], probe_logits(eager), atol=1e-5)


class FromSavedAdapter(PeftProbe):
    """The same, then the adapter peft saved (its own file format) loaded with lora.load_adapter."""

    def __init__(self, pretrained: str, method: str, adapter_dir: str) -> None:
        super().__init__(pretrained, method)
        self.adapter_dir = adapter_dir

    def configure_model(self) -> None:
        if self.model is None:
            from lightning_fsdp2.lora import load_adapter

            super().configure_model()
            load_adapter(self.model, self.adapter_dir)


def _from_saved_adapter(pretrained: str, method: str, adapter_dir: str) -> dict:
    module = FromSavedAdapter(pretrained, method, adapter_dir)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy(), **quiet_trainer_kwargs())
    trainer.validate(module, verbose=False)
    return module.facts


@pytest.mark.parametrize("method", METHODS)
def test_adapters_saved_by_peft_load_with_load_adapter(method: str, pretrained, tmp_path) -> None:
    """peft saves some adapters under other names than the model's (DoRA's magnitudes without `.weight`, IA3's vectors
    without the adapter name, ...); load_adapter follows peft's own naming (get_peft_model_state_dict) and gives the
    eager model's adapters and logits."""
    from peft import get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    eager = get_peft_model(LlamaForCausalLM.from_pretrained(pretrained), _peft_config(method))
    with torch.no_grad():
        for name, param in eager.named_parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * 0.1)  # every adapter tensor moved off its initial value
    eager.save_pretrained(tmp_path / "adapter")
    result = run_distributed(_from_saved_adapter, 2, str(pretrained), method, str(tmp_path / "adapter"))[0]
    for name, value in _eager_adapters(eager).items():
        assert torch.allclose(result["adapters"][name], value, atol=1e-6), name
    assert torch.allclose(result["logits"], probe_logits(eager), atol=1e-5)
