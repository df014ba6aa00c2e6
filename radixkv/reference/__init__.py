"""A tiny Kimi-Linear-like hybrid model (KDA + full attention, random weights) used as the
ground truth for the hybrid pools and the Mamba radix cache: ``forward_reference`` runs a
whole sequence from scratch; ``extend`` / ``decode`` run it incrementally through the pools'
APIs (see ``radixkv.reference.model``)."""
from radixkv.reference.attention import FullAttentionLayer, rope
from radixkv.reference.config import HybridConfig
from radixkv.reference.kda import KDALayer, KDAOutput, kda_chunked, kda_recurrent
from radixkv.reference.model import HybridModel, ModelCache

__all__ = [
    "FullAttentionLayer",
    "HybridConfig",
    "HybridModel",
    "KDALayer",
    "KDAOutput",
    "ModelCache",
    "kda_chunked",
    "kda_recurrent",
    "rope",
]
