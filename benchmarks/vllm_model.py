"""Tiny random models for vLLM runs on CPU (``radixkv bench vllm --model`` and ``tests/vllm``):
written once with ``transformers`` (``*Config`` + ``save_pretrained``, fixed seed); nothing
downloaded. ``config.json`` says the model's ``"dtype"``, what vLLM and ``radixkv serve
--model-config`` read. :data:`MODELS` names each kind with what vLLM needs to run it on CPU
(dtype, hybrid, batching limit); ``docs/vllm.md`` ("Model kinds") says why. head_dim is 64
because vLLM's CPU attention backend refuses 16."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["MODELS", "ModelKind", "TinyLlama", "make_model", "make_tiny_llama"]


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


@dataclass(frozen=True)
class ModelKind:
    """One ``--model`` choice: the HF config class and its fields, and what vLLM needs on CPU.

    ``hybrid``: recurrent (Mamba / linear-attention) layers; ``batched_tokens_eq_block``: vLLM's
    ``max_num_batched_tokens`` must equal the block size (GraniteMoeHybrid's CPU Mamba2 kernel);
    ``kv_layers``: the layers that hold attention KV; ``block_size``: the bench's default (hybrids:
    256, what vLLM's ``mamba_cache_mode="align"`` needs at least for these shapes)."""

    name: str
    config_class: str
    fields: dict[str, Any]
    dtype: str = "float32"
    hybrid: bool = False
    batched_tokens_eq_block: bool = False
    seed: int = 0
    block_size: int = 32

    @property
    def vocab_size(self) -> int:
        return int(self.fields["vocab_size"])

    @property
    def kv_layers(self) -> int:
        types = self.fields.get("layer_types")
        if types is None:
            return int(self.fields["num_hidden_layers"])
        return sum(t in ("full_attention", "attention") for t in types)

    def kv_bytes_per_token(self) -> int:
        """K and V of every attention layer, all KV heads, in the model's dtype."""
        f = self.fields
        head = int(f.get("head_dim") or f["hidden_size"] // f["num_attention_heads"])
        return 2 * self.kv_layers * int(f["num_key_value_heads"]) * head * (4 if self.dtype == "float32" else 2)

    def matmul_params(self) -> int:
        """Weights a token multiplies through (full attention + dense MLP layers and the LM
        head; embeddings are a lookup): 2 x this is its prefill FLOPs, attention scores aside.
        Llama kinds only (the ratio model's choice; hybrids: NotImplementedError)."""
        if self.config_class != "LlamaConfig":
            raise NotImplementedError(f"{self.name}: parameter count of Llama kinds only")
        f = self.fields
        h, i, hd = int(f["hidden_size"]), int(f["intermediate_size"]), int(f["head_dim"])
        attn = h * hd * (2 * int(f["num_attention_heads"]) + 2 * int(f["num_key_value_heads"]))
        return int(f["num_hidden_layers"]) * (attn + 3 * h * i) + h * int(f["vocab_size"])


def _llama(shape: TinyLlama, name: str) -> ModelKind:
    return ModelKind(name, "LlamaConfig", {k: v for k, v in asdict(shape).items() if k != "seed"}, seed=shape.seed)


#: Llama-3-8B: 2 x 7.5e9 matmul weights (8.03e9 less the 0.53e9 embedding lookup) = 1.5e10 FLOPs per
#: token against 32 layers x 8 KV heads x 128 x (K, V) x 2 bytes = 131,072 KV bytes per token:
#: 1.15e5 FLOPs per KV byte. This fp32 shape: 2 x 59.0e6 / 1,024 = 1.15e5 (docs/vllm_bench.md).
RATIO_8B = TinyLlama(hidden_size=1024, intermediate_size=8192, num_hidden_layers=2, num_attention_heads=16,
                     num_key_value_heads=1, head_dim=64)

MODELS: dict[str, ModelKind] = {
    "llama": _llama(TinyLlama(), "llama"),
    "llama-8b-ratio": _llama(RATIO_8B, "llama-8b-ratio"),
    # gated delta net (3 layers) + full attention (1) + MoE; CPU GDN attention requires bf16
    "qwen3-next": ModelKind("qwen3-next", "Qwen3NextConfig", {
        "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128, "decoder_sparse_step": 1,
        "max_position_embeddings": 4096, "initializer_range": 0.02}, dtype="bfloat16", hybrid=True, block_size=256),
    # Mamba2 (3 layers) + attention (1) + MoE
    "granite-hybrid": ModelKind("granite-hybrid", "GraniteMoeHybridConfig", {
        "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"], "mamba_n_heads": 8, "mamba_d_head": 64,
        "mamba_d_state": 64, "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_expand": 2,
        "num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 512,
        "position_embedding_type": "rope", "max_position_embeddings": 4096, "initializer_range": 0.02},
        dtype="float32", hybrid=True, batched_tokens_eq_block=True, block_size=256),
}


def make_model(path: str, kind: ModelKind) -> str:
    """Write ``kind`` to ``path`` (a directory) unless the same is there already
    (``radixkv_shape.json`` records it); returns ``path``."""
    stamp = os.path.join(path, "radixkv_shape.json")
    want = {"config_class": kind.config_class, "dtype": kind.dtype, "seed": kind.seed, **kind.fields}
    if os.path.isfile(stamp):
        with open(stamp, encoding="utf-8") as f:
            if json.load(f) == want:
                return path
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    cfg = getattr(transformers, kind.config_class)(**kind.fields, tie_word_embeddings=False, bos_token_id=0,
                                                   eos_token_id=1)
    dtype = getattr(torch, kind.dtype)
    cfg.torch_dtype = kind.dtype
    torch.manual_seed(kind.seed)
    model = AutoModelForCausalLM.from_config(cfg).to(dtype)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path, encoding="utf-8") as f:
        data = json.load(f)
    data["dtype"] = kind.dtype
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(data, f)
    with open(stamp, "w", encoding="utf-8") as f:
        json.dump(want, f)
    return path


def make_tiny_llama(path: str, shape: TinyLlama = TinyLlama()) -> str:
    """:func:`make_model` of a Llama ``shape``."""
    return make_model(path, _llama(shape, "llama"))
