"""FSDP2Strategy end to end on CPU/gloo: sharding, precision, parity with a single-process Trainer."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from lightning.pytorch.demos import Transformer
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_fsdp2 import FSDP2Strategy
from tests.helpers import run_distributed
from tests.models import VOCAB, LlamaModule, TokenDataset, build_llama, full_state, quiet_trainer_kwargs


# --------------------------------------------------------------------------- the Lightning convert_module case
class DemoTransformerModule(L.LightningModule):
    """Lightning's demo Transformer, built in configure_model (optionally under the user's own meta context)."""

    def __init__(self, user_meta: bool) -> None:
        super().__init__()
        self.user_meta = user_meta
        self.model: Transformer | None = None
        self.step_dtypes: list[str] = []
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.model is not None:
            return
        if self.user_meta:
            with torch.device("meta"):
                self.model = Transformer(vocab_size=VOCAB, ninp=64, nhead=2, nhid=64, nlayers=2, dropout=0.0)
        else:
            self.model = Transformer(vocab_size=VOCAB, ninp=64, nhead=2, nhid=64, nlayers=2, dropout=0.0)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.step_dtypes.append(str(self.dtype))
        inputs, target = batch[:, :-1], batch[:, 1:]
        loss = torch.nn.functional.nll_loss(self.model(inputs, target), target.reshape(-1))
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TokenDataset(16), batch_size=4)


def _fit_demo_transformer(user_meta: bool) -> dict:
    module = DemoTransformerModule(user_meta)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="fsdp2", precision="bf16-true", max_steps=2, **quiet_trainer_kwargs()
    )
    trainer.fit(module)
    params = list(module.parameters())
    return {
        "step_dtypes": module.step_dtypes,
        "module_dtype": str(module.dtype),
        "param_dtypes": sorted({str(p.dtype) for p in params}),
        "all_dtensor": all(isinstance(p, DTensor) for p in params),
        "local_numel": sum(p.to_local().numel() for p in params),
        "global_numel": sum(p.numel() for p in params),
        "losses": module.losses,
    }


@pytest.mark.parametrize("user_meta", [False, True], ids=["strategy-meta", "user-meta"])
def test_bf16_true_demo_transformer_is_converted_and_sharded(user_meta: bool) -> None:
    """Lightning's convert_module case: self.dtype is bf16 in training_step on every rank, params are bf16 shards."""
    results = run_distributed(_fit_demo_transformer, 2, user_meta)
    for rank in results:
        assert rank["step_dtypes"] == ["torch.bfloat16"] * 2
        assert rank["module_dtype"] == "torch.bfloat16"
        assert rank["param_dtypes"] == ["torch.bfloat16"]
        assert rank["all_dtensor"]
        # Each rank holds about half the elements (uneven dims pad by at most one row per parameter).
        assert abs(rank["local_numel"] - rank["global_numel"] / 2) < 0.02 * rank["global_numel"]
        assert all(torch.isfinite(torch.tensor(rank["losses"])))
    assert sum(r["local_numel"] for r in results) == results[0]["global_numel"]


# --------------------------------------------------------------------------- parity with a single process
def _trainer_kwargs(**extra) -> dict:
    kwargs = dict(max_steps=3, limit_val_batches=0, num_sanity_val_steps=0, **quiet_trainer_kwargs())
    kwargs.update(extra)
    return kwargs


def _fit_sharded(start_state: dict, module_kwargs: dict, trainer_kwargs: dict, strategy_kwargs: dict) -> dict:
    world = int(__import__("os").environ["WORLD_SIZE"])
    module = LlamaModule(start_state=start_state, **module_kwargs)
    strategy = FSDP2Strategy(**strategy_kwargs)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, **_trainer_kwargs(**trainer_kwargs))
    trainer.fit(module)
    return {"state": full_state(module), "losses": module.losses}


def _fit_reference(start_state: dict, module_kwargs: dict, trainer_kwargs: dict, world: int) -> dict:
    kwargs = dict(module_kwargs)
    kwargs["batch_size"] = kwargs.get("batch_size", 4) * world  # one process sees the global batch
    module = LlamaModule(start_state=start_state, **kwargs)
    module.configure_model()
    trainer = L.Trainer(accelerator="cpu", devices=1, **_trainer_kwargs(**trainer_kwargs))
    trainer.fit(module)
    return {"state": {k: v.detach().clone() for k, v in module.state_dict().items()}, "losses": module.losses}


def _start_state(**module_kwargs) -> dict:
    torch.manual_seed(1234)
    model = LlamaModule(**module_kwargs)
    model.configure_model()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    # peft starts lora_B at zero; make it non-zero so the LoRA path really contributes to the gradients.
    for k in state:
        if "lora_B" in k:
            state[k] = torch.randn_like(state[k]) * 0.02
    return state


def _assert_same_weights(sharded: dict, reference: dict) -> None:
    assert sharded.keys() == reference.keys()
    worst = max((sharded[k].float() - reference[k].float()).abs().max().item() for k in reference)
    assert worst <= 1e-4, f"max abs diff {worst}"


PARITY_CASES = {
    "plain": ({}, {}, {}),
    "accumulate": ({}, {"accumulate_grad_batches": 2}, {}),
    "clip-norm": ({"lr": 5e-2}, {"gradient_clip_val": 0.05, "gradient_clip_algorithm": "norm"}, {}),
    "two-forwards": ({"forwards_per_step": 2}, {}, {}),
    "activation-checkpointing": ({}, {}, {"activation_checkpointing_policy": "blocks"}),
    "no-reshard": ({}, {}, {"reshard_after_forward": False}),
    "no-meta-init": ({}, {}, {"meta_init": False}),
}


@pytest.mark.parametrize("case", list(PARITY_CASES))
def test_parity_with_single_process_at_world_size_2(case: str) -> None:
    """Same start, same global batches: FSDP2 at world size 2 ends with the single-process weights (<= 1e-4)."""
    module_kwargs, trainer_kwargs, strategy_kwargs = copy.deepcopy(PARITY_CASES[case])
    if strategy_kwargs.get("activation_checkpointing_policy") == "blocks":
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        strategy_kwargs["activation_checkpointing_policy"] = {LlamaDecoderLayer}
    start = _start_state()
    reference = _fit_reference(start, module_kwargs, trainer_kwargs, world=2)
    results = run_distributed(_fit_sharded, 2, start, module_kwargs, trainer_kwargs, strategy_kwargs)
    for rank in results:
        _assert_same_weights(rank["state"], reference["state"])
    # the weights really moved
    moved = max((reference["state"][k] - start[k]).abs().max().item() for k in start)
    assert moved > 1e-3


@pytest.mark.parametrize("world", [1, 4])
def test_parity_at_world_size_1_and_4(world: int) -> None:
    """The same holds with one process (a degenerate mesh) and with four."""
    module_kwargs = {"batch_size": 2}
    start = _start_state()
    reference = _fit_reference(start, module_kwargs, {}, world=world)
    results = run_distributed(_fit_sharded, world, start, module_kwargs, {}, {})
    _assert_same_weights(results[0]["state"], reference["state"])


def test_training_all_parameters_with_tied_embeddings() -> None:
    """Without LoRA and with tie_word_embeddings=True every parameter trains, ties survive, parity holds."""
    module_kwargs = {"lora": False, "tie_word_embeddings": True}
    start = _start_state(**module_kwargs)
    reference = _fit_reference(start, module_kwargs, {}, world=2)
    results = run_distributed(_fit_sharded, 2, start, module_kwargs, {}, {})
    _assert_same_weights(results[0]["state"], reference["state"])


# --------------------------------------------------------------------------- gradient sync is really skipped
def _count_reduce_scatters(accumulate: int) -> dict:
    import torch.distributed as dist

    name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    original = getattr(dist, name)
    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    setattr(dist, name, counting)
    module = LlamaModule()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=FSDP2Strategy(), accumulate_grad_batches=accumulate, **_trainer_kwargs()
    )
    trainer.fit(module)
    return {"calls": len(calls), "micro_batches": len(module.losses)}


def test_accumulation_skips_reduce_scatter_on_non_final_micro_batches() -> None:
    once = run_distributed(_count_reduce_scatters, 2, 1)[0]
    twice = run_distributed(_count_reduce_scatters, 2, 2)[0]
    assert twice["micro_batches"] == 2 * once["micro_batches"]
    # Same number of optimizer steps, so the same number of reduce-scatters despite twice the backward passes.
    assert twice["calls"] == once["calls"] > 0


# --------------------------------------------------------------------------- mixed precision
def _fit_bf16_mixed(user_policy: str | None) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    seen: dict = {}

    class Probe(LlamaModule):
        def training_step(self, batch, batch_idx):
            out = self.model(input_ids=batch, labels=batch)
            seen["logits"] = str(out.logits.dtype)
            return out.loss

    module = Probe()
    policy = {
        None: None,
        "fp16-params": MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32),
        # strategy-options.md's example: fp32 outputs of the model (its roots), bf16 between the blocks
        "fp32-output": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                            output_dtype=torch.float32),
    }[user_policy]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=FSDP2Strategy(mixed_precision=policy),
        precision="bf16-mixed",
        **_trainer_kwargs(max_steps=2),
    )
    trainer.fit(module)
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    return {
        "logits": seen["logits"],
        "params": sorted({str(p.dtype) for p in module.parameters()}),
        "grads": sorted({str(g.dtype) for g in grads}),
        "finite": all(bool(torch.isfinite(g.to_local()).all()) for g in grads),
    }


@pytest.mark.parametrize("user_policy", [None, "fp16-params", "fp32-output"])
def test_bf16_mixed_keeps_fp32_master_weights_and_computes_low(user_policy: str | None) -> None:
    rank = run_distributed(_fit_bf16_mixed, 2, user_policy)[0]
    assert rank["params"] == ["torch.float32"]
    assert rank["grads"] == ["torch.float32"]
    logits = {None: "torch.bfloat16", "fp16-params": "torch.float16", "fp32-output": "torch.float32"}[user_policy]
    assert rank["logits"] == logits
    assert rank["finite"]


class _OverflowOnRank0(LlamaModule):
    """In the first step, an inf in rank 0's shard of one gradient only (after backward's reduce-scatter): what an
    fp16 overflow in one rank's part looks like. A plain GradScaler would skip the step on rank 0 alone and step on
    rank 1, and halve the scale on rank 0 alone; a sharded one agrees on the inf across ranks."""

    def on_after_backward(self) -> None:
        if self.trainer.global_step == 0 and self.global_rank == 0:
            grad = next(p.grad for p in self.parameters() if p.grad is not None)
            grad.to_local().view(-1)[0] = float("inf")


def _fit_16_mixed() -> dict:
    from lightning_fsdp2 import FSDP2Precision

    module = _OverflowOnRank0()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=FSDP2Strategy(), plugins=FSDP2Precision("16-mixed"), **_trainer_kwargs()
    )
    trainer.fit(module)
    scaler = trainer.strategy.precision_plugin.scaler
    return {"losses": module.losses, "scale": float(scaler.get_scale()), "state": full_state(module),
            "device": trainer.precision_plugin.device, "initial_scale": float(scaler._init_scale),
            "backoff": float(scaler.get_backoff_factor())}


def test_16_mixed_uses_a_sharded_grad_scaler() -> None:
    """16-mixed with an inf in rank 0's gradient shard only in the first step: both ranks skip that step and back off
    the scale together (a plain GradScaler would not: ranks would end with different scales and weights)."""
    results = run_distributed(_fit_16_mixed, 2)
    assert all(torch.isfinite(torch.tensor(results[0]["losses"])))
    # The loss really was scaled (a scaler without a supported device disables itself and reports 1.0), and the
    # overflow on rank 0 backed the scale off once on both ranks ...
    first = results[0]
    assert first["scale"] == results[1]["scale"] == first["initial_scale"] * first["backoff"] > 1.0, results
    assert results[0]["device"] == ("cuda" if torch.cuda.is_available() else "cpu")  # as Lightning's plugins have it
    for key, value in results[0]["state"].items():
        assert torch.equal(value, results[1]["state"][key])


# --------------------------------------------------------------------------- clear errors
class EmptyModule(LlamaModule):
    def configure_model(self) -> None:
        pass  # forgot to build anything


class FSDP1Module(LlamaModule):
    def configure_model(self) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        super().configure_model()
        if torch.cuda.is_available():
            self.layer = FullyShardedDataParallel(torch.nn.Linear(4, 4), device_id=torch.cuda.current_device())
        else:
            # FSDP1 refuses to wrap on a CPU-only machine; an instance made without its __init__ is still an FSDP1
            # module to the (purely structural) check under test.
            self.layer = FullyShardedDataParallel.__new__(FullyShardedDataParallel)
            torch.nn.Module.__init__(self.layer)


class RebuildingModule(LlamaModule):
    def configure_model(self) -> None:
        self.model = build_llama(lora=True)  # no "already built" guard


def _error_of(case: str) -> str:
    world = int(__import__("os").environ["WORLD_SIZE"])
    modules = {"empty": EmptyModule, "fsdp1": FSDP1Module, "rebuild": RebuildingModule, "offload": LlamaModule,
               "reshard": LlamaModule}
    strategy = FSDP2Strategy(cpu_offload=(case == "offload"), reshard_after_forward=world if case == "reshard" else True)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, **_trainer_kwargs(max_steps=1))
    module = modules[case]()
    try:
        trainer.fit(module)
        trainer.validate(module, verbose=False)
    except Exception as err:  # noqa: BLE001 - the message is what the tests check
        return f"{type(err).__name__}: {err}"
    return "no error"


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("empty", r"RuntimeError: EmptyModule has no parameters to shard\. Build the network in `configure_model`"),
        ("fsdp1", r"TypeError: Modules \['layer'\] are wrapped in FSDP1's FullyShardedDataParallel"),
        ("rebuild", r"RuntimeError: `configure_model` built new layers on a model that is already sharded"),
        ("offload", r"ValueError: FSDP2Strategy\(cpu_offload=True\) .* already on the CPU"),
        ("reshard", r"ValueError: FSDP2Strategy\(reshard_after_forward=2\) with parameters sharded over 2 ranks"
                    r".* and 2 ranks have none \(no divisor of 2 other than 1 and itself\)"),
    ],
)
def test_clear_errors(case: str, expected: str) -> None:
    import re

    for message in run_distributed(_error_of, 2, case):
        assert re.search(expected, message), message


# --------------------------------------------------------------------------- validate, test and predict
class EvalModule(LlamaModule):
    def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("test_loss", self.model(input_ids=batch, labels=batch).loss, sync_dist=True)

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch).logits.argmax(-1)


def _evaluate() -> dict:
    module = EvalModule()
    kwargs = _trainer_kwargs(max_steps=2, limit_val_batches=None)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy(), **kwargs)
    trainer.fit(module)
    loader = module.val_dataloader()
    val = trainer.validate(module, dataloaders=loader, verbose=False)[0]["val_loss"]
    test = trainer.test(module, dataloaders=loader, verbose=False)[0]["test_loss"]
    predictions = trainer.predict(module, dataloaders=loader)
    return {"val": val, "test": test, "predictions": torch.cat(predictions), "state": full_state(module)}


def test_validate_test_and_predict_after_fit() -> None:
    """The sharded model serves every Trainer entry point, and agrees with the same weights in one process."""
    results = run_distributed(_evaluate, 2)
    assert results[0]["val"] == pytest.approx(results[0]["test"], abs=1e-6)
    reference = LlamaModule()
    reference.configure_model()
    reference.load_state_dict(results[0]["state"])
    batches = torch.cat(list(reference.val_dataloader()))
    with torch.no_grad():
        expected_loss = reference.model(input_ids=batches, labels=batches).loss.item()
    assert results[0]["val"] == pytest.approx(expected_loss, abs=1e-5)
    assert results[0]["predictions"].shape[-1] == batches.shape[-1]


# --------------------------------------------------------------------------- processes started outside Lightning
def _fit_with_devices(devices: int, torchelastic: bool) -> str:
    import os

    if torchelastic:  # what torchrun sets besides RANK/LOCAL_RANK/WORLD_SIZE: Lightning then picks its environment
        os.environ.update(GROUP_RANK="0", LOCAL_WORLD_SIZE=os.environ["WORLD_SIZE"], TORCHELASTIC_RUN_ID="test")
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=FSDP2Strategy(), max_steps=1,
                        **quiet_trainer_kwargs())
    try:
        trainer.fit(LlamaModule())
    except ValueError as error:
        return f"{type(trainer.strategy.cluster_environment).__name__}: {error}"
    return "trained"


@pytest.mark.parametrize("torchelastic", [False, True], ids=["launcher-env", "torchrun"])
def test_a_launch_that_disagrees_with_devices_is_refused_on_every_rank(torchelastic: bool) -> None:
    """Two processes started outside Lightning with `devices=1`, one with `devices=2`: Lightning's own settings check
    (torchrun's environment) or ours (any other launcher) raises on every rank before any work, instead of an
    IndexError or silently training on half the data."""
    for result in run_distributed(_fit_with_devices, 2, 1, torchelastic):
        assert "does not match the world size (2)" in result, result
        assert ("TorchElastic" in result) == torchelastic, result
        # the fix, under torchrun from its own LOCAL_WORLD_SIZE (Lightning's message alone has none)
        fix = ("Set `Trainer(devices=2, num_nodes=1)` (or Fabric's) instead of devices=1" if torchelastic
               else "Set `devices` (now 1) to the processes per node")
        assert fix in result, result
    (alone,) = run_distributed(_fit_with_devices, 1, 2, torchelastic)
    assert "does not match the world size (1)" in alone, alone
    assert "Set `Trainer(devices=1, num_nodes=1)`" in alone or not torchelastic, alone


def test_the_launch_fix_counts_nodes_from_torchruns_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun the values to set come from its LOCAL_WORLD_SIZE and WORLD_SIZE (2 nodes of 4 here); under
    another launcher that exports LOCAL_WORLD_SIZE too, no torchrun values are claimed."""
    from lightning_fsdp2._frontend import _launch_fix

    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert _launch_fix(8, 1, torchrun=True).startswith(
        "Set `Trainer(devices=4, num_nodes=2)` (or Fabric's) instead of devices=8, num_nodes=1")
    assert _launch_fix(8, 1, torchrun=False).startswith("Set `devices` (now 8) to the processes per node")


def _two_nodes_of_one(devices: int) -> str:
    import os
    from datetime import timedelta

    os.environ["NODE_RANK"] = os.environ["RANK"]  # a launcher that started 2 nodes x 1 process
    os.environ["LOCAL_RANK"] = "0"
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=FSDP2Strategy(timeout=timedelta(seconds=5)),
                        max_steps=1, **quiet_trainer_kwargs())
    try:
        trainer.fit(LlamaModule())
    except Exception as error:  # noqa: BLE001 - the test reads the message
        return f"{type(error).__name__}: {error}"
    return "trained"


def test_a_launch_split_otherwise_than_devices_and_num_nodes_is_named() -> None:
    """Two nodes of one process each, but `devices=2, num_nodes=1`: the total agrees, the split does not. The process
    numbered out of range says so (the other one can only time out waiting for it)."""
    first, second = run_distributed(_two_nodes_of_one, 2, 2)
    assert "NODE_RANK=1, but `num_nodes=1`" in second, second


# --------------------------------------------------------------------------- tensors built for real
class PerRankValues(L.LightningModule):
    """Built for real with a different seed on each rank: in `__init__`, or in configure_model with meta_init=False."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where, self.initial, self.net = where, None, None
        if where == "__init__":
            self._build()

    def _build(self) -> None:
        torch.manual_seed(100 + int(__import__("os").environ["RANK"]))  # another seed on each rank
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
        self.net.register_buffer("scale", torch.rand(4))
        self.initial = {k: v.detach().clone() for k, v in self.net.state_dict().items()}

    def configure_model(self) -> None:
        if self.net is None:
            self._build()

    def validation_step(self, batch, batch_idx: int) -> None:
        pass

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TokenDataset(1), batch_size=1)


def _real_build(where: str) -> dict:
    module = PerRankValues(where)
    strategy = FSDP2Strategy(meta_init=(where == "__init__"))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, **quiet_trainer_kwargs())
    trainer.validate(module, verbose=False)
    return {"initial": module.initial, "state": {k.removeprefix("net."): v for k, v in full_state(module).items()}}


@pytest.mark.parametrize("where", ["__init__", "meta_init=False"])
def test_tensors_built_for_real_take_rank_0s_values_as_with_ddp(where: str) -> None:
    """fully_shard keeps each rank's own slice of its own tensor; built with another seed on each rank, the sharded
    model would stitch rank 0's rows to rank 1's. Broadcast before sharding, every rank holds rank 0's values."""
    ranks = run_distributed(_real_build, 2, where)
    assert not torch.equal(ranks[0]["initial"]["0.weight"], ranks[1]["initial"]["0.weight"]), "the ranks differ"
    for rank in ranks:
        for name, value in ranks[0]["initial"].items():
            assert torch.equal(rank["state"][name], value), name


# --------------------------------------------------------------------------- a second Trainer for the same module
def _second_trainer(start_state: dict, path: str, second: dict, reuse: bool = True) -> dict:
    """`fit` for 2 steps, a checkpoint, then a new Trainer (and strategy) given the same module (``reuse``; else a
    module built anew): `fit` on to 4 steps from the checkpoint, as one does with DDP."""
    module = LlamaModule(start_state=start_state)
    first = L.Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy(), **_trainer_kwargs(max_steps=2))
    first.fit(module)
    first.save_checkpoint(path)
    if not reuse:
        module = LlamaModule(start_state=start_state)
    if second.get("rebuild"):  # `configure_model` without its guard: it builds the layers anew
        module.model = None
    shards = list(module.model.parameters()) if reuse and module.model is not None else []
    strategy = FSDP2Strategy(**second.get("strategy", {}))
    kwargs = _trainer_kwargs(max_steps=4, precision=second.get("precision", "32-true"))
    try:
        L.Trainer(accelerator="cpu", devices=2, strategy=strategy, **kwargs).fit(module, ckpt_path=path)
    except RuntimeError as err:
        return {"error": str(err)}
    return {"state": full_state(module), "losses": module.losses[-2:],
            "same_shards": reuse and all(a is b for a, b in zip(shards, module.model.parameters(), strict=True))}


def test_a_second_trainer_takes_the_module_a_first_one_set_up(tmp_path) -> None:
    """The module is taken as it is (the same shards), and the resumed run ends where a module built anew and resumed
    from the same checkpoint does (the optimizer state loads although the first run left gradients on the
    parameters); a second Trainer that would lay it out otherwise is refused on every rank, naming what differs."""
    start = _start_state()
    anew = run_distributed(_second_trainer, 2, start, str(tmp_path / "anew.ckpt"), {}, False)
    for got, want in zip(run_distributed(_second_trainer, 2, start, str(tmp_path / "a.ckpt"), {}), anew):
        assert got["same_shards"]
        assert got["losses"] == pytest.approx(want["losses"], abs=1e-6)  # each rank's own
        _assert_same_weights(got["state"], want["state"])
    other = {"strategy": {"reshard_after_forward": False}, "precision": "bf16-true"}
    for got in run_distributed(_second_trainer, 2, start, str(tmp_path / "b.ckpt"), other):
        assert "set up by an earlier run of FSDP2Strategy" in got["error"], got
        assert "precision: '32-true' then, 'bf16-true' now" in got["error"], got["error"]
        assert "shard:" in got["error"] and "save a checkpoint" in got["error"], got["error"]
    for got in run_distributed(_second_trainer, 2, start, str(tmp_path / "c.ckpt"), {"rebuild": True}):
        assert "built new layers" in got["error"] and "return early" in got["error"], got["error"]
