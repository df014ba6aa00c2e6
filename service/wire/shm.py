"""Shared pool buffers: one allocation per pool, made once by the manager, mapped by workers.

CPU: each pool's buffer is a 0600 file in ``/dev/shm`` (or a configured directory), created
``O_EXCL``, its space reserved with ``posix_fallocate`` (a pool the directory cannot back is
refused at once with :class:`~radixkv.errors.SharedMemorySpaceError`, never a sparse file
that SIGBUSes later) and mapped with ``torch.from_file(..., shared=True)``, page aligned. The
manager removes the files at shutdown (a worker's mapping lasts until it exits).

CUDA: the manager exports its device buffer with the plain fields of ``reduce_tensor`` (IPC
handles, offsets); a worker rebuilds it with ``rebuild_cuda_tensor``. Nothing is pickled.

Descriptors (:class:`ShmDescriptor`, :class:`CudaIpcDescriptor`) are NamedTuples of plain
values; :mod:`radixkv.service.wire.codec` turns them into ``PoolMapping`` messages. The
reasons: ``docs/service.md`` ("Shared pool buffers").
"""
from __future__ import annotations

import errno
import fcntl
import importlib
import os
import re
import stat
import tempfile
from typing import TYPE_CHECKING, Any, NamedTuple

from radixkv.errors import InvalidArgumentError, InvariantError, PermissionDeniedError, SharedMemorySpaceError

if TYPE_CHECKING:  # torch loads where a buffer is mapped: the codec imports the descriptors only
    import torch

DEFAULT_SHM_DIR = "/dev/shm"
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
#: Names of the manager's pool files: ``radixkv-<pid>-<8 hex>-<pool>.buf``, and of the lock
#: file of the set: ``radixkv-<pid>-<8 hex>.lock``.
_MANAGER_FILE_RE = re.compile(r"^(?P<set>radixkv-\d+-[0-9a-f]{8})-[A-Za-z0-9_]+\.buf$")
_LOCK_FILE_RE = re.compile(r"^(?P<set>radixkv-\d+-[0-9a-f]{8})\.lock$")


class ShmDescriptor(NamedTuple):
    """A pool buffer in a shared-memory file: map ``nbytes`` bytes of ``path``."""

    path: str
    nbytes: int


class CudaIpcDescriptor(NamedTuple):
    """A pool buffer exported through CUDA IPC (the plain fields of ``reduce_tensor``)."""

    device_index: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    tensor_offset: int
    nbytes: int


Descriptor = ShmDescriptor | CudaIpcDescriptor


def default_shm_dir() -> str:
    """``/dev/shm`` where it exists (Linux), else the temp directory."""
    return DEFAULT_SHM_DIR if os.path.isdir(DEFAULT_SHM_DIR) else tempfile.gettempdir()


def _check_size(nbytes: int) -> int:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
        raise InvalidArgumentError(f"a shared buffer needs a positive int size, got {nbytes!r}")
    return nbytes


def space_free(directory: str) -> int:
    """Bytes an unprivileged user may still allocate in ``directory``'s filesystem (statvfs)."""
    st = os.statvfs(directory)
    return int(st.f_bavail) * int(st.f_frsize)


def check_space(directory: str, nbytes: int, what: str = "the pools") -> None:
    """Raise :class:`SharedMemorySpaceError` (naming the directory, ``nbytes`` and the bytes
    free) when ``directory`` has less than ``nbytes`` free. O(1): one statvfs."""
    free = space_free(directory)
    if nbytes > free:
        raise SharedMemorySpaceError.in_directory(directory, nbytes, free, what)


def _create_shm_file(directory: str, name: str, nbytes: int) -> tuple[int, str]:
    """Create the 0600 file ``name`` and reserve its ``nbytes`` (``posix_fallocate``: the
    pages exist once it returns, so no later write can fault). Returns ``(fd, path)``; the
    caller closes the fd. Nothing is left behind when it raises."""
    _check_size(nbytes)
    if not _NAME_RE.match(name):
        raise InvalidArgumentError(f"shared buffer name {name!r} must be letters, digits, '_', '.', '-'")
    path = os.path.join(directory, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise InvalidArgumentError(f"cannot create shared buffer {path!r}: {e.strerror}") from None
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, nbytes)
        else:  # no reservation on this platform (macOS): a sparse file, as before
            os.ftruncate(fd, nbytes)
    except OSError as e:
        os.close(fd)
        os.unlink(path)
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise SharedMemorySpaceError.in_directory(directory, nbytes, space_free(directory),
                                                     f"shared buffer {name!r}") from None
        raise InvalidArgumentError(f"cannot size shared buffer {path!r} to {nbytes} bytes: {e.strerror}") from None
    return fd, path


def create_shm_buffer(directory: str, name: str, nbytes: int) -> tuple[torch.Tensor, ShmDescriptor]:
    """Create a new 0600 shared-memory file of ``nbytes`` zero bytes, reserved, and map it.

    Returns the ``uint8`` tensor (1-D, ``nbytes`` long) and its descriptor.

    Raises:
        InvalidArgumentError: bad name or size, or the file already exists / cannot be made.
        SharedMemorySpaceError: the directory has less than ``nbytes`` free.
    """
    fd, path = _create_shm_file(directory, name, nbytes)
    os.close(fd)
    return _map_new(path, nbytes), ShmDescriptor(path, nbytes)


def _map_new(path: str, nbytes: int) -> torch.Tensor:
    import torch

    try:
        return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    except Exception:
        os.unlink(path)
        raise


def _load_sigbus_guard() -> Any:
    """The optional C extension ``radixkv.service.wire._sigbus`` (csrc/sigbus.c), or None."""
    try:
        return importlib.import_module("radixkv.service.wire._sigbus")
    except ImportError:
        return None


_SIGBUS = _load_sigbus_guard()
#: Whether a pool file shrunk under this process is repaired on SIGBUS (else only by
#: :meth:`SharedBuffers.repair_truncated`, which the manager's sweeper calls).
SIGBUS_GUARD = _SIGBUS is not None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def lock_set(directory: str, prefix: str) -> int:
    """Create and ``flock`` the lock file ``<prefix>.lock`` of a manager's pool set; returns
    its fd, which the manager holds (the lock with it) until it exits, whatever its pid
    namespace. Raises ``InvalidArgumentError`` when it exists or cannot be made."""
    path = os.path.join(directory, prefix + ".lock")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise InvalidArgumentError(f"cannot create the pool lock file {path!r}: {e.strerror}") from None
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: nobody else holds it
    return fd


def _set_is_locked(directory: str, prefix: str) -> bool | None:
    """Whether a live manager holds the lock of set ``prefix`` (None: the set has no lock
    file, an older manager's)."""
    try:
        fd = os.open(os.path.join(directory, prefix + ".lock"), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError:
        return True  # cannot tell: leave it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)  # drops the lock if this call took it


def remove_stale_files(directory: str) -> list[str]:
    """Remove pool files left by managers that died without cleaning up (SIGKILL, crash):
    files named like a manager's (``radixkv-<pid>-<hex>-<pool>.buf``, and the set's
    ``radixkv-<pid>-<hex>.lock``), owned by this user, of sets whose lock no process holds.
    Ownership never depends on pids (a manager in another pid namespace holds its lock just
    the same); only a set without a lock file (an older manager's) is judged by its pid.
    Returns the removed paths. O(files in ``directory``)."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    sets: dict[str, list[str]] = {}
    for name in names:
        m = _MANAGER_FILE_RE.match(name) or _LOCK_FILE_RE.match(name)
        if m is not None:
            sets.setdefault(m.group("set"), []).append(name)
    for prefix, files in sets.items():
        locked = _set_is_locked(directory, prefix)
        if locked or (locked is None and _pid_alive(int(prefix.split("-")[1]))):
            continue
        for name in sorted(files, key=lambda n: n.endswith(".lock")):  # the lock file last
            path = os.path.join(directory, name)
            try:
                st = os.lstat(path)
                if st.st_uid == os.getuid() and stat.S_ISREG(st.st_mode):
                    os.unlink(path)
                    removed.append(path)
            except OSError:
                continue
    return removed


def map_shm_buffer(desc: ShmDescriptor, owner_uid: int | None = None) -> torch.Tensor:
    """Map a manager's shared-memory file: a ``uint8`` tensor aliasing its bytes. O(1) (mmap).

    Only a manager's pool file is mapped (the descriptor comes from whatever answers at the
    address, so it is checked as hostile): an absolute path whose name has the pool-file
    pattern (``radixkv-<pid>-<hex>-<pool>.buf``), opened without following a link, a regular
    file owned by ``owner_uid`` (default: this user) with mode exactly 0600 and exactly
    ``desc.nbytes`` bytes. The checks and the mapping are of the same open file (mapped
    through ``/proc/self/fd``), so the name cannot be swapped in between. Raises
    ``InvalidArgumentError`` (missing, not a pool file, not of the stated size) or
    ``PermissionDeniedError`` (not the owner's, or its mode is not 0600).
    """
    import torch

    _check_size(int(desc.nbytes))
    path = str(desc.path)
    if not os.path.isabs(path) or os.path.normpath(path) != path or \
            not _MANAGER_FILE_RE.match(os.path.basename(path)):
        raise InvalidArgumentError(f"shared buffer {path!r} is not a manager's pool file "
                                   "(an absolute radixkv-<pid>-<hex>-<pool>.buf path)")
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise InvalidArgumentError(f"shared buffer {path!r} cannot be opened (no link is followed): "
                                   f"{e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidArgumentError(f"shared buffer {path!r} is not a regular file")
        uid = os.getuid() if owner_uid is None else int(owner_uid)
        if st.st_uid != uid or st.st_mode & 0o777 != 0o600:
            raise PermissionDeniedError(
                f"shared buffer {path!r} must be owned by uid {uid} with mode 0600 "
                f"(uid {st.st_uid}, mode {oct(st.st_mode & 0o777)})")
        if st.st_size != desc.nbytes:
            raise InvalidArgumentError(
                f"shared buffer {path!r} has {st.st_size} bytes, the layout states {desc.nbytes}")
        return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=int(desc.nbytes), dtype=torch.uint8)
    finally:
        os.close(fd)


def export_cuda_buffer(buffer: torch.Tensor) -> CudaIpcDescriptor:
    """Export a CUDA ``uint8`` buffer through CUDA IPC (plain fields, no pickle).

    Raises:
        InvalidArgumentError: not a 1-D contiguous CUDA uint8 tensor.
    """
    import torch

    if not (isinstance(buffer, torch.Tensor) and buffer.is_cuda and buffer.dtype == torch.uint8
            and buffer.dim() == 1 and buffer.is_contiguous()):
        raise InvalidArgumentError("a CUDA IPC export needs a 1-D contiguous CUDA uint8 tensor")
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(buffer)  # type: ignore[no-untyped-call]  # torch leaves it unannotated
    (_tcls, size, _stride, tensor_offset, _scls, _dtype, device, handle, storage_size_bytes,
     storage_offset_bytes, _rg, ref_counter_handle, ref_counter_offset, event_handle,
     event_sync_required) = args
    return CudaIpcDescriptor(
        device_index=int(device), handle=bytes(handle), storage_size_bytes=int(storage_size_bytes),
        storage_offset_bytes=int(storage_offset_bytes), ref_counter_handle=bytes(ref_counter_handle),
        ref_counter_offset=int(ref_counter_offset), event_handle=bytes(event_handle or b""),
        event_sync_required=bool(event_sync_required), tensor_offset=int(tensor_offset),
        nbytes=int(size[0]))


def import_cuda_buffer(desc: CudaIpcDescriptor) -> torch.Tensor:
    """Open a manager's CUDA IPC export: a ``uint8`` tensor over the same device memory."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    tensor: torch.Tensor = rebuild_cuda_tensor(  # type: ignore[no-untyped-call]  # unannotated in torch
        torch.Tensor, torch.Size([int(desc.nbytes)]), (1,), int(desc.tensor_offset),
        torch.storage.TypedStorage, torch.uint8, int(desc.device_index), desc.handle,
        int(desc.storage_size_bytes), int(desc.storage_offset_bytes), False,
        desc.ref_counter_handle, int(desc.ref_counter_offset), desc.event_handle or None,
        bool(desc.event_sync_required))
    return tensor


def map_buffer(desc: Descriptor) -> torch.Tensor:
    """Map either kind of descriptor."""
    if isinstance(desc, ShmDescriptor):
        return map_shm_buffer(desc)
    if isinstance(desc, CudaIpcDescriptor):
        return import_cuda_buffer(desc)
    raise InvalidArgumentError(f"not a buffer descriptor: {type(desc).__name__}")


class SharedBuffers:
    """The manager's pool buffers: created once at start-up, removed at shutdown.

    ``allocate(pool, nbytes)`` makes one buffer per pool name on ``device`` (a 0600 file in
    ``shm_dir`` on CPU, its space reserved, device memory on CUDA) and remembers its
    descriptor; each file's fd stays open (``repair_truncated``, the SIGBUS guard). ``close()``
    removes every file (idempotent). ``check_invariants()``: every CPU file still exists with
    its size and mode 0600.
    """

    def __init__(self, device: str | torch.device, shm_dir: str | None = None, prefix: str = "radixkv"):
        import torch

        self.device = torch.device(device)
        self.shm_dir = shm_dir or default_shm_dir()
        self.prefix = prefix
        self.buffers: dict[str, torch.Tensor] = {}
        self.descriptors: dict[str, Descriptor] = {}
        self._closed = False
        self._lock_fd: int | None = None
        self._fds: dict[str, int] = {}  # pool -> its file, open while the buffers live
        self._faults_seen = _SIGBUS.repaired() if _SIGBUS is not None else 0
        if self.device.type == "cpu" and not os.path.isdir(self.shm_dir):
            raise InvalidArgumentError(f"shared-memory directory {self.shm_dir!r} does not exist")
        if self.device.type == "cpu" and _LOCK_FILE_RE.match(prefix + ".lock"):
            self._lock_fd = lock_set(self.shm_dir, prefix)  # a manager's set: held while it runs

    def allocate(self, pool: str, nbytes: int) -> torch.Tensor:
        """One zeroed buffer of ``nbytes`` for ``pool`` (a new name). Returns the tensor."""
        if self._closed:
            raise InvalidArgumentError("shared buffers are closed")
        if pool in self.buffers:
            raise InvalidArgumentError(f"pool {pool!r} already has a shared buffer")
        _check_size(nbytes)
        if self.device.type == "cuda":
            import torch

            t = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
            desc: Descriptor = export_cuda_buffer(t)
        elif self.device.type == "cpu":
            fd, path = _create_shm_file(self.shm_dir, f"{self.prefix}-{pool}.buf", nbytes)
            try:
                t = _map_new(path, nbytes)
            except BaseException:
                os.close(fd)
                raise
            self._fds[pool] = fd
            if _SIGBUS is not None:
                _SIGBUS.watch(fd, nbytes)
            desc = ShmDescriptor(path, nbytes)
        else:
            raise InvalidArgumentError(f"shared buffers on {self.device.type!r} devices are not supported")
        self.buffers[pool] = t
        self.descriptors[pool] = desc
        return t

    def descriptor(self, pool: str) -> Descriptor:
        """How a worker maps ``pool``'s buffer. CUDA buffers are exported afresh for each
        caller (each CUDA IPC import consumes one producer-side reference count)."""
        try:
            desc = self.descriptors[pool]
        except KeyError:
            raise InvalidArgumentError(f"no shared buffer for pool {pool!r}") from None
        if isinstance(desc, CudaIpcDescriptor):
            desc = export_cuda_buffer(self.buffers[pool])
        return desc

    def check_space(self, nbytes: int) -> None:
        """Refuse (:class:`SharedMemorySpaceError`) pools of ``nbytes`` in all that the
        directory cannot back now; a no-op on CUDA. Each file's reservation checks again."""
        if self.device.type == "cpu":
            check_space(self.shm_dir, nbytes)

    def repair_truncated(self) -> list[str]:
        """Give back its size to every pool file shrunk under this process (its lost pages
        read as zeros, so no access faults) and describe each; [] when none was. O(pools):
        one fstat each (~1 us). Counts the SIGBUS guard's repairs too."""
        found = []
        faults = _SIGBUS.repaired() - self._faults_seen if _SIGBUS is not None else 0
        if faults:
            self._faults_seen += faults
            found.append(f"{faults} access(es) faulted on a shrunk pool file (SIGBUS; the sizes were given back) "
                         f"among {sorted(self.paths().values())}")
        paths = self.paths()
        for pool, fd in self._fds.items():
            size, want = os.fstat(fd).st_size, self.descriptors[pool].nbytes
            if size < want:
                os.ftruncate(fd, want)
                found.append(f"pool file {paths[pool]!r} ({pool}) was cut to {size} of its {want} bytes")
        return found

    def paths(self) -> dict[str, str]:
        return {k: d.path for k, d in self.descriptors.items() if isinstance(d, ShmDescriptor)}

    def close(self) -> None:
        """Remove every shared-memory file (mappings already made stay valid). Idempotent."""
        self._closed = True
        for fd in self._fds.values():
            if _SIGBUS is not None:
                _SIGBUS.unwatch(fd)
            os.close(fd)
        self._fds.clear()
        for path in self.paths().values():
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        if self._lock_fd is not None:
            try:
                os.unlink(os.path.join(self.shm_dir, self.prefix + ".lock"))
            except FileNotFoundError:
                pass
            os.close(self._lock_fd)
            self._lock_fd = None

    def check_invariants(self) -> None:
        bad = []
        for pool, d in self.descriptors.items():
            if pool not in self.buffers or self.buffers[pool].numel() != d.nbytes:
                bad.append(pool)
            elif isinstance(d, ShmDescriptor) and not self._closed:
                try:
                    st = os.stat(d.path)
                except OSError:
                    bad.append(pool)
                    continue
                if st.st_size != d.nbytes or st.st_mode & 0o777 != 0o600:
                    bad.append(pool)
        if bad:
            raise InvariantError(f"shared buffers out of order (missing, resized or wrong mode): {sorted(bad)}")
