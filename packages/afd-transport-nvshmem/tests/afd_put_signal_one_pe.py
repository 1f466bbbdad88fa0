"""NVSHMEM's put-with-signal through the ctypes binding, on one GPU as a world of one PE
(run by test_put_signal_gpu.py in a fresh process: NVSHMEM initialises once per process).

A put to one's own PE exercises the same entry points and argument types as a put to a
peer: the payload lands in the symmetric heap, the 64-bit signal word is set or added to
after it, and a stream wait on the signal orders what follows. Prints one line per check.
"""

from __future__ import annotations

import sys
import time

import torch

from afd_transport_nvshmem.binding import CMP_GE, SIGNAL_ADD, SIGNAL_SET, NvshmemLibrary
from afd_transport_nvshmem.bootstrap import apply_single_node_defaults
from afd_transport_nvshmem.cuda_memory import device_bytes

SIZE = 64 << 20


def main() -> int:
    apply_single_node_defaults(SIZE + 4096)
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    torch.empty(1, device=device)
    lib = NvshmemLibrary()
    lib.init(lib.unique_id(), 0, 1)
    heap = lib.malloc(SIZE + 64)
    window = device_bytes(heap, SIZE + 64, device)
    window.zero_()
    signal_at = heap + SIZE
    signal = window[SIZE : SIZE + 8].view(torch.int64)
    source = torch.randint(0, 256, (SIZE,), dtype=torch.uint8, device=device)
    stream = torch.cuda.current_stream(device).cuda_stream
    lib.putmem_signal_on_stream(heap, source.data_ptr(), SIZE, signal_at, 1, SIGNAL_SET, 0, stream)
    lib.signal_wait_until_on_stream(signal_at, CMP_GE, 1, stream)
    torch.cuda.synchronize(device)
    assert torch.equal(window[:SIZE], source), "payload differs"
    assert int(signal[0]) == 1, f"signal {int(signal[0])} after SIGNAL_SET 1"
    print("put + SIGNAL_SET: payload and signal ok")
    for _ in range(2):
        lib.putmem_signal_on_stream(
            heap, source.data_ptr(), 4096, signal_at, 5, SIGNAL_ADD, 0, stream
        )
    lib.signal_wait_until_on_stream(signal_at, CMP_GE, 11, stream)
    torch.cuda.synchronize(device)
    assert int(signal[0]) == 11, f"signal {int(signal[0])} after two SIGNAL_ADD 5"
    print("SIGNAL_ADD twice: signal 11 ok")
    times = []
    for _ in range(10):
        start = time.perf_counter()
        lib.putmem_signal_on_stream(
            heap, source.data_ptr(), SIZE, signal_at, 1, SIGNAL_ADD, 0, stream
        )
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    times.sort()
    print(
        f"put-with-signal of {SIZE >> 20} MB to its own PE: {SIZE / times[5] / 1e9:.0f} GB/s "
        f"(median of 10, host-timed)"
    )
    lib.free(heap)
    lib.finalize()
    print("put-with-signal one-PE checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
