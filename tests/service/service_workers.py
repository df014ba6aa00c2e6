"""Worker processes of the multi-process service tests (started with multiprocessing spawn).

Each reports through a queue and never blocks without a timeout. KV values are a pure
function of (token id, layer, head, dim), so a reader can check what a writer stored.
"""
from __future__ import annotations

import time
import traceback

import numpy as np
import torch


def kv_of(token_ids, layer: int, head_num: int, head_dim: int):
    """Deterministic K and V for ``token_ids`` in ``layer``: exact in float32."""
    t = torch.as_tensor(np.asarray(token_ids, dtype=np.int64), dtype=torch.float32).view(-1, 1, 1)
    h = torch.arange(head_num, dtype=torch.float32).view(1, -1, 1)
    d = torch.arange(head_dim, dtype=torch.float32).view(1, 1, -1)
    k = t * 1000 + layer * 100 + h * 10 + d
    return k, -k - 0.5


def _full_layers(wb):
    return [i for i, c in enumerate(wb.config.layer_types) if c == "F"]


def prefill_worker(address, token, rid, prompt, q):
    """Worker A: prefill ``prompt``, write its KV into the shared buffers, cache it."""
    try:
        from radixkv.service.client import connect

        from radixkv.engine.protocol import ExtendItem

        with connect(address, token=token, wait_s=60) as c:
            info = c.attach("worker-A")
            s = info.session
            wb = c.worker_buffers(info)
            r = c.alloc_extend(s, [ExtendItem(rid, np.asarray(prompt, dtype=np.int32))])[0]
            loc = torch.as_tensor(r.out_cache_loc)
            new = np.asarray(prompt[r.start:r.seq_len])
            for layer in _full_layers(wb):
                k, v = kv_of(new, layer, wb.config.head_num, wb.config.head_dim)
                wb.set_kv_buffer(layer, loc, k, v)
            cached = c.cache_finished(s, [rid])[0].cached_len
            c.detach(s)
        q.put(("ok", {"prefix_len": r.prefix_len, "cached_len": cached, "loc": r.out_cache_loc.tolist()}))
    except BaseException:
        q.put(("error", traceback.format_exc()))


def reuse_worker(address, token, rid, prompt, continuation, q):
    """Worker B: extend ``prompt + continuation``; read the reused rows straight from the
    shared buffers and compare them with what worker A wrote."""
    try:
        from radixkv.service.client import connect

        from radixkv.engine.protocol import ExtendItem

        with connect(address, token=token, wait_s=60) as c:
            info = c.attach("worker-B")
            s = info.session
            wb = c.worker_buffers(info)
            full = np.concatenate([np.asarray(prompt), np.asarray(continuation)]).astype(np.int32)
            r = c.alloc_extend(s, [ExtendItem(rid, full)])[0]
            rows = wb.req_to_token[r.req_pool_idx, :r.prefix_len].to(torch.int64)
            worst = 0.0
            for layer in _full_layers(wb):
                k_buf, v_buf = wb.get_kv_buffer(layer)
                k, v = kv_of(full[:r.prefix_len], layer, wb.config.head_num, wb.config.head_dim)
                worst = max(worst, float((k_buf[rows] - k).abs().max()), float((v_buf[rows] - v).abs().max()))
            c.release(s, [rid])
            c.detach(s)
        q.put(("ok", {"prefix_len": r.prefix_len, "start": r.start, "seq_len": r.seq_len,
                      "max_abs_diff": worst, "rows": rows.tolist()}))
    except BaseException:
        q.put(("error", traceback.format_exc()))


def holding_worker(address, token, keepalive, q):
    """Attach, start a request (prefill + decode) and hold it until killed."""
    try:
        from radixkv.service.client import connect

        from radixkv.engine.protocol import DecodeItem, ExtendItem

        c = connect(address, token=token, wait_s=60)
        s = c.attach("victim").session
        if keepalive:
            c.start_keepalive(s, interval_s=0.2)
        rid = f"victim-{'ka' if keepalive else 'lease'}"
        c.alloc_extend(s, [ExtendItem(rid, np.arange(500, 600, dtype=np.int32))])
        c.alloc_decode(s, [DecodeItem(rid, 7)])
        q.put(("holding", s.session_id))
    except BaseException:
        q.put(("error", traceback.format_exc()))
        return
    time.sleep(600)  # until SIGKILL


def loading_worker(address, token, tokens, q):
    """Attach with a keep-alive stream, report, then ask for a host-tier load (killed while
    it runs or right after)."""
    try:
        from radixkv.service.client import connect

        from radixkv.engine.protocol import ExtendItem

        c = connect(address, token=token, wait_s=60)
        s = c.attach("loader").session
        c.start_keepalive(s, interval_s=0.2)
        q.put(("loading", s.session_id))
        c.alloc_extend(s, [ExtendItem("load", np.asarray(tokens, dtype=np.int32))])
        q.put(("loaded", None))
    except BaseException:
        q.put(("error", traceback.format_exc()))
        return
    time.sleep(600)  # until SIGKILL
