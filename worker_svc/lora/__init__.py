"""LoRA adapters: PEFT files read, slots in the model filled, a step's adapters checked."""
