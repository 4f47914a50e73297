"""The model of --quick: a tiny random-weight Llama with the default model's tokenizer, so every
benchmark's code path runs in seconds. Its figures say nothing about speed."""

from __future__ import annotations

from pathlib import Path


def tiny_model(folder: str | Path, num_layers: int = 2, vocab_size: int | None = None,
               initializer_range: float = 0.02, tokenizer_from: str | None = None) -> str:
    """A checkpoint directory (config.json, safetensors, tokenizer), made once in folder.
    vocab_size: the tokenizer's by default; a smaller one makes the LM head near free (the
    tokenizer still decodes the ids below it). A larger initializer_range (0.3) peaks the logits,
    so that greedy choices are not near-ties and runs that batch differently agree.
    tokenizer_from: a checkpoint directory to take the tokenizer from (faster than the GGUF)."""
    folder = Path(folder)
    if (folder / "config.json").exists():
        return str(folder)
    import transformers

    from scheduler_svc.core.tokenizer import load_tokenizer

    # The default model's: the prompts' ids and the stop token stay meaningful.
    tokenizer = load_tokenizer(tokenizer_from)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size or len(tokenizer), hidden_size=64, intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        initializer_range=initializer_range,
    )  # fmt: skip
    tmp = folder.with_name(folder.name + ".tmp")
    transformers.LlamaForCausalLM(config).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(folder)  # whole or absent, also when interrupted
    return str(folder)
