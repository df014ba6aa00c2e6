"""Importing SGLang's cache modules for ``bench_vs_sglang.py`` from a ``pip install --no-deps
--target DIR`` directory, without its heavy dependencies: the top package's ``__init__`` is
not run, and the modules the timed paths never execute are replaced by placeholders that
raise when used (``PROFILES``). ``load_sglang`` reports every name read from a placeholder."""
from __future__ import annotations

import importlib
import os
import sys
import types
from typing import NamedTuple

__all__ = ["SGLANG_VERSION", "SGLANG_DEPS", "INSTALL_HINT", "INSTALL_HINT_MAMBA", "Profile", "PROFILES",
           "SGLang", "load_sglang", "forget_sglang"]

SGLANG_VERSION = "0.5.23"
SGLANG_DEPS = "orjson psutil pybase64 requests urllib3 idna certifi charset-normalizer starlette anyio sniffio"
INSTALL_HINT = (f"sglang not installed: pip install --no-deps --target DIR sglang=={SGLANG_VERSION} "
                f"{SGLANG_DEPS}; then pass --sglang-path DIR")
INSTALL_HINT_MAMBA = ("sglang 0.5.9 not found (0.5.23 has no MambaRadixCache): pip install --no-deps --target "
                      f"DIR sglang==0.5.9 {SGLANG_DEPS} tqdm safetensors; then --part mamba --sglang-path DIR")


# ----------------------------------------------------------------------------- loading SGLang
class _Shim(types.ModuleType):
    """A fake module: every name read from it is a placeholder class that raises when called
    (or instantiated); the names read are kept in ``_read`` for the report. With ``path`` it
    is a package whose real submodules still import from ``path`` (its ``__init__`` is not
    run)."""

    def __init__(self, name: str, path: str | None = None):
        super().__init__(name)
        self._read: list[str] = []
        if path is not None:
            self.__path__ = [path]

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        qual = f"{self.__name__}.{name}"

        def _unavailable(*_a, **_k):
            raise RuntimeError(f"{qual} is shimmed by bench_vs_sglang.py and must not run")

        value = type(name, (), {"__init__": _unavailable, "__call__": _unavailable})
        setattr(self, name, value)
        self._read.append(name)
        return value


class Profile(NamedTuple):
    """How one part imports SGLang from a ``pip --target`` directory: the file that must be
    there, packages whose ``__init__`` is skipped (bare, placeholder fallback for names), the
    modules replaced by placeholders, and the modules to import (short name -> module)."""

    needs: str
    bare: tuple
    shims: tuple
    modules: dict


MC = "sglang.srt.mem_cache."
PROFILES = {
    # SGLang 0.5.23: RadixCache / RadixKey over array('q') / the two allocators.
    "radix": Profile(
        "radix_cache.py", (),
        (MC + "memory_pool", "sglang.srt.observability.metrics_collector"),
        {"radix_cache": MC + "radix_cache", "params": MC + "cache_init_params",
         "base": MC + "base_prefix_cache", "alloc": MC + "allocator"}),
    # SGLang 0.5.9: MambaRadixCache and the real MambaPool (memory_pool), so its import
    # needs more skipped: model configs (transformers), NSA / quantization layers behind
    # the KV-pool classes (sgl_kernel, deep_gemm), the OpenAI protocol and HF helpers that
    # server_args imports, and the host (HiCache) pool.
    "mamba": Profile(
        "mamba_radix_cache.py", ("sglang.srt.configs",),
        ("sglang.srt.layers.attention.nsa.index_buf_accessor",
         "sglang.srt.layers.attention.nsa.quant_k_cache", "sglang.srt.layers.radix_attention",
         "sglang.srt.function_call.function_call_parser", "sglang.srt.entrypoints.openai.protocol",
         "sglang.srt.utils.hf_transformers_utils", "sglang.utils", MC + "memory_pool_host"),
        {"mamba_radix_cache": MC + "mamba_radix_cache", "radix_cache": MC + "radix_cache",
         "memory_pool": MC + "memory_pool", "mamba_utils": "sglang.srt.configs.mamba_utils",
         "server_args": "sglang.srt.server_args", "params": MC + "cache_init_params",
         "base": MC + "base_prefix_cache", "alloc": MC + "allocator"}),
}


class SGLang(NamedTuple):
    """The imported SGLang modules (``m.<short name>``) and how they were imported."""

    m: types.SimpleNamespace
    version: str
    location: str
    shims: dict


def sglang_modules(sg: SGLang | None) -> types.SimpleNamespace:
    """``sg.m``, for the SGLang side of a comparison (``RuntimeError`` when none was loaded)."""
    if sg is None:
        raise RuntimeError("the SGLang side of the comparison needs a loaded SGLang")
    return sg.m


def forget_sglang() -> None:
    for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
        del sys.modules[name]


def _import(profile: Profile) -> types.SimpleNamespace:
    return types.SimpleNamespace(**{k: importlib.import_module(v) for k, v in profile.modules.items()})


def load_sglang(path: str | None, part: str = "radix") -> SGLang | None:
    """Import what ``part`` (``radix`` / ``mamba``) needs from SGLang, or ``None`` when that
    SGLang is not there (or lacks the part's module: 0.5.23 has no MambaRadixCache).

    Without ``path``: a plain import of an installed SGLang (no shims). With ``path`` (a
    ``pip --target`` directory): appended to ``sys.path``, the top package as a bare
    namespace and ``PROFILES[part]``'s shims (see the module docstring)."""
    profile = PROFILES[part]
    if path is None:
        try:
            mods = _import(profile)
        except Exception:  # absent, or an install that cannot import on this machine
            forget_sglang()
            return None
        top = sys.modules["sglang"]
        if top.__file__ is None:  # a bare namespace, not an installed SGLang
            forget_sglang()
            return None
        return SGLang(mods, getattr(top, "__version__", "?"), os.path.dirname(top.__file__), {})
    root = os.path.abspath(path)
    pkg = os.path.join(root, "sglang")
    if not os.path.isfile(os.path.join(pkg, "srt", "mem_cache", profile.needs)):
        return None
    if root not in sys.path:
        sys.path.append(root)
    forget_sglang()
    top = types.ModuleType("sglang")
    top.__path__ = [pkg]
    sys.modules["sglang"] = top
    shims = {name: _Shim(name, os.path.join(root, *name.split("."))) for name in profile.bare}
    shims.update({name: _Shim(name) for name in profile.shims})
    sys.modules.update(shims)
    mods = _import(profile)
    version = importlib.import_module("sglang.version").__version__
    report = {"sglang": ["(package __init__ not run: bare namespace)"]}
    report.update({name: (["(package __init__ not run)"] if name in profile.bare else []) + list(s._read)
                   for name, s in shims.items()})
    return SGLang(mods, version, "DIR (--sglang-path)", report)
