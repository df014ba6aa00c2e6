"""The KV shape of a Hugging Face model, read from its ``config.json``, as ``EngineConfig`` fields.

``radixkv serve --model-config DIR`` uses it so that the manager's KV pool has the shape of
the engine's KV cache (``radixkv.integrations.vllm`` refuses a mismatch at attach):
``layer_types`` ``"F" * num_hidden_layers``; ``head_num`` ``num_key_value_heads`` (else
``num_attention_heads``); ``head_dim`` (else ``hidden_size // num_attention_heads``);
``kv_dtype`` from ``dtype`` / ``torch_dtype`` (``float32`` when absent or ``"auto"``).
Multi-latent attention (DeepSeek-V2/V3: ``kv_lora_rank``) gives an MLA pool instead:
``kv_lora_rank``, ``qk_rope_head_dim``, ``head_num`` 1 and ``head_dim`` their sum.

A multimodal config's ``text_config`` is read when present. Qwen3-Next (gated delta net) and
GraniteMoeHybrid (Mamba2) give ``layer_types`` ``F``/``K`` and the per-layer state shapes vLLM
allocates, in the model dtype (vLLM's CPU build may keep GDN's temporal state in float32:
``--temporal-state-dtype``); the shapes: ``docs/vllm.md``, "Hybrid models". Other hybrids are
refused with ``InvalidArgumentError``.
"""
from __future__ import annotations

import json
import os
from typing import Any

from radixkv.errors import InvalidArgumentError

__all__ = ["kv_shape_from_hf_config", "load_hf_config", "engine_fields_from_model_dir"]

_DTYPES = {"float32": "float32", "float": "float32", "fp32": "float32", "float16": "float16",
           "half": "float16", "fp16": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16"}
_FULL_LAYER_NAMES = {"full_attention", "attention", "global", "full"}
_STATE_LAYER_NAMES = {"linear_attention", "mamba"}


def load_hf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The dict of ``path`` (a ``config.json`` or a directory holding one).

    Raises ``InvalidArgumentError`` for a missing, unreadable or malformed file."""
    p = os.fspath(path)
    if os.path.isdir(p):
        p = os.path.join(p, "config.json")
    try:
        with open(p, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise InvalidArgumentError(f"cannot read model config {p!r}: {e}") from None
    if not isinstance(data, dict):
        raise InvalidArgumentError(f"model config {p!r} is not a JSON object")
    return data


def _positive_int(cfg: dict[str, Any], key: str, where: str) -> int:
    v = cfg.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise InvalidArgumentError(f"{where}: {key} must be an int >= 1, got {v!r}")
    return v


def _layer_types(cfg: dict[str, Any], layers: int, where: str) -> str:
    """``F`` / ``K`` per layer; raises for a hybrid layout this module does not read."""
    for key in ("layers_block_type", "hybrid_override_pattern", "attn_layer_indices", "linear_attn_config"):
        if cfg.get(key):
            raise InvalidArgumentError(
                f"{where}: {key} marks a hybrid model --model-config does not read (Qwen3-Next and "
                "GraniteMoeHybrid layer_types are read; give --layer-types and the state shape)")
    kinds = cfg.get("layer_types")
    if not isinstance(kinds, list):
        return "F" * layers
    names = [str(k) for k in kinds]
    unknown = sorted(set(names) - _FULL_LAYER_NAMES - _STATE_LAYER_NAMES)
    if unknown or len(names) != layers:
        raise InvalidArgumentError(
            f"{where}: layer_types {sorted(set(names))} ({len(names)} for {layers} layers) are not full "
            f"attention / {sorted(_STATE_LAYER_NAMES)} per layer; give --layer-types and the state shape")
    return "".join("F" if n in _FULL_LAYER_NAMES else "K" for n in names)


def _state_fields(cfg: dict[str, Any], dtype: str, where: str) -> dict[str, Any]:
    """The state-pool fields of a hybrid config (GDN or Mamba2: see the module doc)."""
    if cfg.get("linear_num_value_heads") is not None:  # Qwen3-Next: gated delta net
        nk, nv = _positive_int(cfg, "linear_num_key_heads", where), _positive_int(cfg, "linear_num_value_heads", where)
        dk, dv = _positive_int(cfg, "linear_key_head_dim", where), _positive_int(cfg, "linear_value_head_dim", where)
        kernel = _positive_int(cfg, "linear_conv_kernel_dim", where)
        conv, temporal = (kernel - 1, 2 * nk * dk + nv * dv), (nv, dv, dk)
    elif cfg.get("mamba_d_state") is not None:  # GraniteMoeHybrid: Mamba2
        inner = _positive_int(cfg, "mamba_expand", where) * _positive_int(cfg, "hidden_size", where)
        groups, state = _positive_int(cfg, "mamba_n_groups", where), _positive_int(cfg, "mamba_d_state", where)
        kernel = _positive_int(cfg, "mamba_d_conv", where)
        conv = (kernel - 1, inner + 2 * groups * state)
        temporal = (_positive_int(cfg, "mamba_n_heads", where), _positive_int(cfg, "mamba_d_head", where), state)
    else:
        raise InvalidArgumentError(f"{where}: recurrent layers without gated-delta-net (linear_*) or Mamba2 "
                                   "(mamba_*) keys; give --layer-types and the state shape")
    return {"conv_state_dims": conv, "temporal_state_dims": temporal, "state_dtype": dtype}


def kv_shape_from_hf_config(cfg: dict[str, Any], where: str = "model config") -> dict[str, Any]:
    """``EngineConfig`` fields (``layer_types``, ``head_num``, ``head_dim``, ``kv_dtype``; MLA:
    also ``kv_lora_rank``, ``qk_rope_head_dim``; hybrid: the state fields) of a parsed HF config.
    Raises ``InvalidArgumentError`` naming the bad key."""
    if not isinstance(cfg, dict):
        raise InvalidArgumentError(f"{where}: not a dict")
    text = cfg.get("text_config")
    if isinstance(text, dict) and "num_hidden_layers" not in cfg:
        dtype_outer = cfg.get("dtype", cfg.get("torch_dtype"))
        cfg = dict(text)
        if dtype_outer is not None and cfg.get("dtype", cfg.get("torch_dtype")) is None:
            cfg["dtype"] = dtype_outer
    layers = _positive_int(cfg, "num_hidden_layers", where)
    types = _layer_types(cfg, layers, where)
    dtype = _dtype(cfg, where)
    if cfg.get("kv_lora_rank") and "K" in types:
        raise InvalidArgumentError(f"{where}: a hybrid model with MLA layers is not read (kv_lora_rank)")
    if cfg.get("kv_lora_rank"):  # MLA: one latent row per token
        rank = _positive_int(cfg, "kv_lora_rank", where)
        rope = _positive_int(cfg, "qk_rope_head_dim", where)
        return {"layer_types": "F" * layers, "head_num": 1, "head_dim": rank + rope, "kv_dtype": dtype,
                "kv_lora_rank": rank, "qk_rope_head_dim": rope}
    heads = _positive_int(cfg, "num_attention_heads", where)
    kv_heads = _positive_int(cfg, "num_key_value_heads", where) if cfg.get("num_key_value_heads") is not None \
        else heads
    if cfg.get("head_dim") is not None:
        head_dim = _positive_int(cfg, "head_dim", where)
    else:
        hidden = _positive_int(cfg, "hidden_size", where)
        if hidden % heads:
            raise InvalidArgumentError(f"{where}: hidden_size {hidden} is not a multiple of "
                                       f"num_attention_heads {heads} (and no head_dim is given)")
        head_dim = hidden // heads
    out = {"layer_types": types, "head_num": kv_heads, "head_dim": head_dim, "kv_dtype": dtype}
    return {**out, **_state_fields(cfg, dtype, where)} if "K" in types else out


def _dtype(cfg: dict[str, Any], where: str) -> str:
    raw = cfg.get("dtype", cfg.get("torch_dtype"))
    if raw is None or raw == "auto":
        return "float32"
    if isinstance(raw, str) and raw.lower().removeprefix("torch.") in _DTYPES:
        return _DTYPES[raw.lower().removeprefix("torch.")]
    raise InvalidArgumentError(f"{where}: dtype {raw!r} is not one of {sorted(set(_DTYPES.values()))}")


def engine_fields_from_model_dir(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``kv_shape_from_hf_config(load_hf_config(path))``: ``--model-config DIR``."""
    return kv_shape_from_hf_config(load_hf_config(path), where=f"model config {os.fspath(path)!r}")
