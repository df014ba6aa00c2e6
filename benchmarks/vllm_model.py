"""A tiny Llama-architecture model with random weights for vLLM runs on CPU (``radixkv bench
vllm`` and ``tests/vllm``): written once with ``transformers`` (``LlamaConfig`` +
``save_pretrained``, fixed seed, fp32); nothing downloaded. head_dim is 64 because vLLM's CPU
attention backend refuses 16. ``config.json`` says ``"dtype": "float32"``, what vLLM and
``radixkv serve --model-config`` read."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

__all__ = ["TinyLlama", "make_tiny_llama"]


@dataclass(frozen=True)
class TinyLlama:
    """The model's shape (the written ``config.json`` holds the same)."""

    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02  # 0.2: greedy output that depends on the whole prompt (tests)
    seed: int = 0


def make_tiny_llama(path: str, shape: TinyLlama = TinyLlama()) -> str:
    """Write the model to ``path`` (a directory) unless a model of the same shape is there
    already (``radixkv_shape.json`` records it); returns ``path``."""
    stamp = os.path.join(path, "radixkv_shape.json")
    want = asdict(shape)
    if os.path.isfile(stamp):
        with open(stamp, encoding="utf-8") as f:
            if json.load(f) == want:
                return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = {k: v for k, v in want.items() if k != "seed"}
    cfg = LlamaConfig(**fields, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    cfg.torch_dtype = "float32"
    torch.manual_seed(shape.seed)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path, encoding="utf-8") as f:
        data = json.load(f)
    data["dtype"] = "float32"
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(data, f)
    with open(stamp, "w", encoding="utf-8") as f:
        json.dump(want, f)
    return path
