"""``radixkv bench hitrate --hybrid``: hit rates of the hybrid (KV + state) cache over a
grid of KV budgets x state-slot budgets x admission / state-eviction policies, as a JSON
document, markdown tables and a PNG plot (the replay is :mod:`radixkv.bench.hybrid_hitrate`).

The JSON keeps ``bench hitrate``'s keys and adds ``mode: "hybrid"``, the replay settings and
``kv_only`` (the KV-only RadixCache under the same budget); each result adds the state
budget and policies, the KV match, the tokens lost for lack of a state, state hits, FLOPs
saved and evictions. ``capacity_tokens`` is raised to the longest prompt + 1. ``--pages``
replays at each page size, ``--track on,off`` with and without state tracking,
``--host-state-slots`` with host state tiers of those sizes (0: off). Every field:
``docs/hitrate.md``, "The hybrid report" and "Hybrid mode"; the host tier: ``docs/tiers.md``.
"""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any, TypedDict

from radixkv.bench.belady import belady
from radixkv.bench.hybrid_hitrate import (
    HybridReplayResult,
    StatePolicy,
    configs_of,
    kv_budget,
    parse_state_policy,
    replay_flow,
    replay_tree,
    state_policy_label,
)
from radixkv.bench.progress import Progress, ProgressBar
from radixkv.errors import InvalidArgumentError

if TYPE_CHECKING:  # pragma: no cover
    from radixkv.bench.hitrate import Source

__all__ = ["HYBRID_ENGINES", "add_hybrid_arguments", "hybrid_settings", "measure_hybrid", "hybrid_tables",
           "plot_hybrid"]

#: ``--engine`` values of the hybrid mode
HYBRID_ENGINES = ("tree", "flow")


class HybridSettings(TypedDict):
    """What :func:`hybrid_settings` makes of the flags (the runs :func:`measure_hybrid` does)."""

    engine: str
    slots: list[int]
    chunk: int
    configs: list[tuple[str, StatePolicy, bool]]  # (admission, state policy, checkpoint)
    pages: list[int]
    tracks: list[bool]
    host_slots: list[int]
    host_kv_frac: float | None
    write_policy: str


def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if not vals or any(v < 0 for v in vals):
        raise argparse.ArgumentTypeError("state slots must be integers >= 0")
    return vals


def add_hybrid_arguments(parser: argparse.ArgumentParser) -> None:
    """The hybrid mode's options (added to ``bench hitrate``'s)."""
    g = parser.add_argument_group("hybrid mode (--hybrid): a KV-token budget and a state-slot budget")
    g.add_argument("--hybrid", action="store_true",
                   help="replay through the MambaRadixCache (KV + Mamba states); --engine tree (default) or flow")
    g.add_argument("--state-slots", type=_ints, default=[128, 512],
                   help="states the cache may keep (the running request's slot comes on top), comma-separated "
                        "(default 128,512)")
    g.add_argument("--admission", default="every,branch",
                   help="state admission policies: every, branch (default every,branch)")
    g.add_argument("--state-policy", default="lru,flop",
                   help="state eviction orders: lru, flop, flop:ALPHA (default lru,flop)")
    g.add_argument("--checkpoint", default="on",
                   help="Marconi's checkpoint at kv_prefix_len: on, off or on,off (default on)")
    g.add_argument("--chunk", type=int, default=8192, help="chunked-prefill size in tokens (default 8192)")
    g.add_argument("--pages", type=_ints, default=[1], help="page sizes of the replay, comma-separated (default 1)")
    g.add_argument("--track", default="on",
                   help="state tracking at page ends above page 1: on, off or on,off (default on)")
    g.add_argument("--host-state-slots", type=_ints, default=[0],
                   help="states of the host state tier behind the device slots, comma-separated (default 0: off)")


def hybrid_settings(args: argparse.Namespace) -> HybridSettings:
    """Validated hybrid settings from parsed flags. Raises InvalidArgumentError."""
    from radixkv.cache.hybrid.mamba_policies import ADMISSION_POLICIES

    engine = args.engine or "tree"
    if engine not in HYBRID_ENGINES:
        raise InvalidArgumentError(f"--hybrid runs --engine tree or flow, not {engine!r}")
    adm = [a.strip().lower() for a in args.admission.split(",") if a.strip()]
    bad = [a for a in adm if a not in ADMISSION_POLICIES]
    if not adm or bad:
        raise InvalidArgumentError(f"unknown admission policy {bad or adm!r}; known: every, branch")
    states = [parse_state_policy(p) for p in args.state_policy.split(",") if p.strip()]
    ck = {"on": True, "off": False}
    cks = [c.strip().lower() for c in args.checkpoint.split(",") if c.strip()]
    if not cks or any(c not in ck for c in cks):
        raise InvalidArgumentError(f"--checkpoint takes on, off or on,off; got {args.checkpoint!r}")
    if not states:
        raise InvalidArgumentError("--state-policy is empty")
    if args.chunk < 1:
        raise InvalidArgumentError(f"--chunk must be >= 1, got {args.chunk}")
    if args.page_size not in (None, 1):
        raise InvalidArgumentError("--hybrid takes its page sizes from --pages; drop --page-size")
    tracks = [c.strip().lower() for c in args.track.split(",") if c.strip()]
    if not tracks or any(c not in ck for c in tracks):
        raise InvalidArgumentError(f"--track takes on, off or on,off; got {args.track!r}")
    if 0 in args.pages:
        raise InvalidArgumentError("--pages must be >= 1")
    return {"engine": engine, "slots": list(args.state_slots), "chunk": int(args.chunk),
            "configs": configs_of(adm, states, [ck[c] for c in cks]), "pages": list(args.pages),
            "tracks": [ck[c] for c in tracks], "host_slots": list(getattr(args, "host_state_slots", [0])),
            "host_kv_frac": _host_kv_frac(args, engine), "write_policy": _write_policy(args)}


def _host_kv_frac(args: argparse.Namespace, engine: str) -> float | None:
    """``--host-capacity-frac`` in the hybrid mode: the host KV tier (engine tree only, with
    a host state tier). Raises InvalidArgumentError."""
    frac = getattr(args, "host_capacity_frac", None)
    if frac is None:
        return None
    if engine != "tree" or 0 in args.host_state_slots:
        raise InvalidArgumentError("--hybrid --host-capacity-frac runs --engine tree with --host-state-slots > 0 "
                                   "(a hybrid model keeps host KV only with a state)")
    return float(frac)


def _write_policy(args: argparse.Namespace) -> str:
    """``--write-policy`` (the host KV tier's; only with ``--host-capacity-frac``)."""
    from radixkv.bench.hitrate import check_tier_write_policy

    policy = str(getattr(args, "write_policy", "write_back"))
    check_tier_write_policy(policy, getattr(args, "host_capacity_frac", None))
    return policy


def _replay(src: Source, engine: str, max_prompt: int, cap: int, slots: int, chunk: int, adm: str | None,
            pol: StatePolicy, ckpt: bool, kv_policy: str, bar: ProgressBar, ps: int = 1,
            track: bool = True, host: int = 0, host_kv: int = 0,
            write_policy: str = "write_back") -> HybridReplayResult:
    if engine == "tree":
        return replay_tree(src.tokens(), cap, slots, chunk, adm, pol, ckpt, kv_policy, True, bar, ps, track, host,
                           host_kv, write_policy)
    return replay_flow(src.tokens(), max_prompt, cap, slots, chunk, adm, pol, ckpt, kv_policy, True, bar, ps, track,
                       host)


def measure_hybrid(src: Source, fracs: list[float], kv_policies: list[str], settings: HybridSettings,
                   show_progress: bool | None = None) -> dict[str, Any]:
    """Every (KV policy, capacity, state slots, admission, state policy, checkpoint) run and
    the KV-only reference per (KV policy, capacity), as the JSON document (module docstring)."""
    from radixkv.cache import RadixCache

    for p in kv_policies:
        RadixCache(None, None, eviction_policy=p)           # unknown names fail before any work
    bt, engine, chunk = src.blocks, settings["engine"], settings["chunk"]
    max_prompt = int(bt.prompt_len.max()) if len(bt.prompt_len) else 1
    doc: dict[str, Any] = {
        "mode": "hybrid", "trace": src.name, "requests": src.n_requests, "prompt_tokens": src.prompt_tokens,
        "unique_tokens": src.unique_tokens, "engine": engine, "chunk": chunk, "page_size": settings["pages"][0],
        "page_sizes": settings["pages"],
        "bounds": {
            "infinite_capacity": bt.infinite_hit_tokens() / src.prompt_tokens,
            "belady": {f"{f:g}": belady(bt, int(f * src.unique_tokens)).token_hit_rate for f in fracs},
        },
        "kv_only": [], "results": [],
    }
    for ps in settings["pages"]:
        tracks = settings["tracks"] if ps > 1 else [True]
        for pol in kv_policies:
            for f in fracs:
                cap = kv_budget(src.unique_tokens, f, max_prompt)
                with Progress(src.n_requests, f"kv-only {pol} @ {f:g}", enabled=show_progress) as bar:
                    r = _replay(src, engine, max_prompt, cap, 0, chunk, None, "lru", False, pol, bar, ps)
                doc["kv_only"].append({"policy": pol, "capacity_frac": f, "capacity_tokens": cap, "page_size": ps,
                                       "hit_tokens": r.hit_tokens,
                                       "token_hit_rate": r.hit_tokens / src.prompt_tokens,
                                       "evicted_tokens": r.evicted_tokens})
                runs = ((s, h, c, t) for s in settings["slots"] for h in settings.get("host_slots", [0])
                        for c in settings["configs"] for t in tracks)
                hf = settings.get("host_kv_frac")
                host_kv = 0 if hf is None else max(int(hf * src.unique_tokens) // ps * ps, ps)
                for slots, host, (adm, spol, ckpt), track in runs:
                    label = f"{pol} @ {f:g}, {slots}+{host} slots, {adm}+{state_policy_label(spol)}, page {ps}"
                    with Progress(src.n_requests, label, enabled=show_progress) as bar:
                        r = _replay(src, engine, max_prompt, cap, slots, chunk, adm, spol, ckpt, pol, bar,
                                    ps, track, host, host_kv, settings.get("write_policy", "write_back"))
                    row = _row(src, r, pol, f, cap, slots, adm, spol, ckpt, ps, track, host)
                    if hf is not None:  # the host KV tier (--host-capacity-frac)
                        row.update(host_capacity_frac=hf, host_kv_tokens=host_kv,
                                   write_policy=settings.get("write_policy", "write_back"))
                    doc["results"].append(row)
    return doc


def _row(src: Source, r: HybridReplayResult, pol: str, f: float, cap: int, slots: int, adm: str, spol: StatePolicy,
         ckpt: bool, ps: int = 1, track: bool = True, host: int = 0) -> dict[str, Any]:
    prompt, n = src.prompt_tokens, max(src.n_requests, 1)
    return {
        "policy": pol, "capacity_frac": f, "capacity_tokens": cap, "page_size": ps, "track": track,
        "state_slots": slots, "host_state_slots": host, "admission": adm, "state_policy": state_policy_label(spol),
        "checkpoint": ckpt,
        "hit_tokens": r.hit_tokens, "token_hit_rate": r.hit_tokens / prompt,
        "kv_hit_tokens": r.kv_hit_tokens, "kv_hit_rate": r.kv_hit_tokens / prompt,
        "lost_tokens": r.lost_tokens, "lost_rate": r.lost_tokens / prompt,
        "state_hits": r.state_hits, "state_hit_rate": r.state_hits / n,
        "flop_saved": r.flops_saved / r.flops_total if r.flops_total else 0.0,
        "evicted_tokens": r.evicted_tokens, "evicted_states": r.evicted_states,
        "states_end": r.states_end, "kv_tokens_end": r.kv_tokens_end,
    }


def _label(r: dict[str, Any], many_policies: bool) -> str:
    host = f" + {r['host_state_slots']} host" if r.get("host_state_slots") else ""
    if r.get("host_capacity_frac") is not None:
        wt = ", write_through" if r.get("write_policy") == "write_through" else ""
        host += f" (+ host KV {100 * r['host_capacity_frac']:g}%{wt})"
    s = f"{r['state_slots']}{host} slots, {r['admission']}+{r['state_policy']}{'+ckpt' if r['checkpoint'] else ''}"
    if r.get("page_size", 1) > 1:
        s = f"page {r['page_size']}{'' if r.get('track', True) else ' untracked'}: {s}"
    return f"{r['policy']}: {s}" if many_policies else s


def hybrid_tables(doc: dict[str, Any]) -> str:
    """Two markdown tables, capacities as columns: the token hit rate (with the KV-only
    reference and the bounds as last rows), then the KV-matched tokens lost for lack of a
    state, both in % of prompt tokens."""
    fracs = sorted({r["capacity_frac"] for r in doc["results"]} | {r["capacity_frac"] for r in doc["kv_only"]})
    many = len({r["policy"] for r in doc["kv_only"]}) > 1
    head = "| configuration | " + " | ".join(f"{100 * f:g}%" for f in fracs) + " |"
    rule = "| --- |" + " ---: |" * len(fracs)
    out = [f"{doc['trace']} (hybrid, {doc['engine']} replay, chunk {doc['chunk']}): {doc['requests']} requests, "
           f"{doc['prompt_tokens']} prompt tokens, {doc['unique_tokens']} unique", "",
           "token hit rate (% of prompt tokens skipped)", "", head, rule]
    for key, title in (("token_hit_rate", None), ("lost_rate", "KV-matched tokens lost for lack of a state (%)")):
        if title:
            out += ["", title, "", head, rule]
        rows: dict[str, dict[float, float]] = {}  # label -> capacity fraction -> rate
        for r in doc["results"]:
            rows.setdefault(_label(r, many), {})[r["capacity_frac"]] = r[key]
        for lab, row in rows.items():
            out.append(f"| {lab} | " + " | ".join(f"{100 * row[f]:.2f}" if f in row else "" for f in fracs) + " |")
    at = out.index(rule) + 1 + len({_label(r, many) for r in doc["results"]})
    tail = []
    for pol, ps in dict.fromkeys((r["policy"], r.get("page_size", 1)) for r in doc["kv_only"]):
        row = {r["capacity_frac"]: r["token_hit_rate"] for r in doc["kv_only"]
               if r["policy"] == pol and r.get("page_size", 1) == ps}
        tail.append(f"| kv-only radix{f' ({pol})' if many else ''}{f' page {ps}' if ps > 1 else ''} | "
                    + " | ".join(f"{100 * row[f]:.2f}" if f in row else "" for f in fracs) + " |")
    bel = {float(k): v for k, v in doc["bounds"]["belady"].items()}
    tail.append("| belady (KV, offline) | "
                + " | ".join(f"{100 * bel[f]:.2f}" if f in bel else "" for f in fracs) + " |")
    inf = 100 * doc["bounds"]["infinite_capacity"]
    tail.append("| infinite capacity | " + " | ".join(f"{inf:.2f}" for _ in fracs) + " |")
    return "\n".join(out[:at] + tail + out[at:])


def plot_hybrid(doc: dict[str, Any], path: str) -> str | None:
    """Token hit rate vs capacity, one line per configuration, with the KV-only reference
    and the bounds; returns a note when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: plot skipped"
    many = len({r["policy"] for r in doc["kv_only"]}) > 1
    fig, ax = plt.subplots(figsize=(10, 5))
    lines: dict[str, list[tuple[float, float]]] = {}  # label -> (capacity fraction, hit %)
    for r in doc["results"]:
        lines.setdefault(_label(r, many), []).append((r["capacity_frac"], 100 * r["token_hit_rate"]))
    for pol, ps in dict.fromkeys((r["policy"], r.get("page_size", 1)) for r in doc["kv_only"]):
        lines[f"kv-only radix ({pol}){f' page {ps}' if ps > 1 else ''}"] = [
            (r["capacity_frac"], 100 * r["token_hit_rate"]) for r in doc["kv_only"]
            if r["policy"] == pol and r.get("page_size", 1) == ps]
    for lab, pts in lines.items():
        pts.sort()
        style = "-." if lab.startswith("kv-only") else "-"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=lab)
    bel = sorted((float(k), 100 * v) for k, v in doc["bounds"]["belady"].items())
    ax.plot([b[0] for b in bel], [b[1] for b in bel], "k--", label="belady (KV, offline)")
    ax.axhline(100 * doc["bounds"]["infinite_capacity"], color="grey", linestyle=":", label="infinite capacity")
    ax.set_xscale("log")
    ax.set_xlabel("KV capacity (fraction of unique prompt tokens)")
    ax.set_ylabel("token hit rate (% of prompt tokens skipped)")
    ax.set_title(f"{doc['trace']} (hybrid)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
