"""LoRA RL (trainer.lora): peft adapters injected into the HF LM, and the merged weights that leave the trainer.

`inject_adapter_in_model` keeps the HF model class (no PeftModel wrapper): a target `nn.Linear` named
`P` becomes a peft `lora.Linear` holding `P.base_layer` (the frozen weight and bias) and `P.lora_A.default`,
`P.lora_B.default`; peft marks only the adapters trainable. Servers get the merged layer under the HF name
`P.weight`: W + scaling * B @ A, computed in float32 and cast to W's dtype (what peft's `merge` does), so a
server serves exactly what the trainer computes, with no LoRA path in the server.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipelinerl.config.trainer import LoraConfig

ADAPTER = "default"  # peft's name of the one adapter


@dataclass
class WeightGroup:
    """Parameters gathered together (`params`: their own names and tensors) and the LM weights they give:
    `names` (HF names) with `shapes_of` (the parameter each output takes its full shape and dtype from).
    `scaling` None: the outputs are the parameters themselves; else a LoRA layer, params (base weight,
    [base bias], A, B) giving (merged weight, [bias])."""

    params: list[tuple[str, torch.nn.Parameter]]
    names: list[str]
    shapes_of: list[torch.nn.Parameter]
    scaling: float | None = None

    def outputs(self, full: list[torch.Tensor]) -> list[torch.Tensor]:
        """The LM weights from the gathered full tensors of `params` (same order)."""
        if self.scaling is None:
            return full
        weight, *bias, a, b = full
        merged = weight.float() + self.scaling * (b.float() @ a.float())
        return [merged.to(weight.dtype), *bias]


def peft_config(cfg: LoraConfig):
    """trainer.lora as peft's LoraConfig (adapters on cfg.target_modules, no bias training)."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, target_modules=list(cfg.target_modules),
                          lora_dropout=cfg.dropout, bias="none")


def add_adapters(lm: torch.nn.Module, cfg: LoraConfig) -> torch.nn.Module:
    """`lm` with adapters beside cfg.target_modules, everything else frozen; every rank draws the same initial
    adapters (cfg.seed): sharding keeps each rank's slice of its own copy. peft's error names the targets
    when none matches."""
    from peft import inject_adapter_in_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        return inject_adapter_in_model(peft_config(cfg), lm, adapter_name=ADAPTER)


def weight_groups(lm: torch.nn.Module, lora: bool):
    """The LM's weights grouped by owning module in a fixed order (metas and tensors share it); a LoRA layer
    is one group whose outputs are its merged weight and bias."""
    adapted: list[str] = []
    layer_type = None
    if lora:
        from peft.tuners.lora import LoraLayer as layer_type
    for prefix, module in lm.named_modules():
        if any(prefix.startswith(a + ".") for a in adapted):
            continue  # inside a LoRA layer: its group has these
        if layer_type is not None and isinstance(module, layer_type):
            adapted.append(prefix)
            yield _lora_group(prefix, module)
            continue
        own = [(f"{prefix}.{n}" if prefix else n, p) for n, p in module.named_parameters(recurse=False)]
        if own:
            yield WeightGroup(own, [n for n, _ in own], [p for _, p in own])


def _lora_group(prefix: str, module: torch.nn.Module) -> WeightGroup:
    base = module.get_base_layer()
    own = [(f"{prefix}.{n}", p) for n, p in base.named_parameters(recurse=False)]  # weight, then bias
    adapters = [(f"{prefix}.lora_{x}", getattr(module, f"lora_{x}")[ADAPTER].weight) for x in "AB"]
    return WeightGroup(own + adapters, [n for n, _ in own], [p for _, p in own], float(module.scaling[ADAPTER]))


def adapter_tensors(groups: list[tuple[WeightGroup, list[torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """peft's adapter file keys (`base_model.model.<layer>.lora_A.weight`) -> tensors, from LoRA groups and
    their gathered tensors."""
    out = {}
    for group, full in groups:
        layer = group.names[0].rsplit(".", 1)[0]
        out[f"base_model.model.{layer}.lora_A.weight"] = full[-2]
        out[f"base_model.model.{layer}.lora_B.weight"] = full[-1]
    return out
