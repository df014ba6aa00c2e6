"""Shared pool buffers: 0600 files mapped shared, aliasing across mappings, cleanup."""
import os
import stat

import pytest
import torch
from radixkv.service.wire.shm import (
    SharedBuffers,
    ShmDescriptor,
    create_shm_buffer,
    export_cuda_buffer,
    import_cuda_buffer,
    map_shm_buffer,
)

from radixkv.errors import InvalidArgumentError, InvariantError, PermissionDeniedError

POOL = "radixkv-1-0123abcd-kv.buf"  # a manager's pool-file name


def test_create_is_0600_zeroed_and_aliases_a_second_mapping(tmp_path):
    t, d = create_shm_buffer(str(tmp_path), POOL, 4096)
    st = os.stat(d.path)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == 4096
    assert t.dtype == torch.uint8 and t.numel() == 4096 and int(t.sum()) == 0
    assert t.data_ptr() % 256 == 0
    other = map_shm_buffer(d)
    t[10:20] = 7
    assert int(other[10:20].sum()) == 70  # the same bytes
    other[100] = 3
    assert int(t[100]) == 3


def test_create_never_reuses_a_file(tmp_path):
    create_shm_buffer(str(tmp_path), POOL, 64)
    with pytest.raises(InvalidArgumentError, match="cannot create"):
        create_shm_buffer(str(tmp_path), POOL, 64)
    with pytest.raises(InvalidArgumentError):
        create_shm_buffer(str(tmp_path), "../evil", 64)
    with pytest.raises(InvalidArgumentError):
        create_shm_buffer(str(tmp_path), "y.buf", 0)


def test_map_refuses_wider_modes_missing_and_short_files(tmp_path):
    _, d = create_shm_buffer(str(tmp_path), POOL, 64)
    os.chmod(d.path, 0o644)
    with pytest.raises(PermissionDeniedError):
        map_shm_buffer(d)
    os.chmod(d.path, 0o600)
    with pytest.raises(InvalidArgumentError, match="has 64 bytes"):
        map_shm_buffer(ShmDescriptor(d.path, 128))
    with pytest.raises(InvalidArgumentError, match="cannot be opened"):
        map_shm_buffer(ShmDescriptor(str(tmp_path / "radixkv-1-0123abcd-nope.buf"), 64))


def test_map_refuses_what_is_not_a_managers_pool_file(tmp_path):
    """A fake manager names files of its choosing (issue 17, item 3): only a regular file
    with the pool-file name, reached without a link, of exactly the stated size, 0600 and
    this user's is mapped."""
    secret = tmp_path / "id_rsa"  # this user's, 0600: what a fake manager would name
    secret.write_bytes(b"k" * 64)
    os.chmod(secret, 0o600)
    with pytest.raises(InvalidArgumentError, match="not a manager's pool file"):
        map_shm_buffer(ShmDescriptor(str(secret), 64))
    link = tmp_path / "radixkv-1-0123abcd-kv.buf"
    link.symlink_to(secret)
    with pytest.raises(InvalidArgumentError, match="no link is followed"):
        map_shm_buffer(ShmDescriptor(str(link), 64))
    with pytest.raises(InvalidArgumentError, match="not a manager's pool file"):
        map_shm_buffer(ShmDescriptor(str(tmp_path / "sub" / ".." / "radixkv-1-0123abcd-kv.buf"), 64))
    _, d = create_shm_buffer(str(tmp_path), "radixkv-2-0123abcd-kv.buf", 128)
    with pytest.raises(InvalidArgumentError, match="the layout states 64"):
        map_shm_buffer(ShmDescriptor(d.path, 64))  # larger than stated: not the pool file
    with pytest.raises(PermissionDeniedError, match="uid"):
        map_shm_buffer(d, owner_uid=os.getuid() + 1)
    assert map_shm_buffer(d).numel() == 128
    assert secret.read_bytes() == b"k" * 64


def test_shared_buffers_lifecycle(tmp_path):
    sb = SharedBuffers("cpu", str(tmp_path), prefix="t")
    kv = sb.allocate("kv", 1024)
    sb.allocate("req_to_token", 512)
    with pytest.raises(InvalidArgumentError):
        sb.allocate("kv", 8)
    assert sb.descriptor("kv").nbytes == 1024 and kv.numel() == 1024
    sb.check_invariants()
    os.chmod(sb.paths()["kv"], 0o644)
    with pytest.raises(InvariantError, match="kv"):
        sb.check_invariants()
    paths = list(sb.paths().values())
    sb.close()
    sb.close()  # idempotent
    assert not any(os.path.exists(p) for p in paths)
    kv[0] = 1  # an existing mapping stays valid
    with pytest.raises(InvalidArgumentError):
        sb.allocate("mamba", 8)


def test_shared_buffers_refuse_a_missing_directory(tmp_path):
    with pytest.raises(InvalidArgumentError):
        SharedBuffers("cpu", str(tmp_path / "missing"))


def test_export_refuses_cpu_tensors():
    with pytest.raises(InvalidArgumentError):
        export_cuda_buffer(torch.zeros(8, dtype=torch.uint8))


def _import_and_fill(desc, value, q):
    t = import_cuda_buffer(desc)
    t[: desc.nbytes // 2] = value
    torch.cuda.synchronize()
    q.put(int(t[desc.nbytes - 1]))


@pytest.mark.cuda
def test_cuda_ipc_buffer_aliases_across_processes():
    import multiprocessing as mp

    sb = SharedBuffers("cuda")
    t = sb.allocate("kv", 1 << 20)
    t[-1] = 9
    torch.cuda.synchronize()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_import_and_fill, args=(sb.descriptor("kv"), 5, q))
    p.start()
    try:
        assert q.get(timeout=120) == 9
        p.join(60)
        assert p.exitcode == 0
        torch.cuda.synchronize()
        assert int(t[0]) == 5 and int(t[(1 << 19) - 1]) == 5 and int(t[1 << 19]) == 0
    finally:
        if p.is_alive():
            p.kill()
        sb.close()


def test_remove_stale_files_only_takes_dead_managers_files(tmp_path):
    import multiprocessing as mp

    from radixkv.service.wire.shm import remove_stale_files

    p = mp.get_context("spawn").Process(target=int)
    p.start()
    p.join(60)
    dead = p.pid  # finished: no such process any more (unless the pid was reused at once)
    mine = os.getpid()
    names = [f"radixkv-{dead}-0123abcd-kv.buf", f"radixkv-{dead}-0123abcd-req_to_token.buf",
             f"radixkv-{mine}-0123abcd-kv.buf", "radixkv-notapid-0123abcd-kv.buf", "other.buf"]
    for n in names:
        (tmp_path / n).write_bytes(b"x")
    removed = sorted(os.path.basename(x) for x in remove_stale_files(str(tmp_path)))
    assert removed == sorted(names[:2])
    assert sorted(os.listdir(tmp_path)) == sorted(names[2:])


def test_hybrid_pools_over_shared_files_alias_a_workers_mapping(tmp_path):
    """Every pool of a hybrid model (req_to_token, KV, Mamba states) built over shared files;
    a second mapping of the same files (what a worker makes) sees and makes the same writes."""
    from radixkv.service.wire import codec as wire
    from radixkv.service.wire.shm import map_buffer

    from radixkv.engine import EngineConfig, EnginePools, attach_buffers, plan_arenas

    cfg = EngineConfig(layer_types="KF", kv_tokens=64, state_slots=4, request_rows=4, max_context_len=32,
                       kda_head_dim=8)
    sb = SharedBuffers("cpu", str(tmp_path), prefix="radixkv-1-0123abcd")
    for name, plan in plan_arenas(cfg).items():
        sb.allocate(name, plan.total_bytes)
    assert sorted(sb.descriptors) == ["kv", "mamba", "req_to_token"]
    pools = EnginePools(cfg, dict(sb.buffers))
    layout = pools.layout({n: wire.descriptor_to_dict(d) for n, d in sb.descriptors.items()})
    mapped = {n: map_buffer(wire.descriptor_from_dict(p["mapping"])) for n, p in layout["pools"].items()}
    wb = attach_buffers(layout, mapped)
    wb.check_invariants()
    cache = wb.mamba2_layer_cache(0)
    cache.temporal[2].fill_(3.5)
    assert torch.equal(pools.mamba_pool.mamba2_layer_cache(0).temporal[2],
                       torch.full_like(cache.temporal[2], 3.5))
    pools.req_to_token_pool.req_to_token[1, :3] = torch.tensor([7, 8, 9], dtype=torch.int32)
    assert wb.req_to_token[1, :3].tolist() == [7, 8, 9]
    wb.set_kv_buffer(1, torch.tensor([5]), torch.ones(1, cfg.head_num, cfg.head_dim),
                     torch.zeros(1, cfg.head_num, cfg.head_dim))
    assert float(pools.kv_pool.get_key_buffer(0)[5].sum()) == cfg.head_num * cfg.head_dim
    sb.close()


def test_a_live_managers_set_is_never_swept_whatever_its_pid(tmp_path):
    """Ownership is the set's flock, not its pid (issue 17, item 4): a manager in another pid
    namespace has a pid that names no process here, and its files must stay; once no process
    holds the lock (the manager died), the set and its lock file go."""
    from radixkv.service.wire.shm import remove_stale_files

    unseen = "radixkv-4194399-0123abcd"  # above any pid_max: no process here has this pid
    sb = SharedBuffers("cpu", str(tmp_path), prefix=unseen)
    sb.allocate("kv", 64)
    assert sorted(os.listdir(tmp_path)) == [unseen + "-kv.buf", unseen + ".lock"]
    assert remove_stale_files(str(tmp_path)) == []
    sb.check_invariants()
    os.close(sb._lock_fd)  # the manager dies: its lock goes with its fds
    sb._lock_fd = None
    removed = sorted(os.path.basename(p) for p in remove_stale_files(str(tmp_path)))
    assert removed == [unseen + "-kv.buf", unseen + ".lock"] and os.listdir(tmp_path) == []
    sb.close()  # the files are gone already: fine
