"""``HybridModel``: a tiny Kimi-Linear-like model (KDA + full attention) with random weights,
runnable from scratch (the ground truth) or incrementally through the cache pools.

Per layer ``x += mixer(rmsnorm(x))`` then a SwiGLU MLP; mixers follow
``config.layer_pattern``. The cache interface (``ModelCache``) is exactly the API of the real
pools: ``kv_pool.get_kv_buffer`` / ``set_kv_buffer``, ``mamba_cache(layer_id)`` (``.conv[0]``,
``.temporal``) and ``req_to_token`` (read by ``decode`` only). Layer ids are ``"global"``
(hybrid pools) or ``"local"`` (per kind, bare pools). KV row 0, state slot 0 and request row
0 are padding. ``extend`` at ``start_pos == 0`` starts from a zero state; to fork, copy the
state slot and reuse the KV rows. Details: ``docs/internals.md``, "The model and its cache
interface".
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from radixkv.contracts import IndexLike
from radixkv.errors import InvalidArgumentError, InvalidIndexError, LengthMismatchError, describe_ids
from radixkv.kernels.state_copy import resolve_backend, validate_slot_indices
from radixkv.memory.mamba_pool import Mamba2LayerCache
from radixkv.reference.attention import FullAttentionLayer, LayerKV
from radixkv.reference.config import HybridConfig
from radixkv.reference.kda import KDALayer
from radixkv.validation import as_token_array, index_tensor

if TYPE_CHECKING:
    from radixkv.engine.buffers import WorkerBuffers

LAYER_ID_MODES = ("global", "local")


class ModelCache:
    """What the incremental paths read and write: a KV pool, a Mamba-state accessor and
    (for ``decode``) the request-to-token table. Holds references only; no state of its own.

    ``ModelCache(kv_pool, mamba_cache, req_to_token=None, *, kv_layer_ids="global",
    mamba_layer_ids="global")``; ``kv_pool`` may be ``None`` for a model without full layers.
    """

    __slots__ = ("kv_pool", "mamba_cache", "req_to_token", "kv_layer_ids", "mamba_layer_ids")

    def __init__(
        self,
        kv_pool: LayerKV | None,
        mamba_cache: Callable[[int], Mamba2LayerCache] | None,
        req_to_token: torch.Tensor | None = None,
        *,
        kv_layer_ids: str = "global",
        mamba_layer_ids: str = "global",
    ):
        if kv_layer_ids not in LAYER_ID_MODES or mamba_layer_ids not in LAYER_ID_MODES:
            raise InvalidArgumentError(f"layer id modes must be in {LAYER_ID_MODES}")
        self.kv_pool = kv_pool
        self.mamba_cache = mamba_cache
        self.req_to_token = req_to_token
        self.kv_layer_ids = kv_layer_ids
        self.mamba_layer_ids = mamba_layer_ids

    @classmethod
    def over(cls, buffers: WorkerBuffers) -> ModelCache:
        """Over an engine's :class:`~radixkv.engine.buffers.WorkerBuffers` (global layer
        ids): its KV pool, its KDA states (hybrid models) and its ``req_to_token`` table."""
        mamba = buffers.mamba2_layer_cache if buffers.mamba_pool is not None else None
        return cls(buffers, mamba, buffers.req_to_token)


def _rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _check_rows(rows: torch.Tensor, num_rows: int, name: str) -> None:
    bad = (rows < 1) | (rows >= num_rows)
    if bool(bad.any()):
        raise InvalidIndexError(f"{name} out of range 1..{num_rows - 1}: {describe_ids(rows[bad].tolist())}")


def _check_distinct(rows: torch.Tensor, name: str) -> None:
    uniq, counts = torch.unique(rows, return_counts=True)
    if bool((counts > 1).any()):
        raise InvalidArgumentError(f"{name} repeats {describe_ids(uniq[counts > 1].tolist())}")


class _Block:
    """One layer: pre-norm mixer and pre-norm SwiGLU MLP, both residual."""

    def __init__(self, config: HybridConfig, kind: str, gen: torch.Generator, device: torch.device):
        def draw(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale + shift).to(device, config.dtype)

        hid, inner = config.hidden, config.mlp_mult * config.hidden
        self.norm1 = draw(hid, scale=0.1, shift=1.0)
        self.mixer: KDALayer | FullAttentionLayer = (
            KDALayer(config, gen, device) if kind == "K" else FullAttentionLayer(config, gen, device)
        )
        self.norm2 = draw(hid, scale=0.1, shift=1.0)
        self.mlp: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        if inner:
            w_gate = draw(hid, inner, scale=hid**-0.5)
            w_up = draw(hid, inner, scale=hid**-0.5)
            self.mlp = (w_gate, w_up, draw(inner, hid, scale=inner**-0.5))

    def mlp_residual(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        if self.mlp is None:
            return x
        w_gate, w_up, w_down = self.mlp
        h = _rmsnorm(x, self.norm2, eps)
        return x + (F.silu(h @ w_gate) * (h @ w_up)) @ w_down


class HybridModel:
    """The reference hybrid model. ``HybridModel(config, device="cpu", *, backend=None)``;
    ``backend`` selects the decode kernels (``None``: Triton on CUDA, torch elsewhere) and,
    given explicitly, the chunked prefill of ``extend`` (default torch).

    Methods (all validate fully before touching any pool, and raise typed errors from
    ``radixkv.errors``; state is unchanged on error): ``forward_reference(token_ids) -> logits
    [T, vocab]``; ``extend(token_ids_new, start_pos, kv_rows_prefix, kv_rows_new, state_slot,
    pools) -> [T_new, vocab]``; ``decode(token_ids, req_pool_indices, seq_lens, out_cache_loc,
    state_slots, pools) -> [B, vocab]``.
    """

    def __init__(self, config: HybridConfig, device: torch.device | str = "cpu", *, backend: str | None = None):
        if not isinstance(config, HybridConfig):
            raise InvalidArgumentError(f"config must be a HybridConfig, got {type(config).__name__}")
        self.config = config
        self.device = torch.device(device)
        self.backend = resolve_backend(backend, self.device)
        # the chunked prefill kernel is checked under the Triton interpreter only: opt-in
        self.extend_backend = resolve_backend(backend, self.device) if backend is not None else "torch"
        gen = torch.Generator().manual_seed(config.seed)

        def draw(*s: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
            return (torch.randn(*s, generator=gen, dtype=torch.float64) * scale + shift).to(self.device, config.dtype)

        self.embed = draw(config.vocab, config.hidden)
        self.blocks = [_Block(config, kind, gen, self.device) for kind in config.layer_pattern]
        self.final_norm = draw(config.hidden, scale=0.1, shift=1.0)
        self.lm_head = draw(config.hidden, config.vocab, scale=config.hidden**-0.5)
        self._local = {lid: i for ids in (config.kda_layer_ids, config.full_layer_ids) for i, lid in enumerate(ids)}

    # ---- helpers ---------------------------------------------------------------------------
    def _tokens(self, token_ids: IndexLike) -> torch.Tensor:
        if isinstance(token_ids, torch.Tensor):
            if token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool or token_ids.dim() != 1:
                raise InvalidArgumentError(
                    f"token ids must be a 1-D integer tensor, got {token_ids.dtype} {tuple(token_ids.shape)}"
                )
            ids = token_ids.to(self.device, torch.int64)
        else:
            ids = torch.from_numpy(as_token_array(token_ids)).to(self.device, torch.int64)
        bad = (ids < 0) | (ids >= self.config.vocab)
        if bool(bad.any()):
            raise InvalidIndexError(
                f"token ids out of range 0..{self.config.vocab - 1}: {describe_ids(ids[bad].tolist())}"
            )
        return ids

    def _kv_id(self, lid: int, pools: ModelCache) -> int:
        return lid if pools.kv_layer_ids == "global" else self._local[lid]

    def _mamba(self, lid: int, pools: ModelCache) -> Mamba2LayerCache:
        if pools.mamba_cache is None:
            raise InvalidArgumentError(f"layer {lid} is a KDA layer and this ModelCache has no Mamba states")
        return pools.mamba_cache(lid if pools.mamba_layer_ids == "global" else self._local[lid])

    @staticmethod
    def _kv_pool(pools: ModelCache) -> LayerKV:
        if pools.kv_pool is None:
            raise InvalidArgumentError("the model has full-attention layers but pools.kv_pool is None")
        return pools.kv_pool

    def _check_pools(self, pools: ModelCache) -> tuple[int | None, int | None]:
        """Validate every buffer the model will touch; returns (kv rows, state slots) counts."""
        cfg = self.config
        if not isinstance(pools, ModelCache):
            raise InvalidArgumentError(f"pools must be a ModelCache, got {type(pools).__name__}")
        num_rows: int | None = None
        num_slots: int | None = None
        for lid in cfg.full_layer_ids:
            k_buf, v_buf = self._kv_pool(pools).get_kv_buffer(self._kv_id(lid, pools))
            for buf in (k_buf, v_buf):
                if buf.dim() != 3 or tuple(buf.shape[1:]) != (cfg.num_heads, cfg.head_dim) or buf.device != self.device:
                    raise InvalidArgumentError(
                        f"KV buffer of layer {lid} must be [rows, {cfg.num_heads}, {cfg.head_dim}] on "
                        f"{self.device}, got {tuple(buf.shape)} on {buf.device}"
                    )
            num_rows = min(k_buf.shape[0], v_buf.shape[0], num_rows or k_buf.shape[0])
        for lid in cfg.kda_layer_ids:
            cache = self._mamba(lid, pools)
            conv, temporal = cache.conv[0], cache.temporal
            ok = (
                conv.dim() == 3 and tuple(conv.shape[1:]) == cfg.conv_state_shape
                and temporal.dim() == 4 and tuple(temporal.shape[1:]) == cfg.temporal_state_shape
                and conv.shape[0] == temporal.shape[0] and conv.device == temporal.device == self.device
            )
            if not ok:
                raise InvalidArgumentError(
                    f"Mamba cache of layer {lid} must be conv [slots+1, {cfg.conv_state_shape}] and temporal "
                    f"[slots+1, {cfg.temporal_state_shape}] on {self.device}, "
                    f"got {tuple(conv.shape)}, {tuple(temporal.shape)}"
                )
            num_slots = min(conv.shape[0], num_slots or conv.shape[0])
        return num_rows, num_slots

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return _rmsnorm(x, self.final_norm, self.config.norm_eps) @ self.lm_head

    # ---- ground truth ----------------------------------------------------------------------
    def forward_reference(self, token_ids: IndexLike) -> torch.Tensor:
        """Logits ``[T, vocab]`` of the whole sequence from scratch: no pools, no kernels
        (the conv as a sum of shifted taps, the token-by-token delta rule, masked attention)."""
        ids = self._tokens(token_ids)
        if ids.numel() == 0:
            raise InvalidArgumentError("forward_reference needs at least one token")
        x = self.embed.index_select(0, ids)
        eps = self.config.norm_eps
        for block in self.blocks:
            x = x + block.mixer.forward_reference(_rmsnorm(x, block.norm1, eps))
            x = block.mlp_residual(x, eps)
        return self._logits(x)

    # ---- incremental -----------------------------------------------------------------------
    def extend(
        self, token_ids_new: IndexLike, start_pos: int, kv_rows_prefix: IndexLike, kv_rows_new: IndexLike,
        state_slot: int, pools: ModelCache,
        *, track_slot: int | None = None, track_seqlen: int | None = None,
    ) -> torch.Tensor:
        """Run ``T`` new tokens of ONE request at positions ``start_pos..start_pos+T-1``.

        ``kv_rows_prefix [start_pos]``: the rows of the tokens before; ``kv_rows_new [T]``: fresh
        rows, written here for every full layer. ``state_slot``'s state is read (zeros when
        ``start_pos == 0``) and replaced by the state after the last new token. ``track_slot`` /
        ``track_seqlen`` (slot 0 or -1: none): also write the state after ``track_seqlen`` tokens
        into ``track_slot``. Returns the logits of the new tokens ``[T, vocab]``.
        Cost: O(T * (start_pos + T)) attention, O(T * chunk * D + T * D^2) per KDA layer.
        """
        ids = self._tokens(token_ids_new)
        if ids.numel() == 0:
            raise InvalidArgumentError("extend needs at least one new token")
        if not isinstance(start_pos, (int, np.integer)) or isinstance(start_pos, bool) or start_pos < 0:
            raise InvalidArgumentError(f"start_pos must be an int >= 0, got {start_pos!r}")
        start_pos = int(start_pos)
        num_rows, num_slots = self._check_pools(pools)
        prefix = index_tensor(kv_rows_prefix, self.device, "kv_rows_prefix", sequences=False)
        new = index_tensor(kv_rows_new, self.device, "kv_rows_new", sequences=False)
        if prefix.numel() != start_pos:
            raise LengthMismatchError(f"kv_rows_prefix has {prefix.numel()} rows, start_pos is {start_pos}")
        if new.numel() != ids.numel():
            raise LengthMismatchError(f"kv_rows_new has {new.numel()} rows for {ids.numel()} new tokens")
        if num_rows is not None:
            _check_rows(prefix, num_rows, "kv_rows_prefix")
            _check_rows(new, num_rows, "kv_rows_new")
            _check_distinct(new, "kv_rows_new")
            clash = torch.isin(new, prefix)
            if bool(clash.any()):
                raise InvalidArgumentError(f"kv_rows_new overwrite prefix rows {describe_ids(new[clash].tolist())}")
        if num_slots is not None:
            is_int = isinstance(state_slot, (int, np.integer)) and not isinstance(state_slot, bool)
            if not is_int or not 1 <= state_slot < num_slots:
                raise InvalidIndexError(f"state_slot must be an int in 1..{num_slots - 1}, got {state_slot!r}")
            state_slot = int(state_slot)
        track = self._check_track(track_slot, track_seqlen, start_pos, ids.numel(), state_slot, num_slots)

        x = self.embed.index_select(0, ids)
        eps = self.config.norm_eps
        for lid, block in enumerate(self.blocks):
            h = _rmsnorm(x, block.norm1, eps)
            if isinstance(block.mixer, KDALayer):
                out = block.mixer.extend(h, self._mamba(lid, pools), state_slot, fresh=start_pos == 0, track=track,
                                         backend=self.extend_backend)
            else:
                out = block.mixer.extend(h, start_pos, self._kv_pool(pools), self._kv_id(lid, pools), prefix, new)
            x = block.mlp_residual(x + out, eps)
        return self._logits(x)

    def _check_track(self, slot: int | None, seqlen: int | None, start: int, n: int, state_slot: int,
                     num_slots: int | None) -> tuple[int, int] | None:
        """``(track slot, tokens of this extend before the tracked position)`` or ``None``."""
        if slot is None or seqlen is None or int(slot) == 0 or int(seqlen) < 0 or num_slots is None:
            return None
        slot, seqlen = int(slot), int(seqlen)
        if not 1 <= slot < num_slots or slot == state_slot:
            raise InvalidIndexError(f"track_slot must be in 1..{num_slots - 1} and not state_slot, got {slot}")
        if not start < seqlen <= start + n:
            raise InvalidArgumentError(f"track_seqlen {seqlen} outside ({start}, {start + n}]")
        return slot, seqlen - start

    def decode(
        self, token_ids: IndexLike, req_pool_indices: IndexLike, seq_lens: IndexLike, out_cache_loc: IndexLike,
        state_slots: IndexLike, pools: ModelCache, track_slots: IndexLike | None = None,
    ) -> torch.Tensor:
        """One new token for each of ``B`` requests (batched).

        ``seq_lens[b]`` counts the new token (at position ``seq_lens[b] - 1``; ``seq_lens >= 2``),
        whose row ``out_cache_loc[b]`` must already be in ``req_to_token`` (SGLang's convention).
        ``state_slots[b]`` advances in place; requests, rows and slots must be distinct.
        ``track_slots [B]`` (0: none): where to copy the new state as well. Returns ``[B, vocab]``.
        Cost: O(B * max(seq_lens)) attention, O(B * H * D^2) per KDA layer.
        """
        ids = self._tokens(token_ids)
        dev = self.device
        rpi = index_tensor(req_pool_indices, dev, "req_pool_indices", sequences=False)
        lens = index_tensor(seq_lens, dev, "seq_lens", sequences=False)
        loc = index_tensor(out_cache_loc, dev, "out_cache_loc", sequences=False)
        slots = index_tensor(state_slots, dev, "state_slots", sequences=False)
        batch = ids.numel()
        if batch == 0:
            raise InvalidArgumentError("decode needs at least one request")
        if {rpi.numel(), lens.numel(), loc.numel(), slots.numel()} != {batch}:
            raise LengthMismatchError(
                f"decode inputs differ in length: tokens {batch}, req_pool_indices {rpi.numel()}, "
                f"seq_lens {lens.numel()}, out_cache_loc {loc.numel()}, state_slots {slots.numel()}"
            )
        num_rows, num_slots = self._check_pools(pools)
        table = pools.req_to_token
        if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.device != dev:
            raise InvalidArgumentError(f"decode needs pools.req_to_token, a 2-D tensor on {dev}")
        _check_distinct(rpi, "req_pool_indices")
        _check_rows(rpi, table.shape[0], "req_pool_indices")
        bad = (lens < 2) | (lens > table.shape[1])
        if bool(bad.any()):
            raise InvalidArgumentError(
                f"seq_lens must be in 2..{table.shape[1]}, got {describe_ids(lens[bad].tolist())}"
            )
        max_len = int(lens.max())
        valid = torch.arange(max_len, device=dev)[None, :] < lens[:, None]
        rows = torch.where(valid, table[rpi, :max_len].to(torch.int64), torch.zeros((), dtype=torch.int64, device=dev))
        if num_rows is not None:
            _check_rows(rows[valid], num_rows, "req_to_token rows")
            _check_rows(loc, num_rows, "out_cache_loc")
            _check_distinct(loc, "out_cache_loc")
            recorded = rows.gather(1, (lens - 1)[:, None])[:, 0]
            if not torch.equal(recorded, loc):
                raise InvalidArgumentError("out_cache_loc differs from req_to_token[req_pool_indices, seq_lens - 1]")
        if num_slots is not None:
            slots = validate_slot_indices(slots, num_slots, name="state_slots", device=dev, allow_padding=False)
        track = None
        if track_slots is not None and num_slots is not None:
            dst = index_tensor(track_slots, dev, "track_slots", sequences=False)
            if dst.numel() != batch:
                raise LengthMismatchError(f"track_slots has {dst.numel()} entries for {batch} requests")
            on = dst != 0
            if bool(on.any()):
                _check_rows(dst[on], num_slots, "track_slots")
                _check_distinct(torch.cat([dst[on], slots]), "state_slots and track_slots")
                track = (slots[on], dst[on])

        x = self.embed.index_select(0, ids)
        positions = lens - 1
        eps = self.config.norm_eps
        for lid, block in enumerate(self.blocks):
            h = _rmsnorm(x, block.norm1, eps)
            if isinstance(block.mixer, KDALayer):
                out = block.mixer.decode(h, self._mamba(lid, pools), slots, self.backend, track)
            else:
                out = block.mixer.decode(h, positions, self._kv_pool(pools), self._kv_id(lid, pools), loc, rows, valid)
            x = block.mlp_residual(x + out, eps)
        return self._logits(x)
