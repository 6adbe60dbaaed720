"""Per-block options: activation checkpointing modes, torch.compile, prefetching, the last block kept gathered.

Parity against the single-process reference of tests/test_strategy.py (a plain Lightning run, without this package),
plus evidence that each option did something: recomputed forwards counted per block, ATen matmuls counted in a step,
compiled graphs counted over the steps, all-gathers counted and ordered.
"""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_fsdp2 import FSDP2Strategy
from tests.helpers import run_distributed
from tests.models import LlamaModule, full_state, quiet_trainer_kwargs
from tests.test_strategy import _assert_same_weights, _fit_reference, _fit_sharded, _start_state, _trainer_kwargs


def _blocks() -> set:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return {LlamaDecoderLayer}


# --------------------------------------------------------------------------- activation checkpointing modes
CHECKPOINTING = {
    "every-2nd": {"activation_checkpointing_every": 2},
    "matmuls": {"activation_checkpointing_save": "matmuls"},
    "ops": {"activation_checkpointing_save": ["mm", "addmm"]},  # ATen ops by name: operators do not pickle
}


def _fit_with_ops(start: dict, strategy: dict) -> dict:
    save = strategy.get("activation_checkpointing_save")
    if isinstance(save, list):
        strategy = {**strategy, "activation_checkpointing_save": {getattr(torch.ops.aten, n).default for n in save}}
    return _fit_sharded(start, {}, {}, strategy)


@pytest.mark.parametrize("mode", list(CHECKPOINTING))
def test_checkpointing_modes_match_one_process(mode: str) -> None:
    """Every n-th block and op-level selective checkpointing leave the numbers exact (<= 1e-4 after 3 steps)."""
    strategy = {"activation_checkpointing_policy": _blocks(), **CHECKPOINTING[mode]}
    start = _start_state()
    reference = _fit_reference(start, {}, {}, world=2)
    for rank in run_distributed(_fit_with_ops, 2, start, strategy):
        _assert_same_weights(rank["state"], reference["state"])


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


class _Probe(LlamaModule):
    """Counts each decoder layer's forwards, and the ATen ops of the first training step (forward and backward)."""

    def on_fit_start(self) -> None:
        super().on_fit_start()
        self.calls = [0] * len(self.model.base_model.model.model.layers)
        for i, layer in enumerate(self.model.base_model.model.model.layers):
            layer.register_forward_pre_hook(lambda *_, i=i: self.calls.__setitem__(i, self.calls[i] + 1))
        self.ops: dict[str, int] = {}

    def on_train_batch_start(self, batch, batch_idx) -> None:
        self.mode = _CountOps() if batch_idx == 0 else None
        if self.mode is not None:
            self.mode.__enter__()

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.ops = self.mode.counts


def _save_mm(ctx, op, *args, **kwargs):
    """A torch policy function (module level, so it reaches the processes): save mm and addmm outputs."""
    from torch.utils.checkpoint import CheckpointPolicy

    keep = op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def _probe(strategy_kwargs: dict, layers: int) -> dict:
    save = strategy_kwargs.get("activation_checkpointing_save")
    if isinstance(save, list):  # ATen ops by name: operators do not pickle
        strategy_kwargs = {**strategy_kwargs, "activation_checkpointing_save": {getattr(torch.ops.aten, n).default
                                                                              for n in save}}
    module = _Probe(num_hidden_layers=layers)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy(**strategy_kwargs), max_steps=1,
                        limit_val_batches=0, **quiet_trainer_kwargs())
    trainer.fit(module)
    return {"calls": module.calls, "mm": module.ops.get("mm", 0), "silu": module.ops.get("silu", 0)}


def test_every_nth_block_and_op_level_checkpointing_recompute_what_they_say() -> None:
    """Every 2nd of 4 blocks: blocks 2 and 4 run twice (forward, recomputation), 1 and 3 once. Op-level with
    "matmuls": the blocks are recomputed (their activations, SiLU among them, run again) but not their matmuls: as
    many as without checkpointing, where whole-block checkpointing runs every block's matmuls twice."""
    blocks = _blocks()
    every = run_distributed(_probe, 2, {"activation_checkpointing_policy": blocks, "activation_checkpointing_every": 2}, 4)[0]
    assert every["calls"] == [1, 2, 1, 2]
    none = run_distributed(_probe, 2, {}, 2)[0]
    full = run_distributed(_probe, 2, {"activation_checkpointing_policy": blocks}, 2)[0]
    matmuls = run_distributed(_probe, 2, {"activation_checkpointing_policy": blocks,
                                          "activation_checkpointing_save": "matmuls"}, 2)[0]
    assert none["calls"] == [1, 1] and full["calls"] == [2, 2] and matmuls["calls"] == [2, 2]
    assert full["mm"] > none["mm"] and matmuls["mm"] == none["mm"]
    assert matmuls["silu"] == full["silu"] > none["silu"]
    # The other two forms: ATen operators, and a torch policy function; both save mm and addmm.
    for save in (["mm", "addmm"], _save_mm):
        ops = run_distributed(_probe, 2, {"activation_checkpointing_policy": blocks,
                                          "activation_checkpointing_save": save}, 2)[0]
        assert ops["calls"] == [2, 2] and ops["mm"] == none["mm"] and ops["silu"] == full["silu"]


# --------------------------------------------------------------------------- torch.compile per block
class _Graphs(LlamaModule):
    """Records dynamo's count of compiled graphs after each step."""

    def on_fit_start(self) -> None:
        super().on_fit_start()
        self.graphs: list[int] = []

    def on_train_batch_end(self, *args) -> None:
        from torch._dynamo.utils import counters

        self.graphs.append(counters["stats"]["unique_graphs"])


def _fit_compiled(start: dict | None, strategy_kwargs: dict, precision: str, steps: int, path: str | None,
                  validate: bool = False) -> dict:
    from torch._dynamo.utils import counters

    module = _Graphs(start_state=start, num_hidden_layers=3)
    # Validating after every step (eager, with the model's key/value cache on): adds no compiled graph.
    extra = {"limit_val_batches": 1, "val_check_interval": 1} if validate else {}
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy(**strategy_kwargs), precision=precision,
                        **_trainer_kwargs(max_steps=steps, **extra))
    trainer.fit(module)
    if path is not None:
        trainer.save_checkpoint(path)
    names = [n for n, _ in module.named_modules()] + [n for n, _ in module.named_parameters()]
    return {"state": full_state(module), "graphs": module.graphs, "losses": module.losses,
            "names": names, "dtypes": sorted({str(p.dtype) for p in module.parameters()}),
            "graph_breaks": sum(counters["graph_break"].values()), "inductor": sum(counters["inductor"].values())}


@pytest.mark.slow
def test_compiled_blocks_match_one_process_compile_once_and_keep_names(tmp_path) -> None:
    """compile=True (inductor, fp32, LoRA): weights within 1e-4 of one eager process after 4 steps; inductor reorders
    float sums, so not bit-exact, but far inside that. Graphs are compiled in the first step only (one for the first
    block, whose input needs no gradient under LoRA, one shared by the others) and none after, over 4 steps. Names in
    the module and in the checkpoint are the eager model's (no `_orig_mod`)."""
    start = _start_state(num_hidden_layers=3)
    reference = _fit_reference(start, {"num_hidden_layers": 3}, {}, world=2)
    # _fit_reference runs 3 steps; run 3 for parity, and count the graphs over the same run
    path = str(tmp_path / "compiled.ckpt")
    results = run_distributed(_fit_compiled, 2, start, {"compile": True}, "32-true", 3, path, True, timeout=900)
    for rank in results:
        _assert_same_weights(rank["state"], reference["state"])
        assert 1 <= rank["graphs"][0] <= 2 and rank["graphs"] == [rank["graphs"][0]] * 3, rank["graphs"]
        assert rank["graph_breaks"] == 0 and rank["inductor"] > 0
        assert not any("_orig_mod" in n for n in rank["names"])
    eager = LlamaModule(num_hidden_layers=3)
    eager.configure_model()
    saved = torch.load(path, weights_only=True)["state_dict"]
    assert list(saved) == list(eager.state_dict())


@pytest.mark.slow
@pytest.mark.parametrize(
    "checkpointing, most_graphs",
    [({}, 2), ({"activation_checkpointing_save": "matmuls"}, 2),
     ({"activation_checkpointing_every": 2, "activation_checkpointing_save": "matmuls"}, 3)],
    ids=["full", "matmuls", "every-2nd-matmuls"],
)
def test_compiled_checkpointed_blocks_match_one_process(checkpointing: dict, most_graphs: int) -> None:
    """Checkpointing inside the compiled blocks (whole, op-level, op-level on every 2nd block): within 1e-4 of one
    eager process; the checkpoint compiled with the block (no graph break), graphs made in the first step only (a
    checkpointed and a plain block are two graphs)."""
    strategy = {"compile": True, "activation_checkpointing_policy": _blocks(), **checkpointing}
    start = _start_state(num_hidden_layers=3)
    reference = _fit_reference(start, {"num_hidden_layers": 3}, {}, world=2)
    for rank in run_distributed(_fit_compiled, 2, start, strategy, "32-true", 3, None, timeout=900):
        _assert_same_weights(rank["state"], reference["state"])
        assert 1 <= rank["graphs"][0] <= most_graphs and rank["graphs"] == [rank["graphs"][0]] * 3, rank["graphs"]
        assert rank["graph_breaks"] == 0


@pytest.mark.slow
def test_compile_options_reach_torch_compile() -> None:
    """compile={"backend": "aot_eager"}: compiled (graphs) but not by inductor, which compile=True uses."""
    result = run_distributed(_fit_compiled, 2, None, {"compile": {"backend": "aot_eager"}}, "32-true", 2, None,
                             timeout=900)[0]
    assert result["graphs"][0] >= 1 and result["inductor"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("precision, stored", [("bf16-true", "torch.bfloat16"), ("bf16-mixed", "torch.float32")])
def test_compiled_lora_under_low_precision_trains_like_eager(precision: str, stored: str) -> None:
    """compile + LoRA under bf16-true (a bf16 base) and bf16-mixed (fp32 stored, bf16 computed): the eager sharded
    run's parameter dtypes, and its losses to bf16's precision."""
    start = _start_state(num_hidden_layers=3)
    compiled = run_distributed(_fit_compiled, 2, start, {"compile": True}, precision, 3, None, timeout=900)[0]
    eager = run_distributed(_fit_compiled, 2, start, {}, precision, 3, None, timeout=900)[0]
    assert stored in compiled["dtypes"] and compiled["dtypes"] == eager["dtypes"]
    assert compiled["graphs"][0] >= 1 and eager["graphs"] == [0] * 3
    assert compiled["losses"] == pytest.approx(eager["losses"], abs=3e-2)


class _HookedActivation(LlamaModule):
    """A forward hook on each block's ``mlp.act_fn`` that keeps its output, as a user's activation probe would: a
    side effect inside the compiled, checkpointed block, which dynamo cannot trace."""

    def configure_model(self) -> None:
        hooked = self.model is not None
        super().configure_model()
        self.activations: list[torch.Tensor] = []
        for sub in [] if hooked else self.model.modules():
            if type(sub).__name__ == "LlamaMLP":
                sub.act_fn.register_forward_hook(lambda module, args, out: self.activations.append(out.detach()))


def _fit_hooked(hooked: bool) -> dict:
    import warnings

    from torch._dynamo.utils import counters

    module = (_HookedActivation if hooked else LlamaModule)(num_hidden_layers=2)
    strategy = FSDP2Strategy(compile={"backend": "eager"}, activation_checkpointing_policy=_blocks(),
                             activation_checkpointing_save="matmuls")
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, **_trainer_kwargs(max_steps=2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module)
    found = [str(w.message) for w in caught if "FSDP2Strategy(compile=...)" in str(w.message)]
    return {"warnings": found, "graph_breaks": sum(counters["graph_break"].values())}


@pytest.mark.slow  # the case end to end at world size 2; the one-process tests below cover the logic
def test_a_compiled_block_that_breaks_its_graph_is_warned_about_once_on_rank_zero() -> None:
    """compile + whole-block checkpointing + "matmuls" with a forward hook inside each block: dynamo breaks the graph
    (torch says nothing; the step runs eagerly). One warning on rank 0 names the first block and torch's reason;
    none on rank 1, and none without the hook."""
    first, second = run_distributed(_fit_hooked, 2, True, timeout=600)
    assert first["graph_breaks"] > 0, first
    assert len(first["warnings"]) == 1, first["warnings"]
    assert "block 'model.base_model.model.model.layers.0'" in first["warnings"][0], first["warnings"][0]
    assert "broke its graph" in first["warnings"][0]
    assert "register it on the block itself" in first["warnings"][0]
    assert second["warnings"] == [], second
    clean = run_distributed(_fit_hooked, 2, False, timeout=600)[0]
    assert clean["graph_breaks"] == 0 and clean["warnings"] == [], clean


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner, self.act = torch.nn.Linear(8, 8), torch.nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.inner(x))


def _graph_warnings(hooked: bool, checkpointed: bool) -> list[str]:
    """A fresh two-block model, its blocks compiled (dynamo's eager backend), one training forward and backward in
    this process: the compile warnings it gives."""
    import warnings

    from lightning_fsdp2.blocks import compile_blocks

    model = torch.nn.Sequential(_Block(), _Block())
    seen: list[torch.Tensor] = []
    if hooked:
        for block in model:
            block.act.register_forward_hook(lambda module, args, out: seen.append(out.detach()))
    names = ["0", "1"]
    compile_blocks(model, names, {"backend": "eager"}, checkpointed=names if checkpointed else ())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.randn(2, 8, requires_grad=True)).sum().backward()
    return [str(w.message) for w in caught if "FSDP2Strategy(compile=...)" in str(w.message)]


def test_the_graph_warning_is_given_for_a_break_and_not_for_a_model_compiled_again() -> None:
    """In one process: a checkpointed block whose submodule's hook appends to a list breaks its graph, warned once,
    also after two clean models were compiled (each compile_blocks compiles afresh: dynamo does not guard on hooks,
    so a graph of theirs would have served it and skipped the hook); clean models and dynamo turned off give no
    warning."""
    import torch._dynamo

    torch._dynamo.reset()
    assert _graph_warnings(hooked=False, checkpointed=True) == []
    assert _graph_warnings(hooked=False, checkpointed=True) == []  # a second model in the process
    hooked = _graph_warnings(hooked=True, checkpointed=True)
    assert len(hooked) == 1 and "block '0' broke its graph" in hooked[0], hooked
    torch._dynamo.reset()
    with torch._dynamo.config.patch(disable=True):
        assert _graph_warnings(hooked=True, checkpointed=True) == []
    torch._dynamo.reset()


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_a_hook_on_one_compiled_block_runs(checkpointed: bool) -> None:
    """A forward hook on a submodule of the second block only (a probe on one layer), blocks compiled: it runs at
    every training forward, with the values eager gives; the first block's graph (traced without it) does not serve
    the second block, which gets its own."""
    from lightning_fsdp2.blocks import compile_blocks

    torch.manual_seed(0)
    model = torch.nn.Sequential(_Block(), _Block())
    eager = copy.deepcopy(model)
    seen: dict[str, list[torch.Tensor]] = {"compiled": [], "eager": []}
    model[1].act.register_forward_hook(lambda module, args, out: seen["compiled"].append(out.detach().clone()))
    eager[1].act.register_forward_hook(lambda module, args, out: seen["eager"].append(out.detach().clone()))
    compile_blocks(model, ["0", "1"], {"backend": "eager"}, checkpointed=["0", "1"] if checkpointed else ())
    x = torch.randn(2, 8, requires_grad=True)
    for _ in range(2):
        model(x).sum().backward()
        eager(x).sum().backward()
    assert (len(seen["compiled"]), len(seen["eager"])) == (2, 2), {k: len(v) for k, v in seen.items()}
    torch.testing.assert_close(seen["compiled"][0], seen["eager"][0])


# --------------------------------------------------------------------------- prefetch and the last block
def _count_all_gathers(module: L.LightningModule) -> None:
    """Count FSDP2's all-gathers in ``module.gathers`` (it calls torch.distributed.all_gather_single)."""
    module.gathers = 0
    original = torch.distributed.all_gather_single

    def counting(*args, **kwargs):
        module.gathers += 1
        return original(*args, **kwargs)

    torch.distributed.all_gather_single = counting


class _Gathers(LlamaModule):
    """Counts FSDP2's all-gathers in the first step, and how many had been issued when each block's forward began."""

    def on_fit_start(self) -> None:
        super().on_fit_start()
        self.at_block: list[int] = []
        _count_all_gathers(self)
        self.at_backward: list[int] = []
        for layer in self.model.base_model.model.model.layers:
            layer.register_forward_pre_hook(lambda *_: self.at_block.append(self.gathers))
            layer.mlp.register_full_backward_pre_hook(lambda *_: self.at_backward.append(self.gathers))


def _gathers(strategy_kwargs: dict) -> dict:
    module = _Gathers(num_hidden_layers=3)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy(**strategy_kwargs), max_steps=1,
                        limit_val_batches=0, **quiet_trainer_kwargs())
    trainer.fit(module)
    return {"at_block": module.at_block, "gathers": module.gathers, "at_backward": module.at_backward}


def test_prefetch_gathers_ahead_and_the_last_block_can_stay_gathered() -> None:
    """Without prefetch, when block k's forward begins the root and blocks 1..k have been gathered; with
    forward_prefetch=1, block k+1 has too; backward_prefetch=2 gathers two blocks ahead in backward.
    reshard_last_block=False saves the last block's gather in backward: one
    all-gather fewer per step (FSDP2 gathers every block in forward and again in backward, the root once)."""
    default = run_distributed(_gathers, 2, {})[0]
    ahead = run_distributed(_gathers, 2, {"forward_prefetch": 1})[0]
    behind = run_distributed(_gathers, 2, {"backward_prefetch": 2})[0]
    kept = run_distributed(_gathers, 2, {"reshard_last_block": False})[0]
    assert default["at_block"] == [2, 3, 4]
    assert ahead["at_block"] == [3, 4, 4]
    # Backward runs blocks 3, 2, 1: when block 3's backward begins FSDP2 has regathered it and prefetched block 2
    # (4 + 2 gathers); with backward_prefetch=2, block 1 too.
    assert default["at_backward"] == [6, 7, 7]
    assert behind["at_backward"] == [7, 7, 7]
    assert default["gathers"] == 1 + 2 * 3
    assert kept["gathers"] == default["gathers"] - 1


PREFETCH = {
    "forward-1": {"forward_prefetch": 1},
    "forward-2-backward-2": {"forward_prefetch": 2, "backward_prefetch": 2},
    "last-block-kept": {"reshard_last_block": False},
}


@pytest.mark.parametrize("case", list(PREFETCH))
def test_prefetch_and_last_block_options_match_one_process(case: str) -> None:
    start = _start_state()
    reference = _fit_reference(start, {}, {}, world=2)
    for rank in run_distributed(_fit_sharded, 2, start, {}, {}, copy.deepcopy(PREFETCH[case])):
        _assert_same_weights(rank["state"], reference["state"])


# --------------------------------------------------------------------------- wrong arguments, said at once
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"activation_checkpointing_every": 0}, "positive int"),
        ({"activation_checkpointing_every": 2}, "pass it too"),
        ({"activation_checkpointing_policy": set(), "activation_checkpointing_save": "everything"}, "'matmuls'"),
        ({"compile": {"fullgrap": True}}, "torch.compile takes no"),
        ({"compile": "yes"}, "pass True"),
        ({"forward_prefetch": -1}, "blocks ahead"),
        ({"forward_prefetch": True}, "blocks ahead"),
        ({"backward_prefetch": 0}, "blocks ahead"),
    ],
)
def test_wrong_block_options_are_refused_at_construction(kwargs: dict, match: str) -> None:
    from lightning_fsdp2.fabric import FSDP2Strategy as FabricFSDP2Strategy

    for strategy in (FSDP2Strategy, FabricFSDP2Strategy):
        with pytest.raises((TypeError, ValueError), match=match):
            strategy(**kwargs)


def _fit_expecting_error(strategy_kwargs: dict) -> str:
    module = LlamaModule()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy(**strategy_kwargs), max_steps=1,
                        **quiet_trainer_kwargs())
    try:
        trainer.fit(module)
    except (ValueError, TypeError) as error:
        return str(error)
    return "no error"


def test_offloading_activations_on_cpu_and_checkpointing_inside_compiled_blocks_are_refused_on_every_rank() -> None:
    from transformers.models.llama.modeling_llama import LlamaMLP

    offload = run_distributed(_fit_expecting_error, 2, {"offload_activations": True})
    assert all("offload_activations=True" in e and "'cpu'" in e for e in offload)
    inside = run_distributed(_fit_expecting_error, 2, {"compile": True, "activation_checkpointing_policy": {LlamaMLP}})
    assert all("whole compiled blocks" in e and "mlp" in e for e in inside)


class _TwoModels(LlamaModule):
    """Two roots with blocks of their own (as a policy and a reference model): `self.model` and `self.other`."""

    def configure_model(self) -> None:
        if self.model is None:
            from tests.models import build_llama

            self.model, self.other = build_llama(True), build_llama(True)

    def on_fit_start(self) -> None:
        _count_all_gathers(self)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss + self.other(input_ids=batch, labels=batch).loss
        self.losses.append(float(loss.detach()))
        return loss


def _two_models(strategy_kwargs: dict) -> dict:
    module = _TwoModels()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy(**strategy_kwargs), max_steps=1,
                        limit_val_batches=0, **quiet_trainer_kwargs())
    trainer.fit(module)
    return {"gathers": module.gathers, "losses": module.losses}


def test_prefetch_and_the_kept_last_block_stay_within_each_root() -> None:
    """Each root's blocks are a chain of their own: prefetching never reaches into the other model (whose groups are
    not set up before its first forward), and each root keeps its own last block (two all-gathers fewer per step)."""
    default = run_distributed(_two_models, 2, {})[0]
    tuned = run_distributed(_two_models, 2, {"forward_prefetch": 1, "backward_prefetch": 2, "reshard_last_block": False})[0]
    assert tuned["gathers"] == default["gathers"] - 2
    assert tuned["losses"] == pytest.approx(default["losses"], abs=1e-5)


class _ConfigOnModule(LlamaModule):
    """Keeps the model's config on the LightningModule too (`self.config`, as README's LoraLlama does)."""

    def configure_model(self) -> None:
        super().configure_model()
        self.config = self.model.config


def _fit_config_on_module(strategy_kwargs: dict) -> dict:
    from torch._dynamo.utils import counters

    module = _ConfigOnModule()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy(**strategy_kwargs), max_steps=2,
                        limit_val_batches=0, **quiet_trainer_kwargs())
    trainer.fit(module)
    return {"losses": module.losses, "graph_breaks": sum(counters["graph_break"].values())}


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
def test_the_kv_cache_is_off_in_training_when_the_lightning_module_holds_the_config_too(compiled: bool) -> None:
    """The cache is turned off on the Hugging Face model the steps call, not on the first module with a `config`:
    with the LightningModule holding `self.config`, op-level checkpointing would otherwise meet the cache's updates in
    its recomputation ("... encountered during backward but not found in storage"), and a compiled block would break
    its graph on them."""
    strategy = {"activation_checkpointing_policy": _blocks(), "activation_checkpointing_save": "matmuls",
                "compile": compiled}
    result = run_distributed(_fit_config_on_module, 2, strategy, timeout=900)[0]
    assert len(result["losses"]) == 2 and all(torch.isfinite(torch.tensor(result["losses"])))
    assert result["graph_breaks"] == 0
