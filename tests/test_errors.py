"""Errors raised in one process (and a few at world size 2 that belong to no other module), each with the message
docs/troubleshooting.md quotes (test_docs checks that every entry there names the test that triggers it). The other
ones that need several processes are in the other test files."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from lightning_fsdp2 import CheckpointFileError, FSDP2Precision, FSDP2Strategy, load_pretrained
from lightning_fsdp2.lora import AdapterExport, find_peft_model, load_adapter
from tests.models import build_llama, tiny_llama_config


def test_strategy_and_plugin_arguments_are_checked_when_constructed() -> None:
    with pytest.raises(ValueError, match="start_method must be 'popen', 'spawn', 'fork' or 'forkserver', got 'thread'"):
        FSDP2Strategy(start_method="thread")
    with pytest.raises(ValueError, match=r"FSDP2Strategy\(state_dict_type='gathered'\): 'full' \(one file, written by rank 0\) or 'sharded'"):
        FSDP2Strategy(state_dict_type="gathered")
    with pytest.raises(ValueError, match="writes sharded checkpoints in the background"):
        FSDP2Strategy(async_save=True, state_dict_type="full")
    with pytest.raises(ValueError, match="A gradient scaler is only used with precision='16-mixed', not 'bf16-mixed'"):
        FSDP2Precision("bf16-mixed", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(RuntimeError, match="The device mesh exists only after the processes have been set up"):
        FSDP2Strategy().device_mesh  # noqa: B018 - the property raises


def test_a_policy_that_is_neither_classes_nor_a_callable_is_named() -> None:
    from lightning_fsdp2.wrap import resolve_policy

    with pytest.raises(TypeError, match=r"A module policy must be a set of nn.Module classes or a callable .* got 'blocks'"):
        resolve_policy("blocks", torch.nn.Linear(2, 2))


def test_lora_helpers_name_what_is_missing(tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model

    with pytest.raises(ValueError, match="every_n_train_steps must be a positive integer or None, got 0"):
        AdapterExport(tmp_path, every_n_train_steps=0)
    with pytest.raises(ValueError, match="Linear holds no peft model"):
        find_peft_model(torch.nn.Linear(2, 2))
    saved = build_llama(lora=True)
    saved.save_pretrained(tmp_path / "adapter")
    from transformers import LlamaForCausalLM

    with pytest.raises(CheckpointFileError, match="LlamaForCausalLM has no peft adapters to load saved adapters into"):
        load_adapter(LlamaForCausalLM(tiny_llama_config()), tmp_path / "adapter")
    other = get_peft_model(LlamaForCausalLM(tiny_llama_config()), LoraConfig(r=4, lora_alpha=8, target_modules=["k_proj"]))
    with pytest.raises(CheckpointFileError, match="Cannot load saved adapters into PeftModel.*not in the source"):
        load_adapter(other, tmp_path / "adapter")


def test_an_adapter_saved_with_another_alpha_is_refused_unless_asked(tmp_path: Path) -> None:
    """The saved configuration is the right one (peft's from_pretrained uses it; the weights were trained under its
    scaling): a model whose adapter has another lora_alpha or rslora is refused, naming both values; built from the
    saved config it loads, and check_config=False loads the same tensors into the model's own configuration."""
    from peft import LoraConfig, PeftConfig, get_peft_model
    from transformers import LlamaForCausalLM

    base_state = {k: v.clone() for k, v in LlamaForCausalLM(tiny_llama_config()).state_dict().items()}

    def model(**config):
        base = LlamaForCausalLM(tiny_llama_config())
        base.load_state_dict(base_state)
        return get_peft_model(base, LoraConfig(**{"r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
                                                  "target_modules": ["q_proj", "v_proj"], **config}))

    saved = model()
    with torch.no_grad():
        for name, param in saved.named_parameters():
            if "lora_B" in name:
                param.normal_()  # a trained adapter: B is no longer zero, so the scaling shows in the outputs
    saved.save_pretrained(tmp_path / "adapter")

    for config, said in (({"lora_alpha": 32}, "lora_alpha=8 saved, 32 in the model"),
                         ({"use_rslora": True}, "use_rslora=False saved, True in the model")):
        other = model(**config)
        with pytest.raises(CheckpointFileError, match=rf"saved with another configuration than the model's adapter"
                           rf" 'default': {said}.*PeftConfig.from_pretrained"):
            load_adapter(other, tmp_path / "adapter")
        with pytest.raises(CheckpointFileError, match=said):  # the file alone: its directory's config
            load_adapter(other, tmp_path / "adapter" / "adapter_model.safetensors")
    inputs = torch.randint(0, tiny_llama_config().vocab_size, (1, 8))
    base = LlamaForCausalLM(tiny_llama_config())
    base.load_state_dict(base_state)
    right = get_peft_model(base, PeftConfig.from_pretrained(tmp_path / "adapter"))
    load_adapter(right, tmp_path / "adapter")
    expected = saved(input_ids=inputs).logits
    assert torch.allclose(right(input_ids=inputs).logits, expected)
    anyway = model(lora_alpha=32)
    load_adapter(anyway, tmp_path / "adapter", check_config=False)  # asked for: the model's scaling, 4x the saved
    assert not torch.allclose(anyway(input_ids=inputs).logits, expected, atol=1e-3)


def test_a_run_from_a_saved_adapter_config_has_nothing_to_train(tmp_path: Path) -> None:
    """peft's saved config is in inference mode: the adapters come back frozen, and an optimizer over the trainable
    parameters is empty (troubleshooting's fix: `config.inference_mode = False`)."""
    from peft import PeftConfig, get_peft_model
    from transformers import LlamaForCausalLM

    build_llama(lora=True).save_pretrained(tmp_path / "adapter")
    config = PeftConfig.from_pretrained(tmp_path / "adapter")
    model = get_peft_model(LlamaForCausalLM(tiny_llama_config()), config)
    with pytest.raises(ValueError, match="optimizer got an empty parameter list"):
        torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    config.inference_mode = False
    model = get_peft_model(LlamaForCausalLM(tiny_llama_config()), config)
    assert any(p.requires_grad for p in model.parameters())


def test_a_truncated_file_is_named_as_such(tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(tiny_llama_config())
    torch.save(model.state_dict(), tmp_path / "weights.bin")
    data = (tmp_path / "weights.bin").read_bytes()
    (tmp_path / "weights.bin").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointFileError, match=r"Could not read .*weights\.bin.*The file may be truncated or corrupt"):
        load_pretrained(model, tmp_path / "weights.bin")


def test_optimizer_state_that_does_not_fit_is_named() -> None:
    from lightning_fsdp2.checkpoint.formats import load_optimizers, optimizer_state_by_name

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    state = optimizer.state_dict()
    with pytest.raises(CheckpointFileError, match=r"holds state for 1 optimizer\(s\), but `configure_optimizers` returned 2"):
        load_optimizers(model, [optimizer, torch.optim.SGD(model.parameters())], {"optimizer_states": [state]})
    two_groups = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[1].parameters()}])
    with pytest.raises(CheckpointFileError, match=r"parameter groups of sizes \[4\], but the optimizer's are \[2, 2\]"):
        optimizer_state_by_name(state, two_groups, model)
    wrong = copy.deepcopy(state)
    wrong["state"][0]["exp_avg"] = torch.zeros(5)
    with pytest.raises(CheckpointFileError, match=r"The optimizer state 'exp_avg' of '0.weight' is \(5,\) in the checkpoint"
                       r" but \(3, 4\) in the optimizer"):
        load_optimizers(model, [optimizer], {"optimizer_states": [wrong]})


def test_flags_are_bools_and_reshard_sizes_that_cannot_apply_say_so() -> None:
    from lightning_fsdp2.layout import Layout
    from lightning_fsdp2.options import StrategyOptions

    with pytest.raises(TypeError, match=r"reshard_last_block='no'\): pass True or False"):
        FSDP2Strategy(reshard_last_block="no")
    with pytest.raises(TypeError, match=r"offload_activations=1\): pass True or False"):
        FSDP2Strategy(offload_activations=1)
    options = StrategyOptions.from_arguments(reshard_after_forward=3)
    with pytest.raises(ValueError, match="2 ranks have none"):  # no int applies at all
        options.check_layout(Layout.resolve(None, 2, 2, "cpu"))
    with pytest.raises(ValueError, match="a divisor of 4 other than 1 and 4"):
        options.check_layout(Layout.resolve(None, 4, 4, "cpu"))


def test_an_option_that_cannot_be_pickled_is_refused_when_the_start_method_pickles() -> None:
    policy = {torch.nn.Linear}
    with pytest.raises(ValueError, match="cannot be pickled .* Pass activation_checkpointing_save=\"matmuls\""):
        FSDP2Strategy(activation_checkpointing_policy=policy, activation_checkpointing_save={torch.ops.aten.mm.default},
                      start_method="spawn")
    FSDP2Strategy(activation_checkpointing_policy=policy, activation_checkpointing_save="matmuls", start_method="spawn")
    FSDP2Strategy(activation_checkpointing_policy=policy, activation_checkpointing_save={torch.ops.aten.mm.default})


def _fit_from_saved_adapter_config(adapter: str) -> str:
    import lightning as L
    from peft import PeftConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from tests.models import LlamaModule, quiet_trainer_kwargs

    class FromSaved(LlamaModule):
        def configure_model(self) -> None:
            if self.model is None:
                self.model = get_peft_model(LlamaForCausalLM(tiny_llama_config()), PeftConfig.from_pretrained(adapter))

    try:
        L.Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy(), max_steps=1,
                  **quiet_trainer_kwargs()).fit(FromSaved())
    except ValueError as err:
        return str(err)
    return "trained"


def test_a_run_from_a_saved_adapter_config_is_refused_at_set_up(tmp_path: Path) -> None:
    from tests.helpers import run_distributed

    build_llama(lora=True).save_pretrained(tmp_path / "adapter")
    for message in run_distributed(_fit_from_saved_adapter_config, 2, str(tmp_path / "adapter")):
        assert "were made with inference_mode=True" in message and "config.inference_mode = False" in message, message


def test_each_front_ends_strategy_given_to_the_other_names_the_right_class() -> None:
    import lightning as L

    from lightning_fsdp2 import fabric

    with pytest.raises(ValueError, match=r"for Lightning Fabric use lightning_fsdp2\.fabric\.FSDP2Strategy"):
        L.Fabric(accelerator="cpu", devices=1, strategy=FSDP2Strategy())
    with pytest.raises(ValueError, match=r"for the Trainer use lightning_fsdp2\.FSDP2Strategy"):
        L.Trainer(accelerator="cpu", devices=1, strategy=fabric.FSDP2Strategy())


# --------------------------------------------------------------------------- a model sharded before set-up
def _sharded_elsewhere(path: str, case: str) -> str:
    """A model sharded before FSDP2Strategy sets it up, through the Trainer (in configure_model) or Fabric."""
    import lightning as L
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    from lightning_fsdp2.fabric import FSDP2Strategy as FabricFSDP2Strategy
    from tests.models import LlamaModule, quiet_trainer_kwargs

    def by_transformers() -> LlamaForCausalLM:
        return LlamaForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(fsdp_size=2))

    class Presharded(LlamaModule):
        def configure_model(self) -> None:
            if self.model is not None:
                return
            if case == "by-hand":  # ModelParallelStrategy's configure_model, left as it was
                model = LlamaForCausalLM(tiny_llama_config())
                for layer in model.model.layers:
                    fully_shard(layer)
                self.model = fully_shard(model)
            else:
                self.model = by_transformers()

    try:
        if case == "fabric":
            fabric = L.Fabric(accelerator="cpu", devices=2, strategy=FabricFSDP2Strategy())
            fabric.launch()
            fabric.setup_module(by_transformers())
        elif case == "fabric-twice":  # the same strategy sets up the same module again: returned as it is
            fabric = L.Fabric(accelerator="cpu", devices=2, strategy=FabricFSDP2Strategy())
            fabric.launch()
            with fabric.init_module():
                model = LlamaForCausalLM(tiny_llama_config())
            first = fabric.setup_module(model)
            again = fabric.strategy.setup_module(first.module)
            return "set up once" if again is first.module else "set up twice"
        elif case == "earlier-run":  # a module one Trainer set up, given to a new Trainer
            module = LlamaModule(lora=False)
            L.Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy(), max_steps=1,
                      **quiet_trainer_kwargs()).fit(module)
            L.Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy(), max_steps=2,
                      **quiet_trainer_kwargs()).fit(module)
        else:
            strategy = FSDP2Strategy(meta_init=case != "transformers-real")
            L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=1,
                      **quiet_trainer_kwargs()).fit(Presharded(lora=False))
    except RuntimeError as err:
        return str(err)
    return "trained"


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("transformers-meta", "from_pretrained(..., distributed_config=... / tp_plan=...) was called in"
                              " `configure_model`"),
        ("transformers-real", "LlamaForCausalLM was sharded by transformers (`from_pretrained(..., distributed_config="),
        ("fabric", "LlamaForCausalLM was sharded by transformers (`from_pretrained(..., distributed_config="),
        ("by-hand", "Modules ['model', 'model.model.layers.0', 'model.model.layers.1'] were passed to fully_shard"
                    " before FSDP2Strategy set the model up"),
        ("earlier-run", "trained"),  # taken as it is (tests/test_strategy.py::test_a_second_trainer_takes_...)
        ("fabric-twice", "set up once"),
    ],
)
def test_a_model_sharded_before_set_up_is_refused_on_every_rank(case: str, expected: str, tmp_path: Path) -> None:
    """transformers' own FSDP2 (`from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=2))`) inside
    configure_model (meta init, or meta_init=False) or handed to Fabric's setup_module, and fully_shard calls left in
    configure_model: refused on every rank before anything else, saying what to build instead (before: torch's
    `c10d.broadcast_.default does not have a sharding strategy registered`). A module one Trainer set up, given to a
    new one, trains; the same Fabric strategy given its own set-up module again returns it as it is."""
    from tests.helpers import run_distributed
    from tests.models import save_tiny_pretrained

    path = str(save_tiny_pretrained(tmp_path / "tiny"))
    for message in run_distributed(_sharded_elsewhere, 2, path, case):
        assert expected in message, message
        taken = case in ("fabric-twice", "earlier-run")
        assert "load_pretrained" in message or "delete those calls" in message or taken, message
