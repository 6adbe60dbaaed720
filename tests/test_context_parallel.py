"""Context parallelism composed with FSDP2: `FSDP2Strategy(context_parallel_size=N)` splits every sequence's tokens
over groups of N ranks that read the same batch, attention seeing whole sequences for 1/N of the heads (an all-to-all
around the model's own attention function). Compared with one process built without this package (fp32, SGD with
momentum, several steps), with the decoder layers' inputs and the all-to-alls counted on every rank (so a strategy
that ignored the context dimension, every rank computing whole sequences, fails)."""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from tests.helpers import run_distributed
from tests.models import full_state
from tests.test_tensor_parallel import _assert_matches, _pretrained

SEQ = 24  # tokens per sequence: divisible by 2 and 4, and 8 sequences per step
STEPS = 3


def _batch(step: int, length: int = SEQ, batch: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + step)
    ids = torch.randint(0, 128, (batch, length), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _padded(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Right- and left-padded rows with a mask, and ignored labels on some positions."""
    ids, labels = batch["input_ids"].clone(), batch["labels"].clone()
    mask = torch.ones_like(ids)
    mask[0, -5:] = 0
    mask[1, :3] = 0
    labels[mask == 0] = -100
    labels[2, 4:9] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _packed(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Documents packed into each row: restarting position ids and the block-diagonal causal mask (4-D, bool)."""
    ids, labels = batch["input_ids"], batch["labels"].clone()
    b, n = ids.shape
    starts = [[0, 7, 15], [0, 11], [0, 3, 9, 20], [0]]
    positions = torch.zeros_like(ids)
    mask = torch.zeros(b, 1, n, n, dtype=torch.bool)
    for row, first in enumerate(starts):
        bounds = first + [n]
        for s, e in zip(bounds[:-1], bounds[1:]):
            positions[row, s:e] = torch.arange(e - s)
            mask[row, 0, s:e, s:e] = torch.ones(e - s, e - s, dtype=torch.bool).tril()
            labels[row, s] = -100  # a document's first token is predicted by no token of its own
    return {"input_ids": ids, "labels": labels, "position_ids": positions, "attention_mask": mask}


SHAPES = {"plain": lambda b: b, "padded": _padded, "packed": _packed}


class _Count:
    """Counts the decoder layers' input lengths and the all-to-alls of this process."""

    def __init__(self) -> None:
        self.lengths: list[int] = []
        self.exchanges = 0

    def attach(self, model: torch.nn.Module) -> None:
        from lightning_fsdp2 import context_parallel

        def record(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            self.lengths.append(hidden.shape[1])

        from transformers import PreTrainedModel

        inner = next(m for m in model.modules() if isinstance(m, PreTrainedModel))
        for layer in context_parallel._layers(inner):
            layer.register_forward_hook(lambda m, a, k, o: record(m, (o if isinstance(o, torch.Tensor) else o[0],), {}),
                                        with_kwargs=True)
        original = context_parallel._all_to_all

        def counted(x, group):
            self.exchanges += 1
            return original(x, group)

        context_parallel._all_to_all = counted


def _train(model, steps: int, shape: str, length: int, fabric=None, split: dict | None = None) -> list[float]:
    """SGD with momentum on each step's batch (this data-parallel rank's rows of it, ``split``)."""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
    if fabric is not None:
        optimizer = fabric.setup_optimizers(optimizer)
    replicas, rank = (split["num_replicas"], split["rank"]) if split else (1, 0)
    losses = []
    for step in range(steps):
        batch = SHAPES[shape](_batch(step, length))
        per = len(batch["input_ids"]) // replicas
        loss = model(**{k: v[rank * per:(rank + 1) * per] for k, v in batch.items()}).loss
        fabric.backward(loss) if fabric is not None else loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _reference(arch: str, base: str, adapter: str | None, shape: str, length: int) -> dict:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, attn_implementation="sdpa")
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter, is_trainable=True)
    losses = _train(model, STEPS, shape, length)
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "losses": losses}


def _fabric_cp(arch: str, base: str, adapter: str | None, shape: str, length: int, strategy: dict,
               precision: str = "32-true", attention: str = "sdpa") -> dict:
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_fsdp2 import load_pretrained
    from lightning_fsdp2.fabric import FSDP2Strategy as FabricStrategy
    from lightning_fsdp2.lora import load_adapter
    from tests.test_tensor_parallel import _lora

    fabric = L.Fabric(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=FabricStrategy(**strategy),
                      precision=precision)
    fabric.launch()
    with fabric.init_module():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base), attn_implementation=attention)
        load_pretrained(model, base)
        if adapter is not None:
            model = get_peft_model(model, _lora(arch))
            load_adapter(model, adapter)
    model = fabric.setup_module(model)
    count = _Count()
    count.attach(model)
    split = fabric.strategy.distributed_sampler_kwargs
    losses = _train(model, STEPS, shape, length, fabric, split)
    return {"state": full_state(model), "losses": losses, "lengths": count.lengths, "exchanges": count.exchanges,
            "split": split}


def _check_split(rank: dict, context: int, length: int, layers: int = 2, passes: int = 1) -> None:
    """Every decoder layer of every forward held 1/context of the (padded) sequence, and attention exchanged heads
    for tokens around each attention call (``passes`` per layer and step: 2 when recomputed in backward): q, k, v
    and the output, 4 all-to-alls."""
    chunk = -(-length // context)
    assert rank["lengths"] == [chunk] * (layers * STEPS), rank["lengths"]
    if passes:
        assert rank["exchanges"] == 4 * layers * STEPS * passes, rank["exchanges"]


@pytest.mark.parametrize(("arch", "lora"), [(a, lora) for a in ("llama", "qwen3", "mistral") for lora in (True, False)]
                         + [("mistral_window", True)],  # a sliding window shorter than the sequence
                         ids=lambda v: v if isinstance(v, str) else ("lora" if v else "full"))
def test_context_parallel_2_matches_one_process(arch: str, lora: bool, tmp_path) -> None:
    base, adapter = _pretrained(arch, str(tmp_path), lora)
    want = _reference(arch, base, adapter, "plain", SEQ)
    ranks = run_distributed(_fabric_cp, 2, arch, base, adapter, "plain", SEQ, {"context_parallel_size": 2})
    for rank in ranks:
        _assert_matches(rank, want, f"{arch} context 2")
        assert rank["losses"] == pytest.approx(want["losses"], abs=1e-5)
        assert rank["split"] == {"num_replicas": 1, "rank": 0}  # the group reads one batch
        _check_split(rank, 2, SEQ)


@pytest.mark.parametrize("shape", ["padded", "packed"])
@pytest.mark.parametrize("length", [SEQ, SEQ - 1], ids=["even", "uneven"])
def test_padded_and_packed_batches_under_context_parallelism_match_one_process(shape: str, length: int,
                                                                                tmp_path) -> None:
    base, adapter = _pretrained("llama", str(tmp_path), True)
    want = _reference("llama", base, adapter, shape, length)
    ranks = run_distributed(_fabric_cp, 2, "llama", base, adapter, shape, length, {"context_parallel_size": 2})
    for rank in ranks:
        _assert_matches(rank, want, f"{shape} {length}")
        assert rank["losses"] == pytest.approx(want["losses"], abs=1e-5)
        _check_split(rank, 2, length)


MESHES = {  # world size 4
    "context2-fsdp2": {"context_parallel_size": 2},
    "context2-tensor2": {"context_parallel_size": 2, "tensor_parallel_size": 2},
    "context4": {"context_parallel_size": 4},
    "hsdp-context2": {"device_mesh": {"replicate": 2, "context": 2}},
}


@pytest.mark.slow
@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_context_parallel_at_world_size_4_matches_one_process(mesh: str, arch: str, lora: bool, tmp_path) -> None:
    base, adapter = _pretrained(arch, str(tmp_path), lora)
    want = _reference(arch, base, adapter, "plain", SEQ)
    ranks = run_distributed(_fabric_cp, 4, arch, base, adapter, "plain", SEQ, MESHES[mesh], timeout=600)
    context = MESHES[mesh].get("context_parallel_size") or MESHES[mesh]["device_mesh"]["context"]
    for rank in ranks:
        _assert_matches(rank, want, mesh)
        _check_split(rank, context, SEQ)
    assert [r["split"]["num_replicas"] for r in ranks] == [4 // context // MESHES[mesh].get("tensor_parallel_size", 1)] * 4


# =========================================================================== activation checkpointing, compile
@pytest.mark.parametrize("option", ["checkpointing", pytest.param("compile", marks=pytest.mark.slow)])
def test_checkpointed_and_compiled_layers_under_context_parallelism_match_one_process(option: str, tmp_path) -> None:
    """The decoder layers recomputed in backward (the split travels with the layer's keyword arguments, so the
    recomputation splits alike), or compiled per block: one process's weights."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    strategy: dict[str, Any] = {"context_parallel_size": 2}
    if option == "checkpointing":
        strategy["activation_checkpointing_policy"] = {LlamaDecoderLayer}
    else:
        strategy["compile"] = True
    base, adapter = _pretrained("llama", str(tmp_path), True)
    want = _reference("llama", base, adapter, "padded", SEQ - 1)
    ranks = run_distributed(_fabric_cp, 2, "llama", base, adapter, "padded", SEQ - 1, strategy)
    for rank in ranks:
        _assert_matches(rank, want, option)
        # Compiled, the counter runs when dynamo traces the function, not at every call.
        _check_split(rank, 2, SEQ - 1, passes=2 if option == "checkpointing" else 0)


def test_mixed_precision_and_eager_attention_split_alike(tmp_path) -> None:
    """bf16-mixed (FSDP2 casts each layer's inputs, the split among them, and the eager mask to bf16) with eager
    attention on a length CP does not divide: every layer splits and exchanges, and the losses stay within bf16's
    rounding of one process's fp32 ones."""
    base, adapter = _pretrained("llama", str(tmp_path), True)
    want = _reference("llama", base, adapter, "padded", SEQ - 1)
    ranks = run_distributed(_fabric_cp, 2, "llama", base, adapter, "padded", SEQ - 1, {"context_parallel_size": 2},
                            "bf16-mixed", "eager")
    for rank in ranks:
        _check_split(rank, 2, SEQ - 1)
        assert rank["losses"] == pytest.approx(want["losses"], abs=2e-2)


# =========================================================================== the Trainer, validation, logged loss
class _Module(L.LightningModule):
    """A training_step written for one device: `self.model(input_ids=..., labels=...)` on whole batches; SGD with
    momentum; validation logs the model's loss."""

    def __init__(self, base: str) -> None:
        super().__init__()
        self.base, self.model, self.losses = base, None, []

    def configure_model(self) -> None:
        if self.model is None:
            from transformers import AutoConfig, AutoModelForCausalLM

            from lightning_fsdp2 import load_pretrained

            self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.base),
                                                          attn_implementation="sdpa")
            if self.model.model.embed_tokens.weight.is_meta:  # built on meta by the strategy
                load_pretrained(self.model, self.base)
            else:
                self.model.load_state_dict(AutoModelForCausalLM.from_pretrained(self.base).state_dict())

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.losses.append(float(loss.detach()))
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.log("val_loss", self.model(**batch).loss)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self) -> DataLoader:  # whole batches, in order (the context group's ranks read the same)
        return DataLoader([_padded(_batch(step)) for step in range(STEPS)], batch_size=None)

    def val_dataloader(self) -> DataLoader:
        return DataLoader([_packed(_batch(0, seed=1))], batch_size=None)


def _trainer_fit(base: str, strategy: dict | None) -> dict:
    from lightning_fsdp2 import FSDP2Strategy
    from tests.models import quiet_trainer_kwargs

    module = _Module(base)
    world = int(os.environ.get("WORLD_SIZE", 1))
    trainer = L.Trainer(accelerator="cpu", devices=world, max_epochs=1, num_sanity_val_steps=0,
                        strategy=FSDP2Strategy(**strategy) if strategy is not None else "auto",
                        **quiet_trainer_kwargs())
    trainer.fit(module)
    return {"state": full_state(module), "losses": module.losses,
            "val_loss": float(trainer.callback_metrics["val_loss"])}


def test_a_training_step_written_for_one_device_trains_and_validates_as_one_process(tmp_path) -> None:
    """The Trainer at CP 2: padded batches with ignored labels, then a validation step on packed documents (the model
    in eval mode, split as in training): the weights, each step's returned loss and the logged validation loss are
    one process's."""
    base, _ = _pretrained("llama", str(tmp_path), False)
    want = _trainer_fit(base, None)
    for rank in run_distributed(_trainer_fit, 2, base, {"context_parallel_size": 2}):
        _assert_matches(rank, want, "Trainer")
        assert rank["losses"] == pytest.approx(want["losses"], abs=1e-5)
        assert rank["val_loss"] == pytest.approx(want["val_loss"], abs=1e-5)


# =========================================================================== logits, generate
def _outputs(base: str, strategy: dict) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_fsdp2 import load_pretrained
    from lightning_fsdp2.fabric import FSDP2Strategy as FabricStrategy

    fabric = L.Fabric(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=FabricStrategy(**strategy))
    fabric.launch()
    with fabric.init_module():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base), attn_implementation="sdpa")
        load_pretrained(model, base)
    model = fabric.setup_module(model)
    count = _Count()
    count.attach(model)
    batch = _padded(_batch(0, SEQ - 1))
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        split = list(count.lengths)
        # A cache asked for (a decoding loop of the caller's own): unsplit, and the cache is the whole sequence's.
        cached = model(input_ids=batch["input_ids"][:, :6], use_cache=True)
        step = model(input_ids=batch["input_ids"][:, 6:7], past_key_values=cached.past_key_values).logits
        unsplit = list(count.lengths[len(split):])
        generated = model.generate(input_ids=batch["input_ids"][:, :6], max_new_tokens=5, do_sample=False)
    # Trained through the gathered logits with a loss of its own: the gradients are one process's.
    model.train()
    logits_loss = torch.nn.functional.cross_entropy(
        model(input_ids=batch["input_ids"]).logits[:, :-1].flatten(0, 1), batch["input_ids"][:, 1:].flatten())
    fabric.backward(logits_loss)
    grads = {n.removeprefix("_forward_module."): p.grad.full_tensor() for n, p in model.named_parameters()}
    return {"logits": logits, "split": split, "generated": generated, "grads": grads,
            "own_loss": float(logits_loss), "step": step, "unsplit": unsplit}


def test_logits_without_labels_and_generate_are_one_processs(tmp_path) -> None:
    """Without labels the model returns the whole sequence's logits (gathered; unpadded) in eval and in training, a
    loss of the caller's own on them trains as one process; generate() (a KV cache: each rank computes the whole
    sequence) gives one process's tokens."""
    from transformers import AutoModelForCausalLM

    base, _ = _pretrained("llama", str(tmp_path), False)
    model = AutoModelForCausalLM.from_pretrained(base, attn_implementation="sdpa")
    batch = _padded(_batch(0, SEQ - 1))
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        generated = model.generate(input_ids=batch["input_ids"][:, :6], max_new_tokens=5, do_sample=False)
        cached = model(input_ids=batch["input_ids"][:, :6], use_cache=True)
        step = model(input_ids=batch["input_ids"][:, 6:7], past_key_values=cached.past_key_values).logits
    own = torch.nn.functional.cross_entropy(
        model(input_ids=batch["input_ids"]).logits[:, :-1].flatten(0, 1), batch["input_ids"][:, 1:].flatten())
    own.backward()
    for rank in run_distributed(_outputs, 2, base, {"context_parallel_size": 2}):
        assert rank["split"] == [12, 12]  # the forward was split (SEQ - 1 = 23 tokens padded to 24)
        assert rank["logits"].shape == logits.shape
        assert (rank["logits"] - logits).abs().max() <= 1e-4
        assert torch.equal(rank["generated"], generated)
        assert rank["unsplit"] == [6, 6, 1, 1]  # whole on every rank (prompt, then one token per layer)
        assert (rank["step"] - step).abs().max() <= 1e-4
        assert rank["own_loss"] == pytest.approx(float(own), abs=1e-5)
        worst = max((rank["grads"][n] - p.grad).abs().max().item() for n, p in model.named_parameters())
        assert worst <= 1e-5, worst


# =========================================================================== checkpoints across layouts
@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_a_context_parallel_run_resumes_from_and_into_other_layouts(fmt: str, pretrained, saved: dict, straight: dict,
                                                                     tmp_path) -> None:
    """An FSDP checkpoint (world size 2) resumed at CP 2; a CP 2 checkpoint resumed by FSDP at world size 2 and by
    one process: each equal to two epochs straight (nothing new is stored)."""
    from tests.models import assert_same_run, fit_resumable

    resumed = run_distributed(fit_resumable, 2, str(pretrained), 2, None, str(saved[fmt]),
                              {"context_parallel_size": 2})[0]
    assert_same_run(resumed, straight, f"{fmt} FSDP checkpoint resumed at CP 2")
    path = tmp_path / f"{fmt}.ckpt"
    run_distributed(fit_resumable, 2, str(pretrained), 1, str(path), None,
                    {"context_parallel_size": 2, "state_dict_type": fmt})
    for world, strategy in ((2, {}), (1, {})):
        resumed = run_distributed(fit_resumable, world, str(pretrained), 2, None, str(path), strategy)[0]
        assert_same_run(resumed, straight, f"{fmt} CP 2 checkpoint resumed at world size {world}")


@pytest.mark.slow
def test_a_context_parallel_checkpoint_resumes_at_world_size_4_layouts(pretrained, straight: dict, tmp_path) -> None:
    """A sharded CP 2 checkpoint resumed at CP 2 x FSDP 2 and CP 2 x TP 2 (world size 4; the straight run's global
    batch either way), and a CP 2 x TP 2 one resumed by one process: each equal to two epochs straight."""
    from tests.models import assert_same_run, fit_resumable

    path = tmp_path / "cp2.ckpt"
    run_distributed(fit_resumable, 2, str(pretrained), 1, str(path), None,
                    {"context_parallel_size": 2, "state_dict_type": "sharded"})
    for strategy in ({"context_parallel_size": 2}, {"context_parallel_size": 2, "tensor_parallel_size": 2}):
        resumed = run_distributed(fit_resumable, 4, str(pretrained), 2, None, str(path), strategy, timeout=600)[0]
        assert_same_run(resumed, straight, f"CP 2 checkpoint resumed at world size 4 with {strategy}")
    tp_path = tmp_path / "cp2-tp2.ckpt"
    run_distributed(fit_resumable, 4, str(pretrained), 1, str(tp_path), None,
                    {"context_parallel_size": 2, "tensor_parallel_size": 2}, timeout=600)
    resumed = run_distributed(fit_resumable, 1, str(pretrained), 2, None, str(tp_path), {})[0]
    assert_same_run(resumed, straight, "CP 2 x TP 2 checkpoint resumed by one process")


# =========================================================================== refusals
def _refusal(case: str) -> str:
    """The message each rank raises for what context parallelism cannot split, at set-up (before anything is
    allocated) or at the first forward that asks for it."""
    import transformers as tf

    from lightning_fsdp2.fabric import FSDP2Strategy as FabricStrategy
    from tests.models import tiny_llama_config, tiny_model

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=FabricStrategy(context_parallel_size=2))
    fabric.launch()
    try:
        with fabric.init_module():
            if case == "not-a-causal-lm":
                model = torch.nn.Sequential(torch.nn.Linear(4, 4))
            elif case == "odd-heads":
                model = tf.LlamaForCausalLM(tiny_llama_config(hidden_size=48, num_attention_heads=3, num_key_value_heads=1,
                                                              head_dim=16))
            elif case == "hybrid":  # short convolutions between attention layers mix tokens
                model = tf.Lfm2ForCausalLM(tf.Lfm2Config(
                    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "full_attention"]))
            else:
                model = tiny_model("qwen3_moe" if case == "moe" else "llama")[0]
            if case == "flex":
                model.config._attn_implementation = "flex_attention"
        model = fabric.setup_module(model)
        tokens = torch.arange(8).view(1, 8) + (fabric.global_rank if case == "different-batches" else 0)
        model(input_ids=tokens, labels=tokens, output_hidden_states=case == "hidden-states")
    except (ValueError, RuntimeError) as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize(("case", "message"), [
    ("not-a-causal-lm", "is no Hugging Face causal LM"),
    ("odd-heads", "has 3 attention heads"),
    ("moe", "is a mixture-of-experts model"),
    ("flex", "computes attention with 'flex_attention'"),
    ("hidden-states", "these are not returned"),
    ("hybrid", "mixes tokens outside its attention function"),
    ("different-batches", "called LlamaForCausalLM with different batches"),
])
def test_what_context_parallelism_cannot_split_is_refused_by_name_on_every_rank(case: str, message: str) -> None:
    for got in run_distributed(_refusal, 2, case):
        assert message in got, got


def test_layouts_context_parallelism_cannot_take_are_refused_at_construction_or_resolution() -> None:
    from lightning_fsdp2 import FSDP2Strategy
    from lightning_fsdp2.layout import Layout

    for size, error in ((0, ValueError), ("2", TypeError)):
        with pytest.raises(error, match="context_parallel_size"):
            FSDP2Strategy(context_parallel_size=size)
    with pytest.raises(ValueError, match="give the context-parallel size once"):
        FSDP2Strategy(device_mesh={"context": 2}, context_parallel_size=4)
    with pytest.raises(ValueError, match="context parallelism adds a dimension to the layout"):
        FSDP2Strategy(device_mesh="auto", context_parallel_size=2)
    with pytest.raises(ValueError, match="do not split into groups of 3 ranks"):
        Layout.resolve(None, 4, 4, "cpu", context_parallel_size=3)
    with pytest.raises(ValueError, match="context-parallel groups of 4 ranks straddle nodes of 2 devices"):
        Layout.resolve(None, 4, 2, "cpu", context_parallel_size=4)
    with pytest.raises(ValueError, match="expert and context parallelism together"):
        Layout.resolve({"expert": 2, "context": 2}, 8, 8, "cpu")
    layout = Layout.resolve({"replicate": 2, "context": 2}, 8, 8, "cpu", tensor_parallel_size=2)
    assert (layout.names, layout.sizes) == (("replicate", "shard", "context", "tensor"), (2, 1, 2, 2))
    assert (layout.shard_size, layout.context_size, layout.data_parallel_size) == (2, 2, 2)
    assert [layout.data_parallel_rank(r) for r in range(8)] == [0] * 4 + [1] * 4  # a context group reads one batch
