"""The peer of the tensor-parallel benchmarks: what a user of Lightning's ``ModelParallelStrategy`` writes in
``configure_model`` for LoRA on a Hugging Face Llama, by hand, with torch's own styles: the plan transformers ships
for Llama (q/k/v/gate/up colwise, o/down rowwise, the embedding split by vocabulary, the head's output gathered),
LoRA's halves split as peft splits them (``lora_B`` behind a colwise layer, ``lora_A`` behind a rowwise one), then
``fully_shard`` of each decoder layer and of the root over the data-parallel mesh (torchtitan's order)."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh


def parallelize_by_hand(model: nn.Module, tp_mesh: DeviceMesh | None, dp_mesh: DeviceMesh) -> None:
    """Split ``model`` (a peft-wrapped ``LlamaForCausalLM``) over ``tp_mesh`` (if any), then shard it over
    ``dp_mesh``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    llama = model.base_model.model
    if tp_mesh is not None and tp_mesh.size() > 1:
        parallelize_module(llama, tp_mesh, {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate()),
        })
        for layer in llama.model.layers:
            plan = {}
            for name, style in (("self_attn.q_proj", "col"), ("self_attn.k_proj", "col"), ("self_attn.v_proj", "col"),
                                ("self_attn.o_proj", "row"), ("mlp.gate_proj", "col"), ("mlp.up_proj", "col"),
                                ("mlp.down_proj", "row")):
                make = ColwiseParallel if style == "col" else RowwiseParallel
                module = layer.get_submodule(name)
                if hasattr(module, "base_layer"):  # a LoRA layer: the base, and the half that follows it
                    plan[f"{name}.base_layer"] = make()
                    half = "lora_B" if style == "col" else "lora_A"
                    for adapter in getattr(module, half):
                        plan[f"{name}.{half}.{adapter}"] = make()
                else:
                    plan[name] = make()
            parallelize_module(layer, tp_mesh, plan)
    for layer in llama.model.layers:
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
