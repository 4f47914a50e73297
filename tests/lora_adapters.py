"""Random LoRA adapters made with PEFT itself, and greedy references with PEFT applied."""

from __future__ import annotations

import copy

import torch
import transformers

from tests.parity import hf_greedy

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def base_model(base):
    """A transformers model of its own: loaded from a checkpoint folder, or a copy of a loaded
    one (PEFT wraps the modules of the model it is given, which must not be a shared fixture)."""
    if isinstance(base, str):
        return transformers.AutoModelForCausalLM.from_pretrained(base).eval()
    return copy.deepcopy(base).eval()


def make_adapter(base, directory, rank: int, seed: int) -> str:
    """A random PEFT LoRA on every attention and MLP projection (B not zero, so it shows); rank
    16 uses rsLoRA's scaling, so both of PEFT's scalings are covered. `base`: a checkpoint
    folder or a loaded transformers model (left as it was)."""
    import peft

    model = base_model(base)
    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=PROJECTIONS, init_lora_weights=False,
        use_rslora=rank == 16,
    )  # fmt: skip
    peft.get_peft_model(model, config).save_pretrained(directory)
    return str(directory)


def peft_model(base, adapter_path: str | None):
    """transformers' model with the adapter applied by PEFT (None: the base model alone)."""
    import peft

    model = base_model(base)
    return model if adapter_path is None else peft.PeftModel.from_pretrained(model, adapter_path)


def peft_greedy(base, adapter_path: str | None, prompt: list[int], n: int):
    """(the reference model, its greedy tokens) for the prompt."""
    model = peft_model(base, adapter_path)
    return model, hf_greedy(model, prompt, n)
