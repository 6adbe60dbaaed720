"""Code written for one device on a sharded model: ``module.load_state_dict`` of whole tensors, the model's own load
hooks, ``optimizer.load_state_dict`` of a one-device state (``checkpoint/module_load.py``).

The model is written like LitGPT's LoRA model (``litgpt/lora.py``): each LoRA layer holds its base ``nn.Linear`` as
``self.linear`` and maps a base checkpoint's ``weight`` to ``linear.weight`` in its ``_load_from_state_dict``. The
sharded runs go through exactly LitGPT's recipe calls (``init_module(empty_init=True)``, ``setup_module``,
``setup_optimizers``, ``load_state_dict``/``load_raw`` of the base with ``strict=False``, training, the LoRA tensors
saved from ``state_dict()`` with ``full_tensor()``), against the same model trained in this process without our code.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from tests.helpers import run_distributed
from tests.models import world

VOCAB, WIDTH, STEPS = 64, 32, 4


class LoRALinear(nn.Module):
    """LitGPT's shape of a LoRA layer: the base layer as a child, the adapters beside it."""

    def __init__(self, fan_in: int, fan_out: int, r: int = 4) -> None:
        super().__init__()
        self.linear = nn.Linear(fan_in, fan_out, bias=True)
        self.lora_A = nn.Parameter(torch.empty(r, fan_in))
        self.lora_B = nn.Parameter(torch.empty(fan_out, r))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + (x @ self.lora_A.T @ self.lora_B.T) * 2.0

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any, **kwargs: Any) -> None:
        # As LitGPT: a base checkpoint names the weight `qkv.weight`; this model has it at `qkv.linear.weight`.
        for name in ("weight", "bias"):
            if prefix + name in state_dict:
                state_dict[prefix + "linear." + name] = state_dict.pop(prefix + name)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class Block(nn.Module):
    def __init__(self, lora: bool) -> None:
        super().__init__()
        make = LoRALinear if lora else (lambda i, o: nn.Linear(i, o, bias=True))
        self.norm = nn.LayerNorm(WIDTH)
        self.attn = make(WIDTH, WIDTH)
        self.mlp = make(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(torch.tanh(self.attn(self.norm(x))))


class GPT(nn.Module):
    def __init__(self, lora: bool = True) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.h = nn.ModuleList(Block(lora) for _ in range(2))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = LoRALinear(WIDTH, VOCAB) if lora else nn.Linear(WIDTH, VOCAB, bias=True)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def mark_only_lora_as_trainable(model: nn.Module) -> None:
    for name, p in model.named_parameters():
        p.requires_grad = "lora_" in name


def _data() -> torch.Tensor:
    return torch.randint(0, VOCAB, (8, 12), generator=torch.Generator().manual_seed(3))


def _step_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


def _start(tmp: Path) -> dict[str, str]:
    """A base checkpoint under the plain model's names (LitGPT's `lit_model.pth`), and LoRA starting values with
    B not zero (so every adapter gets a gradient at once)."""
    torch.manual_seed(0)
    torch.save(GPT(lora=False).state_dict(), tmp / "base.pth")
    torch.manual_seed(1)
    lora = {n: torch.randn_like(p) * 0.1 for n, p in GPT().named_parameters() if "lora_" in n}
    torch.save(lora, tmp / "lora_start.pth")
    return {"base": str(tmp / "base.pth"), "lora": str(tmp / "lora_start.pth")}


def _reference(paths: dict[str, str]) -> dict[str, Any]:
    """One process, no Fabric, no lightning_fsdp2: the recipe's arithmetic."""
    model = GPT()
    model.load_state_dict(torch.load(paths["base"]), strict=False)
    model.load_state_dict(torch.load(paths["lora"]), strict=False)
    mark_only_lora_as_trainable(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    data, losses = _data(), []
    for _ in range(STEPS):
        loss = _step_loss(model, data)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "lora": {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}}


def _recipe(paths: dict[str, str], how: str, out: str) -> dict[str, Any]:
    """LitGPT's finetune/lora.py calls, with our Fabric strategy."""
    from torch.distributed.tensor import DTensor

    from lightning_fsdp2.fabric import FSDP2Strategy

    fabric = L.Fabric(accelerator="cpu", devices=world(), strategy=FSDP2Strategy(auto_wrap_policy={Block}))
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = GPT()
    mark_only_lora_as_trainable(model)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                                           lr=1e-2))
    if how == "load_state_dict":
        # Code of one's own: the whole base, mmap-ed, into the set-up module.
        result = model.load_state_dict(torch.load(paths["base"], mmap=True, weights_only=True), strict=False)
    elif how == "lazy_load":
        # What LitGPT's `load_checkpoint` does for a strategy it does not know: Lightning's own lazy loader, whose
        # values are `_NotYetLoadedTensor`s (not tensors), into the set-up module.
        from lightning.fabric.utilities.load import _lazy_load

        result = model.load_state_dict(_lazy_load(paths["base"]), strict=False)
    else:  # what LitGPT does under FSDP1
        result = fabric.load_raw(paths["base"], model, strict=False)
    missing = sorted(result.missing_keys) if result is not None else None
    model.load_state_dict(torch.load(paths["lora"]), strict=False)
    rank, size = fabric.global_rank, fabric.world_size
    data, losses = _data(), []
    for _ in range(STEPS):
        loss = _step_loss(model, data[rank::size])
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")))
    # LitGPT's save_lora_checkpoint: the LoRA tensors of state_dict(), gathered with full_tensor().
    lora = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items() if "lora_" in k}
    return {"losses": losses, "lora": lora, "missing": missing,
            "sharded": all(isinstance(p, DTensor) for p in model.parameters())}


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return _start(tmp_path_factory.mktemp("litgpt_style"))


@pytest.mark.parametrize("how", ["load_state_dict", "lazy_load", "load_raw"])
def test_a_litgpt_style_lora_recipe_matches_one_process(paths: dict[str, str], how: str, tmp_path: Path) -> None:
    """The base goes in through the model's own key mapping (`weight` -> `linear.weight`) either way; training at
    world size 2 ends where one process does (<= 1e-4), and the LoRA tensors saved are the same."""
    want = _reference(paths)
    for got in run_distributed(_recipe, 2, paths, how, str(tmp_path)):
        assert got["sharded"]
        if got["missing"] is not None:  # torch's own report: only the adapters were not in the base
            assert got["missing"] and all("lora_" in k for k in got["missing"]), got["missing"]
        assert got["losses"] == pytest.approx(want["losses"], abs=1e-4)
        assert got["lora"].keys() == want["lora"].keys()
        worst = max((got["lora"][k] - want["lora"][k]).abs().max().item() for k in want["lora"])
        assert worst <= 1e-4, worst


# --------------------------------------------------------------------------- load_state_dict's own contract
def _load_cases(base: str) -> dict[str, Any]:
    from lightning_fsdp2.fabric import FSDP2Strategy

    fabric = L.Fabric(accelerator="cpu", devices=world(), strategy=FSDP2Strategy(auto_wrap_policy={Block}))
    fabric.launch()
    with fabric.init_module():
        model = GPT(lora=False)
    model = fabric.setup_module(model)
    whole = torch.load(base)
    out: dict[str, Any] = {}
    # strict=True with an extra and a missing key: torch's own message, clean names.
    broken = dict(whole)
    broken["extra.weight"] = torch.zeros(1)
    del broken["ln_f.bias"]
    try:
        model.load_state_dict(broken)
    except RuntimeError as err:
        out["strict"] = str(err)
    result = model.load_state_dict(broken, strict=False)
    out["missing"], out["unexpected"] = list(result.missing_keys), list(result.unexpected_keys)
    # a shape that does not fit: torch's size-mismatch message
    wrong = dict(whole)
    wrong["lm_head.weight"] = torch.zeros(VOCAB + 1, WIDTH)
    try:
        model.load_state_dict(wrong)
    except RuntimeError as err:
        out["shape"] = str(err)
    # assign=True, then a load of the model's own sharded state_dict (DTensors), then after an evaluation
    model.load_state_dict({k: v * 2 for k, v in whole.items()}, assign=True)
    from tests.models import full_state

    out["assigned"] = full_state(model)
    with torch.no_grad():
        model(_data()[:2])  # an evaluation leaves the root's parameters unsharded
    model.load_state_dict(whole)
    out["after_eval"] = full_state(model)
    model.load_state_dict(model.state_dict())
    out["own"] = full_state(model)
    from lightning_fsdp2.checkpoint import full_state_dict

    out["full"] = full_state_dict(model)  # what `torch.save(model.state_dict())` wants, on rank 0
    return out


def test_load_state_dict_reports_like_torch_and_takes_assign_and_dtensors(paths: dict[str, str]) -> None:
    whole = torch.load(paths["base"])
    ranks = run_distributed(_load_cases, 2, paths["base"])
    assert ranks[1]["full"] == {}
    assert ranks[0]["full"].keys() == whole.keys()
    assert all(torch.equal(ranks[0]["full"][k], v) and type(ranks[0]["full"][k]) is torch.Tensor
               for k, v in whole.items())
    for got in ranks:
        assert "Missing key(s) in state_dict: \"ln_f.bias\"" in got["strict"], got["strict"]
        assert "Unexpected key(s) in state_dict: \"extra.weight\"" in got["strict"], got["strict"]
        assert got["missing"] == ["ln_f.bias"] and got["unexpected"] == ["extra.weight"]
        assert "size mismatch for lm_head.weight" in got["shape"], got["shape"]
        for key, value in whole.items():
            assert torch.equal(got["assigned"][key], value * 2), key
            assert torch.equal(got["after_eval"][key], value), key
            assert torch.equal(got["own"][key], value), key


# --------------------------------------------------------------------------- optimizer.load_state_dict
def _optimizer_resume(paths: dict[str, str], saved: str, steps: int) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    from lightning_fsdp2.fabric import FSDP2Strategy

    fabric = L.Fabric(accelerator="cpu", devices=world(), strategy=FSDP2Strategy(auto_wrap_policy={Block}))
    fabric.launch()
    with fabric.init_module():
        model = GPT()
    mark_only_lora_as_trainable(model)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                                           lr=1e-2))
    model.load_state_dict(torch.load(Path(saved, "model.pth")))
    optimizer.load_state_dict(torch.load(Path(saved, "optimizer.pth")))
    data, losses = _data(), []
    for _ in range(steps):
        loss = _step_loss(model, data[fabric.global_rank :: fabric.world_size])
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")))
    moments = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.ndim]
    return {"losses": losses, "sharded_moments": all(isinstance(v, DTensor) for v in moments) and bool(moments)}


def test_optimizer_load_state_dict_of_a_one_device_state_resumes_exactly(paths: dict[str, str], tmp_path: Path) -> None:
    """One process trains 2 steps and saves `model.state_dict()` and `optimizer.state_dict()` with torch.save; the
    sharded run loads both with the plain calls and trains 2 more: the losses are the one process's steps 3-4
    (AdamW's moments lost would change them by about lr)."""
    want = _reference(paths)["losses"]
    model = GPT()
    model.load_state_dict(torch.load(paths["base"]), strict=False)
    model.load_state_dict(torch.load(paths["lora"]), strict=False)
    mark_only_lora_as_trainable(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        _step_loss(model, _data()).backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.save(model.state_dict(), tmp_path / "model.pth")
    torch.save(optimizer.state_dict(), tmp_path / "optimizer.pth")
    for got in run_distributed(_optimizer_resume, 2, paths, str(tmp_path), 2):
        assert got["sharded_moments"]
        assert got["losses"] == pytest.approx(want[2:], abs=1e-4)


# --------------------------------------------------------------------------- the Trainer's LightningModule, FSDP and HSDP
def _fit_with_plain_load(start_state: dict, mesh: tuple[int, int] | None) -> dict:
    """A LightningModule whose `on_fit_start` is one-device code: `self.load_state_dict(state)` of whole tensors."""
    import os

    from lightning_fsdp2 import FSDP2Strategy
    from tests.models import LlamaModule, full_state
    from tests.test_strategy import _trainer_kwargs

    class PlainLoad(LlamaModule):
        def on_fit_start(self) -> None:
            self.load_state_dict(self.start_state)  # peft names under `model.`, whole CPU tensors

    world_size = int(os.environ["WORLD_SIZE"])
    module = PlainLoad(start_state=start_state, batch_size=8 // world_size)
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=FSDP2Strategy(device_mesh=mesh),
                        **_trainer_kwargs())
    trainer.fit(module)
    return {"state": full_state(module)}


@pytest.mark.parametrize(("world_size", "mesh"), [(2, None), pytest.param(4, (2, 2), marks=pytest.mark.slow)],
                         ids=["fsdp-2", "hsdp-2x2"])
def test_a_lightning_modules_load_state_dict_of_whole_tensors_matches_one_process(world_size: int, mesh: Any) -> None:
    """peft LoRA on a Hugging Face Llama: the start loaded by `self.load_state_dict` in `on_fit_start`, 3 AdamW
    steps, the weights of one process that loaded the same start (<= 1e-4)."""
    from tests.test_strategy import _assert_same_weights, _fit_reference, _start_state

    start = _start_state()
    reference = _fit_reference(start, {"batch_size": 8 // world_size}, {}, world=world_size)
    for rank in run_distributed(_fit_with_plain_load, world_size, start, mesh):
        _assert_same_weights(rank["state"], reference["state"])


class Transposing(nn.Module):
    """A layer whose load hook computes a new tensor (old checkpoints stored the weight transposed)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any, **kwargs: Any) -> None:
        if prefix + "old_weight" in state_dict:
            state_dict[prefix + "proj.weight"] = state_dict.pop(prefix + "old_weight").T
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def _load_raw_through_a_computing_hook(path: str) -> str:
    from lightning_fsdp2.fabric import FSDP2Strategy

    fabric = L.Fabric(accelerator="cpu", devices=world(), strategy=FSDP2Strategy())
    fabric.launch()
    with fabric.init_module():
        model = Transposing()
    model = fabric.setup_module(model)
    try:
        fabric.load_raw(path, model)
    except RuntimeError as err:
        return str(err)
    return "loaded"


def test_load_raw_through_a_hook_that_computes_tensors_says_to_load_whole(tmp_path: Path) -> None:
    torch.save({"old_weight": torch.zeros(WIDTH, WIDTH), "proj.bias": torch.zeros(WIDTH)}, tmp_path / "old.pth")
    for message in run_distributed(_load_raw_through_a_computing_hook, 2, str(tmp_path / "old.pth")):
        assert "load hook made a new tensor for 'proj.weight'" in message, message


def test_load_pretrained_through_the_models_own_mapping_works_in_one_process(paths: dict[str, str]) -> None:
    """The same LightningModule runs under every strategy: a real, unsharded LitGPT-style model loads the base
    through its own mapping too (the hooks are registered for that call alone), and a source that fits nothing
    raises instead of loading nothing."""
    from lightning_fsdp2 import CheckpointFileError, load_pretrained

    model = GPT()
    lora_before = {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k}
    load_pretrained(model, paths["base"], strict=False)
    base = torch.load(paths["base"])
    assert torch.equal(model.h[0].attn.linear.weight, base["h.0.attn.weight"])
    assert all(torch.equal(model.state_dict()[k], v) for k, v in lora_before.items())
    assert not any(p.is_meta for p in model.parameters())
    with pytest.raises(CheckpointFileError, match="Nothing in .* fits GPT"):
        load_pretrained(GPT(), {"unrelated.weight": torch.zeros(2)}, strict=False)
