"""A tiny Kimi-Linear-like hybrid model (KDA + full attention, random weights) used as the
ground truth for the hybrid pools and the Mamba radix cache: ``forward_reference`` runs a
whole sequence from scratch; ``extend`` / ``decode`` run it incrementally through the pools'
APIs (see ``radixkv.reference.model``). The model's KDA and short-convolution kernels live
here too (``kda_chunk``, ``kda_decode``, ``causal_conv1d``: torch + Triton, like
``radixkv.kernels``), since only the model runs them."""
from radixkv.reference.attention import FullAttentionLayer, rope
from radixkv.reference.config import HybridConfig
from radixkv.reference.kda import KDALayer, kda_recurrent
from radixkv.reference.kda_chunk import KDAOutput, kda_chunked
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
