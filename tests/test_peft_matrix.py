"""Every peft method on every architecture, sharded at world size 2, against peft in one process.

For each (architecture, method) cell, weights come from the model's own ``save_pretrained`` directory through
``load_pretrained`` (built on ``meta`` in ``configure_model``), then:

- fresh: ``get_peft_model`` on the sharded model gives peft's own initialization (every tensor peft does not draw at
  random equals an eager build on ``from_pretrained``'s model; random ones are drawn, at peft's scale);
- training: started from an adapter directory peft wrote (``lora.load_adapter``), three SGD steps at world size 2
  (each rank half of every batch) end with the adapters of three steps in one process (fp32, <= 1e-4);
- round trip: ``lora.save_adapter`` of the trained run, read back by ``PeftModel.from_pretrained`` in one process
  and by ``lora.load_adapter`` in a new sharded run, gives the trained adapters and outputs.

One process launch per architecture runs all of its methods (a few seconds each). The Llama row and the LoRA column run
in every ``make test``; the rest of the matrix is marked ``slow`` (``.ci/run`` runs it).
"""

from __future__ import annotations

import functools
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_fsdp2 import FSDP2Strategy, load_pretrained
from lightning_fsdp2.lora import load_adapter, save_adapter
from tests.helpers import run_distributed
from tests.models import TokenDataset, quiet_trainer_kwargs, tiny_model, training_inputs

ARCHITECTURES = ["llama", "gpt2", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "phi3", "opt", "bert", "t5", "bart",
                 "qwen3_moe", "qwen2_moe", "mixtral", "vit"]
METHODS = ["lora", "rslora", "gaussian", "all-linear", "dora", "ia3", "loha", "lokr", "vera", "adalora",
           "modules_to_save", "embedding", "prompt", "prefix"]
# Cells peft itself does not offer (the eager model fails the same way), each with peft's reason.
NOT_IN_PEFT = {
    ("gpt2", "loha"): "peft's LoHa does not adapt GPT-2's Conv1D layers",
    ("gpt2", "lokr"): "peft's LoKr does not adapt GPT-2's Conv1D layers",
    ("bert", "prefix"): "peft: BERT has no key/value cache for prefix tuning",
    ("vit", "embedding"): "ViT has no token embedding",
    ("vit", "prompt"): "peft's prompt learning needs a text task type",
    ("vit", "prefix"): "peft's prompt learning needs a text task type",
}
# Methods FSDP2Strategy initializes, loads, evaluates and exports but refuses to train (the error is tested below).
UNTRAINABLE = {"adalora"}
# Per architecture: attention layers to adapt, a feed-forward layer (IA3 scales its input), the token embedding, a
# module to train whole (modules_to_save), and peft's task type.
ATTENTION = {"gpt2": ["c_attn"], "phi3": ["qkv_proj"], "bert": ["query", "value"], "t5": ["q", "v"]}
FEED_FORWARD = {"gpt2": "mlp.c_proj", "opt": "fc2", "bart": "fc2", "bert": "output.dense", "vit": "fc2", "t5": "wo",
                # MoE experts are fused parameters, not layers: IA3 takes the attention output there
                "mixtral": "o_proj", "qwen2_moe": "o_proj", "qwen3_moe": "o_proj"}
EMBEDDING = {"gpt2": "wte", "bert": "word_embeddings", "t5": "shared", "bart": "shared"}
WHOLE = {"bert": "classifier", "vit": "classifier", "gpt2": "ln_f"}  # GPT-2's head is tied to its embedding
TASK = {"bert": "SEQ_CLS", "t5": "SEQ_2_SEQ_LM", "bart": "SEQ_2_SEQ_LM", "vit": None}
# Adapter tensors peft draws at random: compared by scale, not value.
RANDOM = {"lora_A", "lora_embedding_B", "hada_w1_a", "hada_w1_b", "hada_w2_a", "lokr_w2", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b",
          "prompt_encoder"}


def peft_config(arch: str, method: str):
    import peft

    attention = ATTENTION.get(arch, ["q_proj", "v_proj"])
    ff = FEED_FORWARD.get(arch, "down_proj")
    task = TASK.get(arch, "CAUSAL_LM")
    kw = {"task_type": task} if task else {}
    return {
        "lora": lambda: peft.LoraConfig(r=4, lora_alpha=8, target_modules=attention, **kw),
        "rslora": lambda: peft.LoraConfig(r=4, target_modules=attention, use_rslora=True, **kw),
        "gaussian": lambda: peft.LoraConfig(r=4, target_modules=attention, init_lora_weights="gaussian", **kw),
        "all-linear": lambda: peft.LoraConfig(r=4, target_modules="all-linear", **kw),
        "dora": lambda: peft.LoraConfig(r=4, target_modules=attention, use_dora=True, **kw),
        "ia3": lambda: peft.IA3Config(target_modules=[*attention, ff], feedforward_modules=[ff], **kw),
        "loha": lambda: peft.LoHaConfig(r=4, target_modules=attention, **kw),
        "lokr": lambda: peft.LoKrConfig(r=4, target_modules=attention, **kw),
        "vera": lambda: peft.VeraConfig(r=4, target_modules=attention, save_projection=True, **kw),
        "adalora": lambda: peft.AdaLoraConfig(
            init_r=4, target_modules=attention, total_step=10, orth_reg_weight=0.0, **kw),
        "modules_to_save": lambda: peft.LoraConfig(
            r=4, target_modules=attention, modules_to_save=[WHOLE.get(arch, "lm_head")], **kw),
        "embedding": lambda: peft.LoraConfig(r=4, target_modules=[EMBEDDING.get(arch, "embed_tokens"), *attention], **kw),
        "prompt": lambda: peft.PromptTuningConfig(num_virtual_tokens=4, **kw),
        "prefix": lambda: peft.PrefixTuningConfig(num_virtual_tokens=4, **kw),
    }[method]()


def adapter_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Trainable tensors (whole, on CPU) and VeRA's frozen shared projections, by the model's own names."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
        for n, p in tensors
        if p.requires_grad or ".vera_" in n
    }


def outputs(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits.detach().float().cpu()


def generate(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    """Greedy continuation of the first tokens (peft's `generate`, which bypasses the peft model's forward)."""
    prompt = inputs["input_ids"][:, :6]
    return model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False,
                          pad_token_id=0)


# --------------------------------------------------------------------------- the sharded side
class PeftCell(L.LightningModule):
    """A model built on meta from its save_pretrained directory, a fresh peft adapter, optionally saved adapters."""

    def __init__(self, arch: str, method: str, pretrained: str, adapter: str | None = None, as_saved: bool = False):
        super().__init__()
        self.arch, self.method, self.pretrained, self.adapter = arch, method, pretrained, adapter
        self.as_saved = as_saved  # the adapter's own saved config (inference mode), as one evaluates a saved adapter
        self.inputs = tiny_model(arch)[1]
        self.model = None
        self.facts: dict = {}

    def configure_model(self) -> None:
        if self.model is None:
            from peft import PeftConfig, get_peft_model

            base = tiny_model(self.arch)[0]
            load_pretrained(base, self.pretrained)
            config = PeftConfig.from_pretrained(self.adapter) if self.as_saved else peft_config(self.arch, self.method)
            self.model = get_peft_model(base, config)
            if self.adapter:
                load_adapter(self.model, self.adapter)

    def validation_step(self, batch, batch_idx: int) -> None:
        self.facts = {"adapters": adapter_tensors(self.model), "outputs": outputs(self.model, self.inputs)}
        if self.as_saved and "input_ids" in self.inputs and TASK.get(self.arch, "CAUSAL_LM") == "CAUSAL_LM":
            self.facts["generated"] = generate(self.model, self.inputs)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        self.model.eval()  # no dropout: the reference draws other masks
        rank, world = self.global_rank, self.trainer.world_size
        inputs = {k: v[rank::world].contiguous() for k, v in training_inputs(self.arch, self.inputs).items()}
        return self.model(**inputs).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TokenDataset(1), batch_size=1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TokenDataset(3), batch_size=1)  # three steps; the batch itself comes from self.inputs


def _trainer(**kwargs) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy(), **quiet_trainer_kwargs(), **kwargs)


def _sharded_cells(arch: str, pretrained: str, cells: dict[str, tuple[str, str]]) -> dict:
    """Each method's fresh adapters, trained adapters and the reload of what save_adapter wrote."""
    results = {}
    for method, (adapter_in, adapter_out) in cells.items():
        try:  # errors of this package are raised on every rank together, so the next cell still runs
            fresh = PeftCell(arch, method, pretrained)
            _trainer().validate(fresh, verbose=False)
            trained = PeftCell(arch, method, pretrained, adapter_in)
            if method in UNTRAINABLE:
                _trainer().validate(trained, verbose=False)
            else:
                _trainer(max_steps=3, limit_val_batches=0, num_sanity_val_steps=0).fit(trained)
                trained.validation_step(None, 0)  # the facts after training
            save_adapter(trained.model, adapter_out)
            reloaded = PeftCell(arch, method, pretrained, adapter_out)
            _trainer().validate(reloaded, verbose=False)
            as_saved = PeftCell(arch, method, pretrained, adapter_out, as_saved=True)
            _trainer().validate(as_saved, verbose=False)
            results[method] = {"fresh": fresh.facts, "trained": trained.facts, "reloaded": reloaded.facts,
                               "as_saved": as_saved.facts}
        except Exception:
            import traceback

            results[method] = {"error": traceback.format_exc()}
    return results


# --------------------------------------------------------------------------- the one-process reference
def _methods(arch: str, everything: bool) -> tuple[str, ...]:
    """The cells of ``arch`` this session runs: all of them, or without --runslow the Llama row and LoRA column."""
    wanted = METHODS if everything or arch == "llama" else ["lora"]
    return tuple(m for m in wanted if (arch, m) not in NOT_IN_PEFT)


@functools.cache
def _row(arch: str, root: Path, methods: tuple[str, ...]) -> dict:
    """One launch for every method of ``arch``: the sharded results and peft's own in one process."""
    from peft import get_peft_model

    torch.manual_seed(0)
    model, inputs = tiny_model(arch)
    model.save_pretrained(root / "pretrained")
    base = lambda: type(model).from_pretrained(root / "pretrained")  # noqa: E731
    reference, cells = {}, {}
    for method in methods:
        torch.manual_seed(0)
        eager = get_peft_model(base(), peft_config(arch, method))
        fresh = {"adapters": adapter_tensors(eager), "outputs": outputs(eager, inputs)}
        with torch.no_grad():  # every trainable tensor moved off its initial value, then saved by peft
            for param in eager.parameters():
                if param.requires_grad:
                    param.add_(torch.randn_like(param) * 0.1)
        eager.save_pretrained(root / method / "in")
        eager.eval()
        optimizer = torch.optim.SGD([p for p in eager.parameters() if p.requires_grad], lr=0.1)
        for _ in range(0 if method in UNTRAINABLE else 3):
            optimizer.zero_grad()
            eager(**training_inputs(arch, inputs)).loss.backward()
            optimizer.step()
        trained = {"adapters": adapter_tensors(eager), "outputs": outputs(eager, inputs)}
        reference[method] = {"fresh": fresh, "trained": trained}
        cells[method] = (str(root / method / "in"), str(root / method / "out"))
    sharded = run_distributed(_sharded_cells, 2, arch, str(root / "pretrained"), cells, timeout=900)[0]
    return {"reference": reference, "sharded": sharded, "root": root, "base": base, "inputs": inputs}


def _cells():
    for arch in ARCHITECTURES:
        for method in METHODS:
            marks = [] if arch == "llama" or method == "lora" else [pytest.mark.slow]
            if (arch, method) in NOT_IN_PEFT:
                marks.append(pytest.mark.skip(reason=NOT_IN_PEFT[arch, method]))
            yield pytest.param(arch, method, marks=marks, id=f"{arch}-{method}")


def _worst(a: dict, b: dict) -> tuple[float, str]:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return max(((a[k] - b[k]).abs().max().item(), k) for k in a)


@pytest.mark.parametrize(("arch", "method"), list(_cells()))
def test_peft_method_on_architecture(arch: str, method: str, tmp_path_factory, request) -> None:
    from peft import PeftModel

    methods = _methods(arch, request.config.getoption("--runslow"))
    row = _row(arch, tmp_path_factory.getbasetemp() / f"peft-matrix-{arch}-{len(methods)}", methods)
    ref, got = row["reference"][method], row["sharded"][method]
    assert "error" not in got, got.get("error")

    # fresh: peft's initialization on the loaded base
    random = [n for n in ref["fresh"]["adapters"] if RANDOM.intersection(n.split("."))
              or (method == "adalora" and ".lora_B." in n)]
    deterministic = {n: t for n, t in ref["fresh"]["adapters"].items() if n not in random}
    assert got["fresh"]["adapters"].keys() == ref["fresh"]["adapters"].keys()
    if deterministic:
        worst, name = _worst({n: got["fresh"]["adapters"][n] for n in deterministic}, deterministic)
        assert worst <= 1e-6, f"fresh {name}: {worst}"
    for name in random:  # drawn, at the scale peft draws them
        mine, peft_s = got["fresh"]["adapters"][name].std(), ref["fresh"]["adapters"][name].std()
        assert 0.5 * peft_s <= mine <= 2 * peft_s, f"fresh {name}: std {mine} vs peft's {peft_s}"
    if method not in ("prompt", "prefix"):  # a fresh adapter leaves the outputs as they were
        assert torch.allclose(got["fresh"]["outputs"], ref["fresh"]["outputs"], atol=1e-5)

    # training from peft's saved adapter, against three steps in one process
    worst, name = _worst(got["trained"]["adapters"], ref["trained"]["adapters"])
    assert worst <= 1e-4, f"trained {name}: {worst}"
    assert torch.allclose(got["trained"]["outputs"], ref["trained"]["outputs"], atol=1e-4)

    # round trip: save_adapter -> PeftModel.from_pretrained in one process, and -> load_adapter sharded
    loaded = PeftModel.from_pretrained(row["base"](), row["root"] / method / "out")
    tensors = dict([*loaded.named_parameters(), *loaded.named_buffers()])
    worst, name = _worst({n: tensors[n].detach() for n in got["trained"]["adapters"]}, got["trained"]["adapters"])
    assert worst <= 1e-6, f"PeftModel.from_pretrained {name}: {worst}"
    assert torch.allclose(outputs(loaded, row["inputs"]), got["trained"]["outputs"], atol=1e-5)
    worst, name = _worst(got["reloaded"]["adapters"], got["trained"]["adapters"])
    assert worst <= 1e-6, f"load_adapter {name}: {worst}"
    # evaluated with the saved config (inference mode: adapters frozen, prompt weights read directly), and generating
    assert torch.allclose(got["as_saved"]["outputs"], got["trained"]["outputs"], atol=1e-5)
    if "generated" in got["as_saved"]:
        assert torch.equal(got["as_saved"]["generated"], generate(loaded, row["inputs"]))


# --------------------------------------------------------------------------- what cannot run sharded: one clear error
class RefusedCell(PeftCell):
    def __init__(self, pretrained: str, config) -> None:
        super().__init__("llama", "lora", pretrained)
        self.config = config

    def configure_model(self) -> None:
        if self.model is None:
            from peft import get_peft_model

            base = tiny_model(self.arch)[0]
            load_pretrained(base, self.pretrained)
            self.model = get_peft_model(base, self.config)


def _refusals(pretrained: str, out: str) -> dict[str, str]:
    import peft

    def error(run) -> str:
        try:
            run()
        except ValueError as e:
            return str(e)
        return "no error"

    def fit(config) -> None:
        _trainer(max_steps=1, limit_val_batches=0, num_sanity_val_steps=0).fit(RefusedCell(pretrained, config))

    def validate(config) -> None:
        _trainer().validate(RefusedCell(pretrained, config), verbose=False)

    def save_projected_prefix() -> None:
        cell = RefusedCell(pretrained, peft.PrefixTuningConfig(num_virtual_tokens=4, prefix_projection=True,
                                                               task_type="CAUSAL_LM"))
        _trainer().validate(cell, verbose=False)
        save_adapter(cell.model, out)

    return {
        "pissa": error(lambda: validate(peft.LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights="pissa"))),
        "orthogonal": error(lambda: validate(peft.LoraConfig(r=4, target_modules=["q_proj"],
                                                             init_lora_weights="orthogonal"))),
        "sample_vocab": error(lambda: validate(peft.PromptTuningConfig(
            num_virtual_tokens=4, prompt_tuning_init="SAMPLE_VOCAB", task_type="CAUSAL_LM"))),
        "adalora_fit": error(lambda: fit(peft.AdaLoraConfig(init_r=4, target_modules=["q_proj"], total_step=10))),
        "projected_prefix": error(save_projected_prefix),
    }


def test_peft_options_that_cannot_run_sharded_are_refused_by_name_on_every_rank(tmp_path) -> None:
    """PiSSA (adapters from an SVD of the base weights), orthogonal LoRA (one whole random matrix) and prompt tuning
    initialized from the vocabulary read whole weights that are not loaded when get_peft_model runs on meta; AdaLoRA's regularization reads whole weights after
    the forward pass; a projected prefix saves an output loading cannot invert. Each: one ValueError naming the
    option and what to do, on every rank (none hangs)."""
    torch.manual_seed(0)
    model, _ = tiny_model("llama")
    model.save_pretrained(tmp_path / "pretrained")
    for rank in run_distributed(_refusals, 2, str(tmp_path / "pretrained"), str(tmp_path / "out")):
        assert "init_lora_weights='pissa'" in rank["pissa"] and "meta_init=False" in rank["pissa"]
        assert "init_lora_weights='orthogonal'" in rank["orthogonal"] and "one whole random matrix" in rank["orthogonal"]
        assert "prompt_tuning_init='SAMPLE_VOCAB'" in rank["sample_vocab"] and "'RANDOM'" in rank["sample_vocab"]
        assert "AdaLoRA adapter 'default' cannot be trained sharded" in rank["adalora_fit"]
        assert "prefix_projection" in rank["projected_prefix"] and "PromptTuningConfig" in rank["projected_prefix"]
    assert not (tmp_path / "out").exists()


class DeclaredOnTheLightningModule(PeftCell):
    """The peft model first, then both loads declared on the LightningModule itself (its names start `model.`)."""

    def configure_model(self) -> None:
        if self.model is None:
            from peft import get_peft_model

            self.model = get_peft_model(tiny_model(self.arch)[0], peft_config(self.arch, self.method))
            load_pretrained(self, self.pretrained)
            load_adapter(self, self.adapter)


def _declared_on_module(arch: str, method: str, pretrained: str, adapter: str) -> dict:
    cell = DeclaredOnTheLightningModule(arch, method, pretrained, adapter)
    _trainer().validate(cell, verbose=False)
    return cell.facts


@pytest.mark.parametrize("method", ["lora", "dora", "ia3", "modules_to_save", "prompt"])
def test_loads_declared_on_the_lightning_module_that_holds_the_peft_model(method: str, tmp_path_factory, request) -> None:
    """`load_pretrained(self, ...)` and `load_adapter(self, ...)` in configure_model, after get_peft_model: the names
    under the LightningModule (`model.base_model.model....`) match the checkpoint's, as they do on the peft model."""
    methods = _methods("llama", request.config.getoption("--runslow"))
    row = _row("llama", tmp_path_factory.getbasetemp() / f"peft-matrix-llama-{len(methods)}", methods)
    expected = row["sharded"][method]["trained"]
    adapter = row["root"] / method / "out"
    got = run_distributed(_declared_on_module, 2, "llama", method, str(row["root"] / "pretrained"), str(adapter))[0]
    worst, name = _worst(got["adapters"], expected["adapters"])
    assert worst <= 1e-6, f"{name}: {worst}"
    assert torch.allclose(got["outputs"], expected["outputs"], atol=1e-5)
