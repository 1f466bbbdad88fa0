"""A small typed ctypes binding of the NVSHMEM host library (no compiled extension).

Only what afd needs: unique-id bootstrap, the symmetric heap, peer mapping, barriers.
The structure layouts are fixed by NVSHMEM's own ``static_assert``s (unique id 128 B,
unique-id args 24 B, init args 128 B, init attr 144 B) and each carries a version word
``(1 << 16) + sizeof(struct)``; both are asserted here at import. ``nvshmem_init``,
``nvshmemx_init_attr`` and ``nvshmem_finalize`` are header-inline (not exported), so
initialisation goes through ``nvshmemx_hostlib_init_attr`` / ``nvshmemx_hostlib_finalize``.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from afd_protocol import AFDError
from afd_transport_nvshmem.library import NvshmemUnavailable, find_host_library

INIT_WITH_UNIQUEID = 1 << 3
UNIQUEID_BYTES = 128


class UniqueId(ctypes.Structure):
    _fields_ = [("version", ctypes.c_int), ("internal", ctypes.c_char * 124)]


class UniqueIdArgs(ctypes.Structure):
    _fields_ = [
        ("version", ctypes.c_int),
        ("id", ctypes.POINTER(UniqueId)),
        ("myrank", ctypes.c_int),
        ("nranks", ctypes.c_int),
    ]


class InitArgs(ctypes.Structure):
    _fields_ = [
        ("version", ctypes.c_int),
        ("uid_args", UniqueIdArgs),
        ("content", ctypes.c_char * 96),
    ]


class InitAttr(ctypes.Structure):
    _fields_ = [("version", ctypes.c_int), ("mpi_comm", ctypes.c_void_p), ("args", InitArgs)]


STRUCT_SIZES: dict[type[ctypes.Structure], int] = {
    UniqueId: 128,
    UniqueIdArgs: 24,
    InitArgs: 128,
    InitAttr: 144,
}
for _struct, _size in STRUCT_SIZES.items():
    assert ctypes.sizeof(_struct) == _size, f"{_struct.__name__} must be {_size} bytes"


SIGNAL_SET = 9
"""``NVSHMEM_SIGNAL_SET``: a put-with-signal stores its value into the signal word."""
SIGNAL_ADD = 10
"""``NVSHMEM_SIGNAL_ADD``: a put-with-signal adds its value to the signal word."""
CMP_GE = 5
"""``NVSHMEM_CMP_GE``: a signal wait ends when the word is >= the value."""


def version_word(struct: type[ctypes.Structure]) -> int:
    return (1 << 16) + ctypes.sizeof(struct)


@dataclass(frozen=True)
class Function:
    """One exported C function: its name, return type and argument types."""

    name: str
    restype: Any
    argtypes: tuple[Any, ...]


_uid_p = ctypes.POINTER(UniqueId)
_attr_p = ctypes.POINTER(InitAttr)
_int_p = ctypes.POINTER(ctypes.c_int)

EXPORTED_FUNCTIONS: tuple[Function, ...] = (
    # int nvshmemx_get_uniqueid(nvshmemx_uniqueid_t *id)
    Function("nvshmemx_get_uniqueid", ctypes.c_int, (_uid_p,)),
    # int nvshmemx_set_attr_uniqueid_args(int myrank, int nranks,
    #                                     const nvshmemx_uniqueid_t *id,
    #                                     nvshmemx_init_attr_t *attr)
    Function(
        "nvshmemx_set_attr_uniqueid_args",
        ctypes.c_int,
        (ctypes.c_int, ctypes.c_int, _uid_p, _attr_p),
    ),
    # int nvshmemx_hostlib_init_attr(unsigned int flags, nvshmemx_init_attr_t *attr)
    Function("nvshmemx_hostlib_init_attr", ctypes.c_int, (ctypes.c_uint, _attr_p)),
    # void nvshmemx_hostlib_finalize(void)
    Function("nvshmemx_hostlib_finalize", None, ()),
    # void *nvshmem_malloc(size_t size)
    Function("nvshmem_malloc", ctypes.c_void_p, (ctypes.c_size_t,)),
    # void nvshmem_free(void *ptr)
    Function("nvshmem_free", None, (ctypes.c_void_p,)),
    # void *nvshmem_ptr(const void *dest, int pe)
    Function("nvshmem_ptr", ctypes.c_void_p, (ctypes.c_void_p, ctypes.c_int)),
    # int nvshmem_my_pe(void)
    Function("nvshmem_my_pe", ctypes.c_int, ()),
    # int nvshmem_n_pes(void)
    Function("nvshmem_n_pes", ctypes.c_int, ()),
    # void nvshmem_barrier_all(void)
    Function("nvshmem_barrier_all", None, ()),
    # void nvshmemx_vendor_get_version_info(int *major, int *minor, int *patch)
    Function("nvshmemx_vendor_get_version_info", None, (_int_p, _int_p, _int_p)),
    # void nvshmemx_putmem_signal_on_stream(void *dest, const void *source, size_t nelems,
    #                                       uint64_t *sig_addr, uint64_t signal, int sig_op,
    #                                       int pe, cudaStream_t cstrm)
    Function(
        "nvshmemx_putmem_signal_on_stream",
        None,
        (
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_void_p,
            ctypes.c_uint64,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_void_p,
        ),
    ),
    # int nvshmemx_cumodule_init(CUmodule module)
    Function("nvshmemx_cumodule_init", ctypes.c_int, (ctypes.c_void_p,)),
    # int nvshmemx_cumodule_finalize(CUmodule module)
    Function("nvshmemx_cumodule_finalize", ctypes.c_int, (ctypes.c_void_p,)),
    # void nvshmemx_quiet_on_stream(cudaStream_t cstrm)
    Function("nvshmemx_quiet_on_stream", None, (ctypes.c_void_p,)),
    # void nvshmemx_signal_wait_until_on_stream(uint64_t *sig_addr, int cmp,
    #                                           uint64_t cmp_value, cudaStream_t cstream)
    Function(
        "nvshmemx_signal_wait_until_on_stream",
        None,
        (ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_void_p),
    ),
)
"""Every entry point afd uses, with the C prototype it binds (from NVSHMEM's headers)."""


def check_status(status: int, call: str, hint: str = "") -> None:
    """Raise :class:`AFDError` naming ``call`` when an NVSHMEM status is not 0 (success)."""
    if status != 0:
        raise AFDError(f"{call} failed with status {status}{'; ' + hint if hint else ''}")


class NvshmemLibrary:
    """The loaded host library with typed entry points (:data:`EXPORTED_FUNCTIONS`)."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else find_host_library()
        try:
            lib = ctypes.CDLL(str(self.path), mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            raise NvshmemUnavailable(f"cannot load {self.path}: {exc}") from exc
        self._fn: dict[str, Any] = {}
        for function in EXPORTED_FUNCTIONS:
            try:
                fn = getattr(lib, function.name)
            except AttributeError:
                raise NvshmemUnavailable(f"{self.path} does not export {function.name}") from None
            fn.restype = function.restype
            fn.argtypes = list(function.argtypes)
            self._fn[function.name] = fn

    def version(self) -> tuple[int, int, int]:
        major, minor, patch = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        self._fn["nvshmemx_vendor_get_version_info"](
            ctypes.byref(major), ctypes.byref(minor), ctypes.byref(patch)
        )
        return major.value, minor.value, patch.value

    def unique_id(self) -> bytes:
        """A fresh unique id (rank 0 makes it; the others receive it through a store)."""
        uid = UniqueId(version=version_word(UniqueId))
        check_status(self._fn["nvshmemx_get_uniqueid"](ctypes.byref(uid)), "nvshmemx_get_uniqueid")
        return bytes(ctypes.string_at(ctypes.addressof(uid), UNIQUEID_BYTES))

    def init(self, unique_id: bytes, rank: int, world_size: int) -> None:
        """Initialise this process as PE ``rank`` of ``world_size`` (collective)."""
        if len(unique_id) != UNIQUEID_BYTES:
            raise AFDError(f"an NVSHMEM unique id has {UNIQUEID_BYTES} bytes, got {len(unique_id)}")
        uid = UniqueId.from_buffer_copy(unique_id)
        attr = InitAttr(version=version_word(InitAttr))
        attr.args.version = version_word(InitArgs)
        attr.args.uid_args.version = version_word(UniqueIdArgs)
        status = self._fn["nvshmemx_set_attr_uniqueid_args"](
            rank, world_size, ctypes.byref(uid), ctypes.byref(attr)
        )
        check_status(status, "nvshmemx_set_attr_uniqueid_args")
        # ``attr`` keeps a pointer to ``uid``: both stay alive across the call below.
        status = self._fn["nvshmemx_hostlib_init_attr"](INIT_WITH_UNIQUEID, ctypes.byref(attr))
        check_status(
            status,
            f"nvshmemx_hostlib_init_attr (rank {rank} of {world_size})",
            "set NVSHMEM_DEBUG=INFO for NVSHMEM's own diagnostics",
        )

    def finalize(self) -> None:
        self._fn["nvshmemx_hostlib_finalize"]()

    def my_pe(self) -> int:
        return int(self._fn["nvshmem_my_pe"]())

    def n_pes(self) -> int:
        return int(self._fn["nvshmem_n_pes"]())

    def malloc(self, nbytes: int) -> int:
        """Collective symmetric allocation; returns this PE's device address."""
        address = self._fn["nvshmem_malloc"](nbytes)
        if not address:
            raise AFDError(
                f"nvshmem_malloc({nbytes}) failed: the symmetric heap is too small; raise "
                f"NVSHMEM_SYMMETRIC_SIZE (afd sets it from the window size unless you did)"
            )
        return int(address)

    def free(self, address: int) -> None:
        self._fn["nvshmem_free"](ctypes.c_void_p(address))

    def peer_address(self, address: int, pe: int) -> int:
        """``address`` of PE ``pe`` mapped into this process (0 when not P2P reachable)."""
        mapped = self._fn["nvshmem_ptr"](ctypes.c_void_p(address), pe)
        return int(mapped) if mapped else 0

    def barrier_all(self) -> None:
        self._fn["nvshmem_barrier_all"]()

    def putmem_signal_on_stream(
        self,
        dest: int,
        source: int,
        nbytes: int,
        signal_address: int,
        signal: int,
        signal_op: int,
        pe: int,
        stream: int,
    ) -> None:
        """Enqueue on ``stream``: copy ``nbytes`` from ``source`` to the symmetric ``dest`` of
        PE ``pe``, then update its 64-bit ``signal_address`` (``signal_op``: SIGNAL_SET or
        SIGNAL_ADD) once the data is there -- the put path that works where peer memory is
        not mapped (between nodes). Addresses are raw device pointers; ``stream`` a
        ``cudaStream_t`` (``torch.cuda.Stream.cuda_stream``)."""
        self._fn["nvshmemx_putmem_signal_on_stream"](
            ctypes.c_void_p(dest),
            ctypes.c_void_p(source),
            nbytes,
            ctypes.c_void_p(signal_address),
            signal,
            signal_op,
            pe,
            ctypes.c_void_p(stream),
        )

    def signal_wait_until_on_stream(
        self, signal_address: int, comparison: int, value: int, stream: int
    ) -> None:
        """Enqueue on ``stream`` a wait until this PE's 64-bit ``signal_address`` compares
        true (``comparison``, e.g. CMP_GE) with ``value``."""
        self._fn["nvshmemx_signal_wait_until_on_stream"](
            ctypes.c_void_p(signal_address), comparison, value, ctypes.c_void_p(stream)
        )

    def cumodule_init(self, module: int) -> None:
        """Give a loaded CUDA module that calls NVSHMEM device functions (linked from
        ``libnvshmem_device.bc``) this process's NVSHMEM device state; once per module,
        before its kernels run."""
        check_status(
            self._fn["nvshmemx_cumodule_init"](ctypes.c_void_p(module)), "nvshmemx_cumodule_init"
        )

    def cumodule_finalize(self, module: int) -> None:
        """Take back what :meth:`cumodule_init` gave ``module`` (before NVSHMEM finalises)."""
        check_status(
            self._fn["nvshmemx_cumodule_finalize"](ctypes.c_void_p(module)),
            "nvshmemx_cumodule_finalize",
        )

    def quiet_on_stream(self, stream: int) -> None:
        """Enqueue on ``stream`` the completion of every put this PE issued before it (device
        puts of earlier kernels included)."""
        self._fn["nvshmemx_quiet_on_stream"](ctypes.c_void_p(stream))
