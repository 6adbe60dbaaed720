"""Expert parallelism composed with FSDP2: `FSDP2Strategy(expert_parallel_size=N)` divides the experts of every MoE
layer among groups of N ranks (the model's own `base_model_ep_plan`, transformers' styles), the tokens routed to them
by all-to-all, each rank's experts sharded over the ranks holding the same ones. Compared with one process built
without this package, with where each expert's tensors live checked on every rank (so a strategy that ignored the
expert dimension, gathering every expert everywhere, fails)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import run_distributed
from tests.models import full_state
from tests.test_tensor_parallel import (
    _assert_matches,
    _batches,
    _fabric_model,
    _fabric_reference,
    _fabric_tp_result,
    _placements,
    _pretrained,
)

EXPERTS = 4  # tests.models.tiny_model("qwen3_moe")


def _check_experts_divided(placements: dict, expert: int, shard: int) -> None:
    """Each rank holds EXPERTS / expert of every MoE layer's experts (on the mesh's "expert" dimension), sharded again
    over the `shard` ranks holding the same ones; nothing else lives on the expert mesh."""
    experts = {n: v for n, v in placements.items() if ".mlp.experts." in n}
    assert experts, placements.keys()
    for name, (names, split, local) in experts.items():
        assert "expert" in names and split[names.index("expert")].startswith("Shard(dim=0)"), (name, names, split)
        assert local[0] == -(-EXPERTS // expert // shard), (name, local)
    assert not [n for n, (names, _, _) in placements.items() if "expert" in names and n not in experts]


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_moe_models_under_expert_parallelism_match_one_process(arch: str, lora: bool, tmp_path) -> None:
    """Fabric at world size 2 as one expert group of 2 (each rank 2 of the 4 experts of every layer): Qwen3-MoE and
    Mixtral loaded by load_pretrained (each rank its experts' slices, from the experts stored one tensor each), LoRA
    on attention with the experts frozen or every weight trained, 3 SGD steps with momentum: the weights and losses of
    one process (<= 1e-4)."""
    base, adapter = _pretrained(arch, str(tmp_path), lora=lora)
    want = _fabric_reference(arch, base, adapter, steps=3)
    ranks = run_distributed(_fabric_tp_result, 2, arch, base, adapter, 3, {"expert_parallel_size": 2})
    for rank in ranks:
        _check_experts_divided(rank["placements"], expert=2, shard=1)
        _assert_matches(rank, want, f"{arch} lora={lora}")
    # Each rank's loss is its own half of the batch's (as many tokens each): their mean is one process's.
    assert [sum(r["losses"][i] for r in ranks) / len(ranks) for i in range(3)] == pytest.approx(want["losses"], abs=1e-4)


@pytest.mark.parametrize(("arch", "strategy", "expert", "shard"), [
    ("qwen3_moe", {"expert_parallel_size": 2}, 2, 2),  # two expert groups of 2; each expert sharded over 2 ranks
    ("qwen3_moe", {"expert_parallel_size": 4}, 4, 1),  # one group of 4: one expert per rank
    ("qwen3_moe", {"device_mesh": {"replicate": 2, "expert": 2}}, 2, 1),  # HSDP: one expert group per replica
    pytest.param("mixtral", {"expert_parallel_size": 2}, 2, 2, marks=pytest.mark.slow),
    pytest.param("mixtral", {"expert_parallel_size": 4}, 4, 1, marks=pytest.mark.slow),
], ids=["ep2-fsdp2", "ep4", "hsdp2-ep2", "mixtral-ep2-fsdp2", "mixtral-ep4"])
def test_expert_parallelism_at_world_size_4_matches_one_process(arch: str, strategy: dict, expert: int, shard: int,
                                                                 tmp_path) -> None:
    """Every weight trained at world size 4 in each layout expert parallelism composes with (Qwen3-MoE; Mixtral at
    EP 2 x FSDP 2 and EP 4): the weights and the mean loss of one process (<= 1e-4), each rank holding its share of
    the experts."""
    base, _ = _pretrained(arch, str(tmp_path), lora=False)
    want = _fabric_reference(arch, base, None, steps=3)
    ranks = run_distributed(_fabric_tp_result, 4, arch, base, None, 3, strategy)
    for rank in ranks:
        _check_experts_divided(rank["placements"], expert=expert, shard=shard)
        _assert_matches(rank, want, str(strategy))
    assert [sum(r["losses"][i] for r in ranks) / len(ranks) for i in range(3)] == pytest.approx(want["losses"], abs=1e-4)


def _resumable(base: str, strategy: dict, steps: int, save_at: int | None = None, save_to: str | None = None,
               resume_from: str | None = None) -> dict:
    """Every weight of the tiny Qwen3-MoE trained by SGD with momentum under Fabric, saved after `save_at` steps or
    resumed from `resume_from`, to `steps` in all."""
    fabric, model = _fabric_model("qwen3_moe", base, None, strategy)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if resume_from is not None:
        fabric.load(resume_from, state)
    split = fabric.strategy.distributed_sampler_kwargs
    batches = _batches(steps, split["num_replicas"], split["rank"])
    while state["step"] < steps:
        batch = batches[state["step"]]
        fabric.backward(model(input_ids=batch, labels=batch).loss)
        optimizer.step()
        optimizer.zero_grad()
        state["step"] += 1
        if state["step"] == save_at:
            fabric.save(save_to, state)
    return {"state": full_state(model), "step": state["step"]}


@pytest.mark.parametrize("fmt", ["sharded", pytest.param("full", marks=pytest.mark.slow)])
def test_an_expert_parallel_checkpoint_resumes_exactly_at_other_layouts_and_back(fmt: str, tmp_path) -> None:
    """Saved under expert parallelism (world size 2, EP 2) after 2 of 4 steps (weights and momentum), resumed by EP 2,
    by FSDP alone and by one process; FSDP's own checkpoint resumed by EP 2: each equal to 4 steps of one process
    built without this package (<= 1e-4)."""
    base, _ = _pretrained("qwen3_moe", str(tmp_path), lora=False)
    want = _fabric_reference("qwen3_moe", base, None, steps=4)
    name = "ckpt" if fmt == "sharded" else "ckpt.pt"
    ep, fsdp = {"expert_parallel_size": 2, "state_dict_type": fmt}, {"state_dict_type": fmt}
    run_distributed(_resumable, 2, base, ep, 4, 2, str(tmp_path / f"ep-{name}"))
    run_distributed(_resumable, 2, base, fsdp, 4, 2, str(tmp_path / f"fsdp-{name}"))
    for world, strategy, saved in ((2, ep, "ep"), (2, fsdp, "ep"), (1, fsdp, "ep"), (2, ep, "fsdp")):
        resumed = run_distributed(_resumable, world, base, strategy, 4, None, None, str(tmp_path / f"{saved}-{name}"))
        for rank in resumed:
            assert rank["step"] == 4
            _assert_matches(rank, want, f"{fmt} checkpoint of {saved} resumed at world size {world} with {strategy}")


def _refusal(case: str, base: str) -> str:
    """The message each rank raises for a model expert parallelism cannot divide, before anything is allocated."""
    import lightning as L
    from peft import LoraConfig, get_peft_model

    from lightning_fsdp2 import load_pretrained
    from lightning_fsdp2.fabric import FSDP2Strategy
    from tests.models import tiny_model

    size = 3 if case == "uneven" else 2
    global_batch = case in ("dense-global-batch", "tuple-output")
    options = {"router_aux_loss": "global_batch"} if global_batch else {"expert_parallel_size": size}
    fabric = L.Fabric(accelerator="cpu", devices=size, strategy=FSDP2Strategy(**options))
    fabric.launch()
    try:
        with fabric.init_module():
            model = tiny_model("llama" if case in ("no-plan", "dense-global-batch") else "qwen3_moe")[0]
            if case == "lora-on-experts":  # peft adapts the fused experts' down_proj tensors too
                model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "down_proj"]))
            if case == "qlora":
                load_pretrained(model, base, quantize="nf4")
        model = fabric.setup_module(model)
        if case == "tuple-output":
            tokens = torch.arange(8).view(1, 8)
            model(input_ids=tokens, labels=tokens, output_router_logits=True, return_dict=False)
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize(("case", "message"), [
    ("no-plan", "LlamaForCausalLM has no expert-parallel plan"),
    ("uneven", "has 4 experts per MoE layer, and each rank of an expert group holds an equal share of them. No size"
               " above 1 divides both the 4 experts and the shard group of 3 ranks"),
    ("lora-on-experts", "peft adapters on the experts (['model.layers.0.mlp.experts'"),
    ("qlora", "(QLoRA) does not run with expert parallelism"),
    ("dense-global-batch", "router_aux_loss='global_batch'): LlamaForCausalLM holds no Hugging Face mixture-of-experts"),
    ("tuple-output", "Qwen3MoeForCausalLM was called with return_dict=False and its router logits on"),
])
def test_what_expert_parallelism_cannot_divide_is_refused_by_name_on_every_rank(case: str, message: str,
                                                                              tmp_path) -> None:
    base, _ = _pretrained("qwen3_moe", str(tmp_path), lora=False)
    messages = run_distributed(_refusal, 3 if case == "uneven" else 2, case, base)
    assert len(set(messages)) == 1, messages
    assert message in messages[0], messages[0]


def test_layouts_expert_parallelism_cannot_take_are_refused_at_construction_or_resolution() -> None:
    from lightning_fsdp2 import FSDP2Strategy
    from lightning_fsdp2.layout import Layout

    def resolve(option, world=4, per_node=4, expert=1, tensor=1):
        return Layout.resolve(option, world, per_node, "cpu", tensor, expert)

    layout = resolve(None, expert=2)
    assert (layout.names, layout.sizes, layout.size("expert"), layout.data_parallel_size) == (("shard",), (4,), 2, 4)
    assert resolve({"expert": 2}) == layout == resolve({"shard": 4, "expert": 2})
    assert resolve({"replicate": 2, "expert": 2}).sizes == (2, 2)
    with pytest.raises(ValueError, match=r"expert groups of 3 ranks are carved out of the shard groups of 4 ranks"):
        resolve(None, expert=3)
    with pytest.raises(ValueError, match="expert groups of 2 ranks straddle nodes of 1 devices"):
        resolve(None, per_node=1, expert=2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2\): expert and tensor parallelism together do not"):
        resolve(None, expert=2, tensor=2)
    with pytest.raises(ValueError, match="With one rank per shard group there is no room for expert groups"):
        resolve({"replicate": 2, "expert": 2}, world=2, per_node=2)
    with pytest.raises(ValueError, match='"expert" is no factor of the product'):
        resolve({"shard": 1, "expert": 2}, world=2, per_node=2)
    with pytest.raises(ValueError, match="give the expert-parallel size once"):
        FSDP2Strategy(device_mesh={"expert": 2}, expert_parallel_size=4)
    with pytest.raises(ValueError, match="expert parallelism carves its groups out of the layout's shard dimension"):
        FSDP2Strategy(device_mesh="auto", expert_parallel_size=2)
    with pytest.raises(TypeError, match=r"expert_parallel_size='2'\): a positive int"):
        FSDP2Strategy(expert_parallel_size="2")
    with pytest.raises(ValueError, match=r"expert_parallel_size=0\): a positive int"):
        FSDP2Strategy(expert_parallel_size=0)


def _accumulate_and_clip(base: str, arch: str) -> dict:
    """Every weight trained under EP 2: two half-batches per step (the first under no_backward_sync), the gradients
    clipped to a norm of 0.5 (one norm over the dense and the expert meshes), 3 SGD steps."""
    fabric, model = _fabric_model(arch, base, None, {"expert_parallel_size": 2})
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    split = fabric.strategy.distributed_sampler_kwargs
    synced = []
    for batch in _batches(3, split["num_replicas"], split["rank"]):
        for i, half in enumerate(batch.chunk(2)):
            with fabric.no_backward_sync(model, enabled=i == 0):
                fabric.backward(model(input_ids=half, labels=half).loss / 2)
            if i == 0:
                synced.append(any(p.grad is not None for p in model.parameters()))
        fabric.clip_gradients(model, optimizer, max_norm=0.5)
        optimizer.step()
        optimizer.zero_grad()
    return {"state": full_state(model), "synced": synced, "placements": _placements(model)}


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen2_moe", "gpt_oss"])
def test_accumulation_and_clipping_under_expert_parallelism_match_one_process(arch: str, tmp_path) -> None:
    """Qwen3-MoE, Mixtral, Qwen2-MoE (its shared expert dense) and gpt-oss (its experts' biases divided with them),
    each by its own plan, at EP 2, accumulating two half-batches per step without reducing the first, the gradient
    norm clipped: the weights of one process's 3 clipped whole-batch steps (<= 1e-4)."""
    base, _ = _pretrained(arch, str(tmp_path), lora=False)
    want = _fabric_reference(arch, base, None, steps=3, clip=0.5)
    for rank in run_distributed(_accumulate_and_clip, 2, base, arch):
        assert not any(rank["synced"])
        _check_experts_divided(rank["placements"], expert=2, shard=1)
        _assert_matches(rank, want, f"{arch}: accumulation and clipping under EP 2")


def _trainer_fit(base: str, strategy: dict | None) -> dict:
    """The Trainer: a LightningModule that builds the tiny Qwen3-MoE in configure_model and loads it with
    load_pretrained, 3 SGD steps over the unshuffled data (Lightning's own sampler splits it among data-parallel
    ranks, as Lightning's own sampler would without shuffling); `strategy` None: one process, Lightning's default strategy, no code of this package in the step."""
    import lightning as L
    from torch.utils.data import DataLoader, DistributedSampler

    from lightning_fsdp2 import FSDP2Strategy, load_pretrained
    from tests.models import TokenDataset, data_parallel_split, quiet_trainer_kwargs, tiny_model, world

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = None
            self.losses: list[float] = []

        def configure_model(self) -> None:
            if self.model is None:
                self.model = tiny_model("qwen3_moe")[0]
                load_pretrained(self.model, base)

        def training_step(self, batch, _index):
            loss = self.model(input_ids=batch, labels=batch).loss
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

        def train_dataloader(self):  # unshuffled, rank r taking samples r, r + N...: together one process's batch
            dataset, sampler = TokenDataset(24), None
            if strategy is not None:
                sampler = DistributedSampler(dataset, shuffle=False, **data_parallel_split(self))
            return DataLoader(dataset, batch_size=8 // (world() if strategy is not None else 1), sampler=sampler)

    module = Module()
    if strategy is None:
        module.configure_model()
    trainer = L.Trainer(accelerator="cpu", devices=world() if strategy is not None else 1, max_steps=3,
                        strategy=FSDP2Strategy(**strategy) if strategy is not None else "auto",
                        limit_val_batches=0, num_sanity_val_steps=0, **quiet_trainer_kwargs())
    trainer.fit(module)
    state = full_state(module) if strategy is not None else {
        k: v.detach().clone() for k, v in module.state_dict().items()}
    return {"state": state, "losses": module.losses}


def test_the_trainer_under_expert_parallelism_matches_one_process(tmp_path) -> None:
    """`Trainer(strategy=FSDP2Strategy(expert_parallel_size=2))` at world size 2: the weights of one process's run
    with Lightning's own strategy (<= 1e-4)."""
    base, _ = _pretrained("qwen3_moe", str(tmp_path), lora=False)
    want = run_distributed(_trainer_fit, 1, base, None)[0]
    for rank in run_distributed(_trainer_fit, 2, base, {"expert_parallel_size": 2}):
        _assert_matches(rank, want, "Trainer under EP 2")


def _exports(base: str, adapter: str, out: str) -> dict:
    """LoRA on attention trained 2 steps under EP 2, then the adapter and the merged model saved and greedy tokens
    generated (every rank the same prompt, its experts reached by all-to-all at each token)."""
    import os

    from lightning_fsdp2.lora import save_adapter, save_merged
    from tests.models import TokenDataset
    from tests.test_tensor_parallel import _fabric_tp

    result = _fabric_tp("qwen3_moe", base, adapter, 2, {"expert_parallel_size": 2})
    model = result.pop("model")
    save_adapter(model, os.path.join(out, "adapter"))
    save_merged(model, os.path.join(out, "merged"))
    with torch.no_grad():
        generated = model.generate(input_ids=TokenDataset(2).data[:, :6], max_new_tokens=5, do_sample=False)
    return {"generated": generated}


def test_adapters_merged_models_and_generate_under_expert_parallelism_are_one_processs(tmp_path) -> None:
    """After 2 steps at EP 2: save_adapter writes the adapter peft writes for one process, save_merged the merged
    model (every expert gathered whole) one process's merge_and_unload writes, and greedy generate() the same tokens
    on every rank as one process."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.models import TokenDataset
    from tests.test_tensor_parallel import _train_loop, assert_exports_match

    base, adapter = _pretrained("qwen3_moe", str(tmp_path), lora=True)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter, is_trainable=True)
    _train_loop(None, model, 2, 1, 0)
    model.save_pretrained(tmp_path / "want-adapter")
    with torch.no_grad():
        generated = model.generate(input_ids=TokenDataset(2).data[:, :6], max_new_tokens=5, do_sample=False)
    model.merge_and_unload().save_pretrained(tmp_path / "want-merged")
    for rank in run_distributed(_exports, 2, base, adapter, str(tmp_path / "ours")):
        assert torch.equal(rank["generated"], generated)
    assert_exports_match(tmp_path)


def _fresh_checkpointed(strategy: dict) -> dict:
    """The tiny Qwen3-MoE built on meta with no weights loaded (every tensor initialized by the model's own rules),
    its decoder layers checkpointed, one forward and backward."""
    import lightning as L
    from transformers import Qwen3MoeForCausalLM

    from lightning_fsdp2.fabric import FSDP2Strategy
    from tests.models import TokenDataset, tiny_model

    layer = type(tiny_model("qwen3_moe")[0].model.layers[0])
    fabric = L.Fabric(accelerator="cpu", devices=2,
                      strategy=FSDP2Strategy(activation_checkpointing_policy={layer}, **strategy))
    fabric.launch()
    with fabric.init_module():
        model = tiny_model("qwen3_moe")[0]
    assert isinstance(model, Qwen3MoeForCausalLM)
    model = fabric.setup_module(model)
    batch = TokenDataset(2).data
    loss = model(input_ids=batch, labels=batch).loss
    fabric.backward(loss)
    experts = model.module.model.layers[0].mlp.experts.gate_up_proj
    return {"loss": float(loss), "experts": experts.to_local().detach().clone(), "std": float(experts.full_tensor().std())}


def test_fresh_experts_are_initialized_per_piece_and_checkpointed_layers_run() -> None:
    """Built on meta without weights to load, under EP 2 with the decoder layers checkpointed: every expert drawn by
    the model's init (a finite loss, each rank's experts different, the spread of the model's initializer_range),
    and the recomputed layers' all-to-alls run in backward on both ranks."""
    ranks = run_distributed(_fresh_checkpointed, 2, {"expert_parallel_size": 2})
    for rank in ranks:
        assert torch.isfinite(torch.tensor(rank["loss"]))
        assert 0.01 < rank["std"] < 0.03  # initializer_range 0.02
    assert not torch.equal(ranks[0]["experts"], ranks[1]["experts"])


def _expert_gradient(base: str, strategy: dict, precision: str) -> float:
    """The norm of the first layer's expert gradient after one backward at world size 2, in ``precision``."""
    import lightning as L

    from lightning_fsdp2 import load_pretrained
    from lightning_fsdp2.fabric import FSDP2Strategy
    from tests.models import tiny_model

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=FSDP2Strategy(**strategy), precision=precision)
    fabric.launch()
    with fabric.init_module():
        model = tiny_model("qwen3_moe")[0]
        load_pretrained(model, base)
    model = fabric.setup_module(model)
    batch = _batches(1, 2, fabric.global_rank)[0]
    fabric.backward(model(input_ids=batch, labels=batch).loss)
    return float(model.module.model.layers[0].mlp.experts.gate_up_proj.grad.full_tensor().float().norm())


@pytest.mark.parametrize("precision", ["16-true", "bf16-true"])
def test_expert_gradients_in_low_precision_are_those_of_fsdp_alone(precision: str, tmp_path) -> None:
    """In fp16 and bf16 the experts' gradients under EP 2 are FSDP alone's (within the dtype's rounding): FSDP2's
    own division of fp16 gradients, around a reduction over one rank, would halve them at EP 2; the experts' groups
    reduce in fp32 there."""
    base, _ = _pretrained("qwen3_moe", str(tmp_path), lora=False)
    ep = run_distributed(_expert_gradient, 2, base, {"expert_parallel_size": 2}, precision)
    fsdp = run_distributed(_expert_gradient, 2, base, {}, precision)
    assert ep[0] == pytest.approx(fsdp[0], rel=0.02), (ep, fsdp)


def test_fewer_experts_than_ranks_sharing_them_are_split_by_rows_and_match_one_process(tmp_path) -> None:
    """2 experts per layer at world size 4 as EP 2 x FSDP 2: one expert per rank of a group, shared by 2 ranks, is
    split along its rows (no rank holding padding only); fully trained, the weights of one process (<= 1e-4)."""
    base, _ = _pretrained("qwen3_moe_2", str(tmp_path), lora=False)
    want = _fabric_reference("qwen3_moe_2", base, None, steps=3)
    for rank in run_distributed(_fabric_tp_result, 4, "qwen3_moe_2", base, None, 3, {"expert_parallel_size": 2}):
        experts = {n: v for n, v in rank["placements"].items() if ".mlp.experts." in n}
        for name, (names, split, local) in experts.items():
            assert split[names.index("expert_shard")] == "Shard(dim=1)" and local[0] == 1, (name, names, split, local)
        _assert_matches(rank, want, "2 experts at EP 2 x FSDP 2")


COEF = 0.5  # the balancing loss weighted enough that computing it per rank leaves weights far from one process's


def _with_balancing_loss(arch: str, base: str, strategy: dict, coef: float | None = None) -> dict:
    """3 SGD steps with momentum, every weight trained, the router's load-balancing loss in the loss
    (`output_router_logits`), weighted `coef` (None: the config's)."""
    fabric, model = _fabric_model(arch, base, None, strategy)
    if coef is not None:
        model.module.router_aux_loss_coef = coef
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    split = fabric.strategy.distributed_sampler_kwargs
    losses, aux = [], []
    for batch in _batches(3, split["num_replicas"], split["rank"]):
        out = model(input_ids=batch, labels=batch, output_router_logits=True)
        losses.append(float(out.loss.detach()))
        aux.append(float(out.aux_loss.detach()))
        fabric.backward(out.loss)
        optimizer.step()
        optimizer.zero_grad()
    return {"state": full_state(model), "losses": losses, "aux": aux}


def test_the_balancing_loss_under_expert_parallelism_is_fsdp_alones(tmp_path) -> None:
    """With the router's load-balancing loss on, each data-parallel rank computes it over its own batch, so a
    data-parallel run differs from one process by design; expert parallelism keeps exactly that: EP 2 equals FSDP
    alone at world size 2 (<= 1e-4), the balancing loss reported alike."""
    base, _ = _pretrained("qwen3_moe", str(tmp_path), lora=False)
    ep = run_distributed(_with_balancing_loss, 2, "qwen3_moe", base, {"expert_parallel_size": 2})
    fsdp = run_distributed(_with_balancing_loss, 2, "qwen3_moe", base, {})
    for mine, theirs in zip(ep, fsdp):
        assert all(a > 0 for a in mine["aux"]) and mine["aux"] == pytest.approx(theirs["aux"], abs=1e-5)
        _assert_matches(mine, theirs, "balancing loss: EP 2 against FSDP alone")


def _global_batch_reference(base: str) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base)
    model.router_aux_loss_coef = COEF
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses, aux = [], []
    for batch in _batches(3, 1, 0):
        out = model(input_ids=batch, labels=batch, output_router_logits=True)
        losses.append(float(out.loss.detach()))
        aux.append(float(out.aux_loss.detach()))
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "losses": losses, "aux": aux}


@pytest.mark.parametrize(("arch", "world", "strategy"), [
    ("qwen3_moe", 2, {"expert_parallel_size": 2}),
    ("qwen3_moe", 2, {}),  # FSDP alone: the option is data parallelism's, not expert parallelism's
    ("mixtral", 2, {"expert_parallel_size": 2}),
    pytest.param("qwen3_moe", 4, {"device_mesh": {"replicate": 2, "expert": 2}}, marks=pytest.mark.slow),
], ids=["qwen3_moe-ep2", "qwen3_moe-fsdp2", "mixtral-ep2", "qwen3_moe-hsdp2-ep2"])
def test_the_global_batch_balancing_loss_trains_as_one_process(arch: str, world: int, strategy: dict,
                                                               tmp_path) -> None:
    """router_aux_loss="global_batch": the experts' token counts summed over every data-parallel rank (across
    replicas too), each rank's loss holding its share: 3 steps with the balancing loss weighted 0.5 give one process's
    weights (<= 1e-4), the ranks' mean loss and mean aux_loss are one process's. The default ("per_rank") leaves the
    weights visibly apart (> 1e-3): a strategy that ignored the option fails."""
    base, _ = _pretrained(arch, str(tmp_path), lora=False)
    want = _global_batch_reference(base)
    ranks = run_distributed(_with_balancing_loss, world, arch, base, {**strategy, "router_aux_loss": "global_batch"},
                            COEF)
    for rank in ranks:
        _assert_matches(rank, want, f"{arch} {strategy} global-batch balancing loss")
    for key in ("losses", "aux"):
        mean = [sum(r[key][i] for r in ranks) / world for i in range(3)]
        assert mean == pytest.approx(want[key], abs=1e-5), key
    if world == 2 and not strategy:
        per_rank = run_distributed(_with_balancing_loss, 2, arch, base, strategy, COEF)[0]
        worst = max((per_rank["state"][k] - want["state"][k]).abs().max().item() for k in want["state"])
        assert worst > 1e-3, worst


def _shares(arch: str) -> dict:
    """Each rank's global-batch share, over its own half of a padded batch, and transformers' loss over its half."""
    import torch.distributed as dist

    from lightning_fsdp2.router_loss import global_batch_share

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    logits = tuple(torch.randn(2, 6, EXPERTS) for _ in range(3))  # 3 layers, 6 tokens per rank (2 sequences of 3)
    mask = torch.ones(4, 3)
    mask[1, 2:] = mask[3, 1:] = 0  # padding at the end of some sequences
    mine = tuple(layer[rank].reshape(-1, EXPERTS).requires_grad_() for layer in logits)
    share = global_batch_share(mine, EXPERTS, 2, mask[2 * rank:2 * rank + 2], dist.group.WORLD, 2)
    share.backward()
    # Under `*-true` precision the default dtype is bf16 around forwards: without a mask the counts stay exact fp32.
    torch.set_default_dtype(torch.bfloat16)
    try:
        unmasked = global_batch_share(tuple(t.detach() for t in mine), EXPERTS, 2, None, dist.group.WORLD, 2)
    finally:
        torch.set_default_dtype(torch.float32)
    plain = global_batch_share(tuple(t.detach() for t in mine), EXPERTS, 2, None, dist.group.WORLD, 2)
    return {"share": float(share), "grads": [t.grad for t in mine], "unmasked": (float(unmasked), float(plain))}


def test_the_global_batch_share_is_transformers_loss_over_the_whole_padded_batch() -> None:
    """The two ranks' shares average to transformers' own load_balancing_loss_func over both ranks' tokens, padding
    left out by the attention mask, and so do their gradients (each rank's share counted once, as data parallelism
    averages)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    ranks = run_distributed(_shares, 2, "qwen3_moe")
    torch.manual_seed(0)
    logits = tuple(torch.randn(2, 6, EXPERTS) for _ in range(3))
    mask = torch.ones(4, 3)
    mask[1, 2:] = mask[3, 1:] = 0
    whole = tuple(layer.reshape(-1, EXPERTS).requires_grad_() for layer in logits)
    want = load_balancing_loss_func(whole, EXPERTS, 2, mask)
    want.backward()
    assert sum(r["share"] for r in ranks) / 2 == pytest.approx(float(want), abs=1e-6)
    assert all(r["unmasked"][0] == r["unmasked"][1] for r in ranks), ranks  # bf16 default dtype: same fp32 share
    for layer, grad in enumerate(t.grad for t in whole):
        got = torch.cat([r["grads"][layer] for r in ranks]) / 2
        torch.testing.assert_close(got, grad, atol=1e-6, rtol=0)


def test_the_converter_turns_an_expert_parallel_sharded_checkpoint_into_the_full_one(tmp_path) -> None:
    """`sharded_to_full` of an EP 2 sharded checkpoint (each rank's experts on the expert mesh, DCP) gives the
    weights and optimizer state of the full file the same run writes, every expert whole."""
    from lightning_fsdp2.convert import read_full_checkpoint, sharded_to_full

    base, _ = _pretrained("qwen3_moe", str(tmp_path), lora=False)
    for fmt, name in (("sharded", "ckpt"), ("full", "ckpt.pt")):
        run_distributed(_resumable, 2, base, {"expert_parallel_size": 2, "state_dict_type": fmt}, 2, 2,
                        str(tmp_path / name))
    converted = read_full_checkpoint(sharded_to_full(tmp_path / "ckpt", tmp_path / "converted.ckpt"))
    full = read_full_checkpoint(tmp_path / "ckpt.pt")
    assert converted["model"].keys() == full["model"].keys()
    experts = [k for k in full["model"] if ".mlp.experts." in k]
    assert experts and all(full["model"][k].shape[0] == EXPERTS for k in experts)
    for key, value in full["model"].items():
        assert torch.equal(converted["model"][key], value), key
    # The full file keys the optimizer's state by index (torch's own), the converted one by parameter name (DCP's):
    # the param groups list both in the same order.
    names = converted["optimizer"]["param_groups"][0]["params"]
    assert full["optimizer"]["param_groups"][0]["params"] == list(range(len(names)))
    moments = full["optimizer"]["state"]
    assert len(moments) == len(names) == len(converted["optimizer"]["state"])
    for index, name in enumerate(names):
        for what, value in converted["optimizer"]["state"][name].items():
            assert torch.equal(value, moments[index][what]), (name, what)


def _compiled_result(*args) -> dict:
    from torch._dynamo.utils import counters

    result = _fabric_tp_result(*args)
    return {**result, "graphs": counters["stats"]["unique_graphs"], "inductor": sum(counters["inductor"].values())}


@pytest.mark.slow
def test_compiled_blocks_under_expert_parallelism_match_one_process(tmp_path) -> None:
    """compile=True at EP 2 (each decoder block compiled after the experts were divided: dynamo traces the token
    exchange's all-to-alls): every weight of one eager process after 3 steps (<= 1e-4)."""
    base, _ = _pretrained("qwen3_moe", str(tmp_path), lora=False)
    want = _fabric_reference("qwen3_moe", base, None, steps=3)
    strategy = {"expert_parallel_size": 2, "compile": True}
    for rank in run_distributed(_compiled_result, 2, "qwen3_moe", base, None, 3, strategy, timeout=900):
        assert rank["graphs"] >= 1 and rank["inductor"] > 0, rank  # compiled, by inductor
        _check_experts_divided(rank["placements"], expert=2, shard=1)
        _assert_matches(rank, want, "compiled blocks at EP 2")


@pytest.mark.slow
def test_an_hsdp_by_expert_checkpoint_resumes_at_expert_parallelism_alone_and_in_one_process(tmp_path) -> None:
    """Saved sharded at world size 4 as HSDP x EP (`{"replicate": 2, "expert": 2}`) after 2 of 4 steps, resumed by
    EP 2 at world size 2 and by one process: each equal to 4 steps of one process (<= 1e-4)."""
    base, _ = _pretrained("qwen3_moe", str(tmp_path), lora=False)
    want = _fabric_reference("qwen3_moe", base, None, steps=4)
    saved = str(tmp_path / "hsdp-ep")
    run_distributed(_resumable, 4, base, {"device_mesh": {"replicate": 2, "expert": 2}, "state_dict_type": "sharded"},
                    4, 2, saved)
    for world, strategy in ((2, {"expert_parallel_size": 2}), (1, {})):
        for rank in run_distributed(_resumable, world, base, strategy, 4, None, None, saved):
            assert rank["step"] == 4
            _assert_matches(rank, want, f"HSDP x EP checkpoint resumed at world size {world} with {strategy}")


def test_the_global_batch_loss_is_offered_for_models_balanced_by_transformers_switch_loss_only() -> None:
    """Which models' balancing loss router_aux_loss="global_batch" can replace: those whose modeling module holds
    transformers' Switch-Transformer `load_balancing_loss_func` (compared by code: Qwen3-MoE, Mixtral, Qwen2-MoE,
    gpt-oss), not Doge's (product-key routing: refused by name)."""
    import transformers as tf

    from lightning_fsdp2.router_loss import computes_switch_loss
    from tests.models import tiny_model

    with torch.device("meta"):
        for arch in ("qwen3_moe", "mixtral", "qwen2_moe", "gpt_oss"):
            assert computes_switch_loss(tiny_model(arch)[0]), arch
        doge = tf.DogeForCausalLM(tf.DogeConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    assert not computes_switch_loss(doge)
