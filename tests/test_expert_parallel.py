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


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_qwen3_moe_under_expert_parallelism_matches_one_process(lora: bool, tmp_path) -> None:
    """Fabric at world size 2 as one expert group of 2 (each rank 2 of the 4 experts of every layer): loaded by
    load_pretrained (each rank its experts' slices), LoRA on attention with the experts frozen or every weight
    trained, 3 SGD steps with momentum: the weights and losses of one process (<= 1e-4)."""
    base, adapter = _pretrained("qwen3_moe", str(tmp_path), lora=lora)
    want = _fabric_reference("qwen3_moe", base, adapter, steps=3)
    ranks = run_distributed(_fabric_tp_result, 2, "qwen3_moe", base, adapter, 3, {"expert_parallel_size": 2})
    for rank in ranks:
        _check_experts_divided(rank["placements"], expert=2, shard=1)
        _assert_matches(rank, want, f"qwen3_moe lora={lora}")
    # Each rank's loss is its own half of the batch's (as many tokens each): their mean is one process's.
    assert [sum(r["losses"][i] for r in ranks) / len(ranks) for i in range(3)] == pytest.approx(want["losses"], abs=1e-4)


@pytest.mark.parametrize(("strategy", "expert", "shard"), [
    ({"expert_parallel_size": 2}, 2, 2),  # two expert groups of 2; each expert sharded over the 2 ranks holding it
    ({"expert_parallel_size": 4}, 4, 1),  # one group of 4: one expert per rank
    ({"device_mesh": {"replicate": 2, "expert": 2}}, 2, 1),  # HSDP: replicas of 2 ranks, one expert group each
], ids=["ep2-fsdp2", "ep4", "hsdp2-ep2"])
def test_expert_parallelism_at_world_size_4_matches_one_process(strategy: dict, expert: int, shard: int,
                                                                 tmp_path) -> None:
    """Every weight trained at world size 4 in each layout expert parallelism composes with: the weights and the
    mean loss of one process (<= 1e-4), each rank holding its share of the experts."""
    base, _ = _pretrained("qwen3_moe", str(tmp_path), lora=False)
    want = _fabric_reference("qwen3_moe", base, None, steps=3)
    ranks = run_distributed(_fabric_tp_result, 4, "qwen3_moe", base, None, 3, strategy)
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
    fabric = L.Fabric(accelerator="cpu", devices=size, strategy=FSDP2Strategy(expert_parallel_size=size))
    fabric.launch()
    try:
        with fabric.init_module():
            model = tiny_model("llama" if case == "no-plan" else "qwen3_moe")[0]
            if case == "lora-on-experts":  # peft adapts the fused experts' down_proj tensors too
                model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "down_proj"]))
            if case == "qlora":
                load_pretrained(model, base, quantize="nf4")
        fabric.setup_module(model)
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize(("case", "message"), [
    ("no-plan", "LlamaForCausalLM has no expert-parallel plan"),
    ("uneven", "has 4 experts per MoE layer, and each rank of an expert group holds an equal share of them. Choose"
               " an expert_parallel_size among [2, 4]"),
    ("lora-on-experts", "peft adapters on the experts (['model.layers.0.mlp.experts'"),
    ("qlora", "(QLoRA) does not run with expert parallelism"),
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
    with pytest.raises(ValueError, match="expert and tensor parallelism together do not run yet"):
        resolve(None, expert=2, tensor=2)
    with pytest.raises(ValueError, match="give the expert-parallel size once"):
        FSDP2Strategy(device_mesh={"expert": 2}, expert_parallel_size=4)
    with pytest.raises(ValueError, match="expert parallelism carves its groups out of the layout's shard dimension"):
        FSDP2Strategy(device_mesh="auto", expert_parallel_size=2)
    with pytest.raises(TypeError, match=r"expert_parallel_size='2'\): a positive int"):
        FSDP2Strategy(expert_parallel_size="2")
    with pytest.raises(ValueError, match=r"expert_parallel_size=0\): a positive int"):
        FSDP2Strategy(expert_parallel_size=0)
