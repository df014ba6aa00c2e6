"""``EngineConfig``: everything needed to build a cache engine (pools, tree, session table).

The defaults start a small KV-only engine on the CPU. A config round-trips through plain
data (``to_dict`` / ``from_dict``) and loads from a JSON or TOML file (``from_file``), so the
server can take a config file and override single fields from flags
(``dataclasses.replace(cfg, kv_tokens=...)`` validates again).

Model shape: ``layer_types`` has one character per layer, ``F`` (full attention: per-token
KV in the KV pool) or ``K`` (a KDA linear-attention layer: a fixed-size recurrent state per
request in the Mamba pool). Layers are numbered globally in that order, as the reference
model and ``HybridLinearKVPool`` number them. ``conv_state_dims`` / ``temporal_state_dims``
(and ``temporal_state_dtype``) give a state layer's shapes directly (a GDN / Mamba2 model read
by ``--model-config``) instead of the KDA fields. ``kv_lora_rank > 0``: multi-latent attention,
the full-attention layers keep one latent row per token (``MLATokenToKVPool``).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from radixkv.contracts import STORAGE_ADMIT, WRITE_POLICIES
from radixkv.errors import InvalidArgumentError

if TYPE_CHECKING:  # torch loads on first use: a process that only reads the protocol (a light
    import torch  # worker, the chaos workers of tests/reliability) never pays its ~1.5 CPU-s import

__all__ = ["EngineConfig", "ADMISSION_POLICIES"]

#: ``every``: every finished / chunked request's tokens go into the tree (SGLang's radix
#: cache). ``branch`` (hybrid models): KV is cached as with ``every``, but Mamba states only
#: at request ends and branch-off points (Marconi, MLSys 2025). ``none``: nothing is cached,
#: every match is empty (SGLang's ``--disable-radix-cache``); requests still get rows and KV
#: slots.
ADMISSION_POLICIES: tuple[str, ...] = ("every", "branch", "none")

_INT_MIN = {  # field -> smallest allowed value
    "kv_tokens": 1, "page_size": 1, "head_num": 1, "head_dim": 1, "conv_kernel": 2,
    "kda_num_heads": 1, "kda_head_dim": 1, "state_slots": 1, "request_rows": 1,
    "max_context_len": 1, "max_sessions": 1, "max_requests_per_session": 1, "decode_reserve": 0,
    "kv_lora_rank": 0, "qk_rope_head_dim": 0,
    "host_kv_tokens": 0, "host_state_slots": 0, "storage_read_threads": 0,
}


@dataclass(frozen=True)
class EngineConfig:
    """The shape and limits of one cache engine. Immutable; validated on construction.

Fields: ``device``; the pools' sizes (``kv_tokens``, ``page_size``, ``state_slots``,
``request_rows``, ``max_context_len``); the model shape (``layer_types``, ``head_num``,
``head_dim``, MLA's ``kv_lora_rank``/``qk_rope_head_dim``, ``kv_dtype``, state fields: KDA's or
``*_state_dims``); the tree's policies; sessions; ``decode_reserve``, ``mamba_track_interval``;
the tiers (``host_kv_tokens``, ``write_policy``, ``storage*``, ``host_state_slots``). Each field:
``docs/internals.md``. Rules kept: ``kv_tokens`` and ``host_kv_tokens`` are multiples of
``page_size``; MLA needs ``head_num == 1`` and ``head_dim`` its latent width; ``decode_reserve``
needs page size 1 and no state tracking; a tracking interval is a multiple of ``page_size``; a
hybrid's host KV tier needs ``host_state_slots`` (storage and KV events allowed with it);
``host_state_slots`` needs a hybrid. Raises ``InvalidArgumentError`` naming the field.
"""

    device: str = "cpu"
    kv_tokens: int = 4096
    page_size: int = 1
    layer_types: str = "FF"
    head_num: int = 2
    head_dim: int = 16
    kv_dtype: str = "float32"
    conv_kernel: int = 4
    kda_num_heads: int = 2
    kda_head_dim: int = 16
    state_dtype: str = "float32"
    conv_state_dims: tuple[int, ...] | None = None
    temporal_state_dims: tuple[int, ...] | None = None
    temporal_state_dtype: str | None = None
    state_slots: int = 64
    request_rows: int = 64
    max_context_len: int = 2048
    eviction_policy: str = "lru"
    admission_policy: str = "every"
    enable_kv_events: bool = False
    lease_ttl_s: float = 30.0
    max_sessions: int = 64
    max_requests_per_session: int = 64
    checks: bool = True
    decode_reserve: int = 0
    mamba_track_interval: int | None = None
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    host_kv_tokens: int = 0
    host_state_slots: int = 0
    write_policy: str = "write_back"
    storage: str | None = None
    storage_timeout_ms: float = 50.0
    storage_admit: str = "all"
    storage_drain_timeout_s: float = 5.0
    storage_read_threads: int = 0

    def __post_init__(self) -> None:
        for name, lo in _INT_MIN.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise InvalidArgumentError(f"EngineConfig.{name} must be an int >= {lo}, got {v!r}")
        self._check_device()
        if self.decode_reserve and self.page_size != 1:
            raise InvalidArgumentError(
                f"EngineConfig.decode_reserve ({self.decode_reserve}) needs page_size 1, got {self.page_size}")
        iv = self.mamba_track_interval
        if iv is not None and (isinstance(iv, bool) or not isinstance(iv, int) or iv < 0):
            raise InvalidArgumentError(f"EngineConfig.mamba_track_interval must be None or an int >= 0, got {iv!r}")
        if iv and iv % self.page_size:
            raise InvalidArgumentError(
                f"EngineConfig.mamba_track_interval ({self.mamba_track_interval}) must be a multiple of "
                f"page_size ({self.page_size})")
        if iv and self.decode_reserve:
            raise InvalidArgumentError("EngineConfig.mamba_track_interval and decode_reserve exclude each other "
                                       "(a decode answered from a reserve cannot name its track slot)")
        if self.kv_lora_rank and (self.head_num, self.head_dim) != (1, self.kv_lora_rank + self.qk_rope_head_dim):
            raise InvalidArgumentError(
                f"EngineConfig: an MLA pool (kv_lora_rank {self.kv_lora_rank}) has one latent head of "
                f"kv_lora_rank + qk_rope_head_dim = {self.kv_lora_rank + self.qk_rope_head_dim}; got head_num "
                f"{self.head_num}, head_dim {self.head_dim}")
        if self.qk_rope_head_dim and not self.kv_lora_rank:
            raise InvalidArgumentError("EngineConfig.qk_rope_head_dim needs kv_lora_rank > 0 (MLA)")
        if self.kv_tokens % self.page_size:
            raise InvalidArgumentError(
                f"EngineConfig.kv_tokens ({self.kv_tokens}) must be a multiple of page_size "
                f"({self.page_size})")
        self._check_tiers()
        self._check_state_dims()
        lt = self.layer_types
        if not isinstance(lt, str) or not lt or set(lt) - {"F", "K"} or "F" not in lt:
            raise InvalidArgumentError(
                f"EngineConfig.layer_types must be a string of 'F'/'K' with at least one 'F', got {lt!r}")
        # Imported here: the memory package brings the allocator and its kernels, which a
        # module that only reads configs (a remote client) does not need.
        from radixkv.memory.arena import parse_dtype

        for name in ("kv_dtype", "state_dtype", "temporal_state_dtype"):
            v = getattr(self, name)
            if v is None and name == "temporal_state_dtype":
                continue
            try:
                dt = parse_dtype(v) if isinstance(v, str) else None
            except InvalidArgumentError:
                dt = None
            if dt is None or not dt.is_floating_point:
                raise InvalidArgumentError(f"EngineConfig.{name} must name a floating torch dtype, got {v!r}")
        from radixkv.cache.eviction import available_policies

        if not isinstance(self.eviction_policy, str) or self.eviction_policy not in available_policies():
            raise InvalidArgumentError(
                f"EngineConfig.eviction_policy must be one of {available_policies()}, got {self.eviction_policy!r}")
        if self.admission_policy not in ADMISSION_POLICIES:
            raise InvalidArgumentError(
                f"EngineConfig.admission_policy must be one of {list(ADMISSION_POLICIES)}, "
                f"got {self.admission_policy!r}")
        for name in ("enable_kv_events", "checks"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgumentError(f"EngineConfig.{name} must be a bool, got {getattr(self, name)!r}")
        ttl = self.lease_ttl_s
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not math.isfinite(ttl) or ttl <= 0:
            raise InvalidArgumentError(f"EngineConfig.lease_ttl_s must be a finite number > 0, got {ttl!r}")
        object.__setattr__(self, "lease_ttl_s", float(ttl))

    def _check_state_dims(self) -> None:
        """``conv_state_dims`` / ``temporal_state_dims``: both or neither, each a non-empty
        sequence of ints >= 1 (JSON lists become tuples)."""
        given = [n for n in ("conv_state_dims", "temporal_state_dims") if getattr(self, n) is not None]
        if len(given) == 1:
            raise InvalidArgumentError(f"EngineConfig.{given[0]} needs the other of conv_state_dims / "
                                       "temporal_state_dims")
        for name in given:
            v = getattr(self, name)
            if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)) or not v or any(
                    isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in v):
                raise InvalidArgumentError(f"EngineConfig.{name} must be a non-empty sequence of ints >= 1, "
                                           f"got {v!r}")
            object.__setattr__(self, name, tuple(v))

    def _check_tiers(self) -> None:
        if self.host_kv_tokens % self.page_size:
            raise InvalidArgumentError(f"EngineConfig.host_kv_tokens ({self.host_kv_tokens}) must be a multiple "
                                       f"of page_size ({self.page_size})")
        if self.host_kv_tokens and "K" in str(self.layer_types):  # a hybrid model's KV: beside its states
            if not self.host_state_slots:
                raise InvalidArgumentError("EngineConfig.host_kv_tokens: a hybrid model's host KV tier needs "
                                           "host_state_slots > 0 (host KV is kept only with a state)")
        if self.host_state_slots and "K" not in str(self.layer_types):
            raise InvalidArgumentError("EngineConfig.host_state_slots needs a hybrid model (a 'K' in "
                                       "layer_types): a KV-only model has no states")
        if self.write_policy not in WRITE_POLICIES:
            raise InvalidArgumentError(f"EngineConfig.write_policy must be one of {list(WRITE_POLICIES)}, "
                                       f"got {self.write_policy!r}")
        if self.storage_admit not in STORAGE_ADMIT:
            raise InvalidArgumentError(f"EngineConfig.storage_admit must be one of {list(STORAGE_ADMIT)}, "
                                       f"got {self.storage_admit!r}")
        if self.storage is not None:
            if not isinstance(self.storage, str) or "://" not in self.storage:
                raise InvalidArgumentError(f"EngineConfig.storage must be a URL (scheme://...), got {self.storage!r}")
            if not self.host_kv_tokens:
                raise InvalidArgumentError("EngineConfig.storage needs the host tier (host_kv_tokens > 0)")
        for name in ("storage_timeout_ms", "storage_drain_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise InvalidArgumentError(f"EngineConfig.{name} must be a finite number >= 0, got {v!r}")
            object.__setattr__(self, name, float(v))

    def _check_device(self) -> None:
        import torch

        d = self.device
        try:
            dev = torch.device(d) if isinstance(d, str) else None
        except (RuntimeError, ValueError):
            dev = None
        if dev is None or dev.type not in ("cpu", "cuda"):
            raise InvalidArgumentError(f"EngineConfig.device must be 'cpu', 'cuda' or 'cuda:N', got {d!r}")

    # ------------------------------------------------------------------ derived
    @property
    def torch_device(self) -> torch.device:
        import torch

        return torch.device(self.device)

    @property
    def is_hybrid(self) -> bool:
        """Whether the model has KDA layers (then requests also hold a state slot)."""
        return "K" in self.layer_types

    @property
    def is_mla(self) -> bool:
        """Whether the full-attention layers keep MLA latents (``kv_lora_rank > 0``)."""
        return self.kv_lora_rank > 0

    @property
    def track_interval(self) -> int | None:
        """The state-tracking interval of a hybrid config (``None``: no tracking)."""
        iv = self.mamba_track_interval
        if not self.is_hybrid or iv == 0 or (iv is None and self.page_size == 1):
            return None
        return iv or self.page_size

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def full_layer_ids(self) -> tuple[int, ...]:
        """Global ids of the full-attention layers (KV layer ``i`` is the ``i``-th)."""
        return tuple(i for i, c in enumerate(self.layer_types) if c == "F")

    @property
    def kda_layer_ids(self) -> tuple[int, ...]:
        """Global ids of the KDA layers (Mamba layer ``i`` is the ``i``-th)."""
        return tuple(i for i, c in enumerate(self.layer_types) if c == "K")

    @property
    def conv_state_shape(self) -> tuple[int, ...]:
        """Per-slot conv state of one state layer: ``conv_state_dims`` when given, else the KDA
        ``(conv_kernel - 1, 3 * heads * head_dim)`` (q|k|v channels concatenated:
        ``KimiLinearStateShape.pool_conv``, the reference model)."""
        if self.conv_state_dims is not None:
            return tuple(self.conv_state_dims)
        return (self.conv_kernel - 1, 3 * self.kda_num_heads * self.kda_head_dim)

    @property
    def temporal_state_shape(self) -> tuple[int, ...]:
        """Per-slot recurrent state of one state layer: ``temporal_state_dims`` when given,
        else the KDA ``(heads, head_dim, head_dim)``."""
        if self.temporal_state_dims is not None:
            return tuple(self.temporal_state_dims)
        return (self.kda_num_heads, self.kda_head_dim, self.kda_head_dim)

    @property
    def temporal_dtype(self) -> str:
        """The recurrent state's dtype: ``temporal_state_dtype``, else ``state_dtype``."""
        return self.temporal_state_dtype or self.state_dtype

    # ------------------------------------------------------------------ plain data
    def to_dict(self) -> dict[str, Any]:
        """Every field as plain JSON-able data."""
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineConfig:
        """A config from plain data; missing fields take their defaults.

        Raises ``InvalidArgumentError`` for a non-dict, unknown field names (listed) or a
        bad value."""
        if not isinstance(d, dict):
            raise InvalidArgumentError(f"an engine config must be a dict, got {type(d).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in d if k not in names)
        if unknown:
            raise InvalidArgumentError(f"unknown EngineConfig fields: {unknown}")
        return cls(**d)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> EngineConfig:
        """Load a ``.json`` or ``.toml`` file: the fields at top level, or under an
        ``engine`` table/object. Raises ``InvalidArgumentError`` for an unreadable or
        malformed file, another extension, or bad fields."""
        p = os.fspath(path)
        ext = os.path.splitext(p)[1].lower()
        try:
            if ext == ".json":
                with open(p, encoding="utf-8") as f:
                    data = json.load(f)
            elif ext == ".toml":
                if sys.version_info >= (3, 11):
                    import tomllib

                    with open(p, "rb") as f:
                        data = tomllib.load(f)
                else:
                    raise InvalidArgumentError(f"reading {p!r} needs Python 3.11 (tomllib); use a .json config")
            else:
                raise InvalidArgumentError(f"config file must end in .json or .toml, got {p!r}")
        except (OSError, ValueError) as e:
            if isinstance(e, InvalidArgumentError):
                raise
            raise InvalidArgumentError(f"cannot read engine config {p!r}: {e}") from None
        if isinstance(data, dict) and set(data) == {"engine"} and isinstance(data["engine"], dict):
            data = data["engine"]
        return cls.from_dict(data)

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with ``changes`` applied (validated; unknown names raise)."""
        names = {f.name for f in fields(self)}
        unknown = sorted(k for k in changes if k not in names)
        if unknown:
            raise InvalidArgumentError(f"unknown EngineConfig fields: {unknown}")
        return dataclasses.replace(self, **changes)
