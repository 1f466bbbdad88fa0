"""Every Triton kernel of the transport compiles for Hopper (sm_90) on a machine without a GPU.

CI never has a GPU, so this is where a kernel edit that does not compile is caught before
the GPU suite runs; ``ptxas`` ships inside the triton wheel. It also pins properties of
the generated code that the transport relies on.
"""

from __future__ import annotations

from typing import Any

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from afd_protocol import HEADER_FIXED_WORDS, Word  # noqa: E402
from afd_transport_nvshmem import (  # noqa: E402
    device_pack,
    device_wait,
    flag_publish,
    fused_combine,
    reduce_partials,
)

HOPPER = GPUTarget("cuda", 90, 32)


def _compile(kernel: Any, signature: dict[str, str], constants: dict[str, Any]) -> Any:
    for name in constants:
        signature[name] = "constexpr"
    return triton.compile(ASTSource(kernel, signature, constexprs=constants), target=HOPPER)


def test_the_device_wait_compiles_with_barriers_around_the_capture() -> None:
    compiled = _compile(
        device_wait._wait_any_kernel,
        {
            "flags": "*i32",
            "aborts": "*i32",
            "request": "*i32",
            "out": "*i32",
            "window_words": "*i32",
            "header_offsets": "*i64",
            "headers_out": "*i32",
            "header_words": "i32",
        },
        {"BLOCK": 8, "PEER_BLOCK": 2, "WORD_BLOCK": 128},
    )
    ptx = compiled.asm["ptx"]
    assert "atom.global.sys.acquire" in ptx  # flag and abort-word polls
    release = ptx.index("atom.global.sys.release.exch")  # the status word, to the host
    before = ptx[:release]
    # No thread's store (values, headers) may sit between the last barrier and the release.
    assert before.rfind("bar.sync") > before.rfind("st.global")


def test_the_pingpong_kernel_compiles() -> None:
    _compile(
        device_wait._pingpong_kernel,
        {"local_flag": "*i32", "peer_flag": "*i32", "iterations": "i32"},
        {"INITIATOR": True},
    )


def test_the_flag_publish_compiles_to_release_stores_at_system_scope() -> None:
    compiled = _compile(
        flag_publish._publish_kernel, {"request": "*i32", "addresses": "*i64"}, {"BLOCK": 8}
    )
    ptx = compiled.asm["ptx"]
    # The values come from pinned host memory, read fresh (volatile), and each flag is set
    # with a release exchange at system scope: a peer's acquire load then sees the payload.
    assert "ld.volatile.global" in ptx
    assert "atom.global.sys.release.exch" in ptx
    assert "st.global" not in ptx  # no plain store could reach a flag before the release


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("shared", [False, True])
def test_the_fused_combine_compiles(dtype: str, shared: bool) -> None:
    _compile(
        fused_combine._fused_combine_kernel,
        {
            "rows": f"*{dtype}",
            "routed_starts": "*i64",
            "shared_starts": "*i64",
            "segment_offsets": "*i64",
            "wire_position": "*i64",
            "weights": "*fp32",
            "out": f"*{dtype}",
            "hidden": "i32",
            "num_ffn": "i32",
        },
        {"TOPK": 8, "FFN_BLOCK": 4, "BLOCK": 1024, "HAS_SHARED": shared},
    )


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_device_pack_compiles(dtype: str) -> None:
    _compile(
        device_pack._pack_rows_kernel,
        {
            "hidden": f"*{dtype}",
            "row_token": "*i64",
            "segment_offsets": "*i64",
            "rows_at": "*i64",
            "index_at": "*i64",
            "total": "i64",
            "hidden_size": "i32",
            "num_ffn": "i32",
        },
        {"ROWS": device_pack.ROWS, "BLOCK": 1024, "FFN_BLOCK": 4},
    )
    _compile(
        device_pack._pack_headers_kernel,
        {
            "fixed_words": "*i32",
            "expert_counts": "*i64",
            "segment_offsets": "*i64",
            "rank_offsets": "*i64",
            "headers_at": "*i64",
            "crc_base": "*i32",
            "crc_columns": "*i32",
        },
        {
            "MAX_WORDS": HEADER_FIXED_WORDS + 256,
            "FIXED": HEADER_FIXED_WORDS,
            "FIXED_BLOCK": 16,
            "ROUTED_WORD": int(Word.ROUTED_ROWS),
            "CHECKSUM_WORD": int(Word.CHECKSUM),
            "COUNTS": device_pack.COUNT_BLOCK,
        },
    )


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_per_rank_pack_compiles(dtype: str) -> None:
    _compile(
        device_pack._pack_token_rows_kernel,
        {
            "hidden": f"*{dtype}",
            "token_rows": "*i64",
            "topk_ids": "*i64",
            "topk_weights": f"*{dtype}",
            "expert_owner": "*i32",
            "expert_local_id": "*i32",
            "rows_at": "*i64",
            "index_at": "*i64",
            "ids_at": "*i64",
            "weights_at": "*i64",
            "num_tokens": "i32",
            "hidden_size": "i32",
            "num_experts": "i32",
        },
        {"NUM_FFN": 2, "TOPK": 6, "TOPK_BLOCK": 8, "ROWS": device_pack.ROWS, "BLOCK": 1024},
    )


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_ffn_side_reduce_compiles(dtype: str) -> None:
    _compile(
        reduce_partials._reduce_partials_kernel,
        {
            "out": f"*{dtype}",
            "partial_of_slot": "*i64",
            "route_weights": "*fp32",
            "reduced": f"*{dtype}",
            "hidden": "i32",
        },
        {"TOPK": 8, "BLOCK": 1024},
    )
