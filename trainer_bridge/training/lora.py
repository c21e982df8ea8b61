"""LoRA adapters for the built-in trainer (`trainer.lora.rank` > 0), with peft: the base model frozen,
an adapter of rank r on the target projections trained, and the servers fed the weights the adapted
model computes with (`merged_weights`: base + B @ A * alpha / r, by the base's checkpoint names), so a
server serves what the trainer trains without knowing of adapters.

peft is the `lora` extra (`pip install riptide[lora]`; `make setup` installs it)."""
from __future__ import annotations

import torch

# peft's names of the attention and MLP projections, by model_type (config.json)
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DEFAULT_TARGETS = {"llama": PROJECTIONS, "qwen2": PROJECTIONS, "qwen3": PROJECTIONS, "mistral": PROJECTIONS,
                   "gemma": PROJECTIONS, "gemma2": PROJECTIONS, "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
                   "gpt2": ["c_attn", "c_proj", "c_fc"]}


def is_adapted(model) -> bool:
    """Whether `model` is a peft model (its weights live under base_model, with adapters beside)."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def target_modules(model: torch.nn.Module, given: list) -> list[str]:
    """The module names to adapt: the ones given, else the projections of the model's architecture,
    else every Linear but the output head."""
    if given:
        return list(given)
    kind = getattr(getattr(model, "config", None), "model_type", "")
    if kind in DEFAULT_TARGETS:
        return DEFAULT_TARGETS[kind]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and m is not head})


def with_adapters(model: torch.nn.Module, rank: int, alpha: float, dropout: float, targets: list):
    """`model` with a fresh LoRA adapter (B = 0: it computes what `model` does until trained); only
    the adapter's parameters require gradients."""
    import peft
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, bias="none",
                             target_modules=target_modules(model, targets), task_type="CAUSAL_LM")
    return peft.get_peft_model(model, config)


@torch.no_grad()
def merged_weights(model) -> dict[str, torch.Tensor]:
    """The adapted model's weights by the base checkpoint's names: each adapted layer's base weight
    plus its adapters' B @ A * scale (computed apart, so the trainer's weights are left as they are:
    a merge and unmerge in place would move them by rounding), every other parameter as it is."""
    out = base_weights(model)
    for name, layer in _adapted_layers(model).items():
        weight = layer.base_layer.weight.detach()
        delta = sum((layer.get_delta_weight(a) for a in layer.active_adapters if a in layer.lora_A),
                    torch.zeros_like(weight))
        out[f"{name}.weight"] = weight + delta.to(weight.dtype)
    return out


def _adapted_layers(model) -> dict:
    from peft.tuners.lora import LoraLayer
    return {name: m for name, m in model.get_base_model().named_modules() if isinstance(m, LoraLayer)}


@torch.no_grad()
def adapter_tensors(model) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """What an adapter-only push sends: `m.lora_A` [r, in] and `m.lora_B` [out, r] of each adapted
    module m (by the base's module names) and each module's scale, for one active adapter on Linear
    layers (what the servers merge: m.weight = base + lora_B @ lora_A * scale)."""
    tensors, scales = {}, {}
    for name, layer in _adapted_layers(model).items():
        active = [a for a in layer.active_adapters if a in layer.lora_A]
        if len(active) != 1 or getattr(layer, "fan_in_fan_out", False) or \
                not isinstance(layer.lora_A[active[0]], torch.nn.Linear):
            raise ValueError(f"{name}: an adapter-only push takes one active LoRA adapter on a Linear layer "
                             f"(found {active}); push the merged weights instead (lora.merged_weights)")
        a = active[0]
        tensors[f"{name}.lora_A"] = layer.lora_A[a].weight.detach()
        tensors[f"{name}.lora_B"] = layer.lora_B[a].weight.detach()
        scales[name] = float(layer.scaling[a])
    return tensors, scales


def base_weights(model) -> dict[str, torch.Tensor]:
    """The frozen base's weights by its checkpoint names (what the servers must hold for an
    adapter-only push to apply)."""
    base = model.get_base_model()
    return {name.replace(".base_layer.", "."): p.detach() for name, p in base.named_parameters() if "lora_" not in name}


def adapter_share(model) -> float:
    """The adapter's parameters as a share of the whole model's."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable / max(1, sum(p.numel() for p in model.parameters()))


def base_digest(model) -> str:
    """The frozen base's identity: live_digest of its weights by checkpoint names (a checkpoint of an
    adapter run keeps it, and resuming checks the base it loads against it)."""
    from weight_sync import live_digest
    return live_digest(base_weights(model))


def adapter_problems(model, directory) -> list[str]:
    """What keeps the adapter saved in `directory` (peft's save_pretrained) from loading into
    `model`'s: another rank, alpha or set of target modules ([]: nothing)."""
    import json
    from pathlib import Path
    config = Path(directory) / "adapter_config.json"
    if not config.exists():
        return [f"{directory}: no adapter_config.json (not an adapter saved by an adapter run)"]
    saved, ours = json.loads(config.read_text()), model.peft_config["default"]
    out = []
    for key, mine in (("r", ours.r), ("lora_alpha", ours.lora_alpha)):
        if saved.get(key) != mine:
            out.append(f"the checkpoint's adapter has {key}={saved.get(key)}, this job's {mine}")
    if set(saved.get("target_modules") or []) != set(ours.target_modules or []):
        out.append(f"the checkpoint's adapter targets {sorted(saved.get('target_modules') or [])}, this job's "
                   f"{sorted(ours.target_modules or [])}")
    return out


@torch.no_grad()
def load_adapter(model, directory) -> None:
    """The adapter saved in `directory` into `model`'s (same rank, alpha and targets: adapter_problems)."""
    from pathlib import Path

    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file
    problems = adapter_problems(model, directory)
    if problems:
        raise ValueError("; ".join(problems))
    result = set_peft_model_state_dict(model, load_file(Path(directory) / "adapter_model.safetensors"))
    missing = [k for k in getattr(result, "missing_keys", []) if "lora_" in k]
    if getattr(result, "unexpected_keys", None) or missing:
        raise ValueError(f"{directory}: the saved adapter does not fit this model's "
                         f"(unexpected {list(result.unexpected_keys)[:3]}, missing {missing[:3]})")
