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
    device_plan,
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
        },
        {
            "HEADER_WORDS": 78,
            "BLOCK": 8,
            "PEER_BLOCK": 2,
            "WORD_BLOCK": 128,
            "ALL": False,
            "PAUSE_NS": 256,
        },
    )
    ptx = compiled.asm["ptx"]
    assert "atom.global.sys.acquire" in ptx  # flag and abort-word polls
    assert "nanosleep.u32" in ptx  # a pause between polls
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


SERVE_CONSTANTS = {
    "NUM_COUNTS": 64,
    "COUNT_BLOCK": 64,
    "FIXED": HEADER_FIXED_WORDS,
    "FIXED_BLOCK": 16,
    "RECORD_WORDS": 96,
    "MAGIC": 0x41464447,
    "VERSION": 3,
}


@pytest.mark.parametrize("rows_per_token", [False, True])
def test_the_serve_take_compiles_with_acquire_polls_and_a_released_record(
    rows_per_token: bool,
) -> None:
    from afd_transport_nvshmem import serve_kernels

    names = ["flags", "aborts", "window_words", "state", "item"]
    signature = dict.fromkeys(names, "*i32")
    signature |= {"counts_out": "*i64", "layer_out": "*i32", "records": "*i32"}
    signature |= {"control": "*i32", "served": "*i32", "crc_columns": "*i32"}
    scalars = [
        "crc_base",
        "num_slots",
        "ring_depth",
        "num_attention",
        "slots_word",
        "slot_words",
        "num_layers",
        "num_stages",
        "token_cap",
        "routed_cap",
        "shared_cap",
        "topk",
        "max_polls",
        "num_records",
    ]
    signature |= dict.fromkeys(scalars, "i32")
    compiled = _compile(
        serve_kernels._take_kernel,
        signature,
        {
            **SERVE_CONSTANTS,
            "SLOT_BLOCK": 8,
            "RANK_BLOCK": 4,
            "ROWS_PER_TOKEN": rows_per_token,
            "REDUCE": rows_per_token,
            "CHECK_SERVED": True,
            "KNOWN_FLAGS": 7,
            "FLAG_SHUTDOWN": 1,
            "FLAG_ROWS": 4,
            "PAUSE_NS": 256,
        },
    )
    ptx = compiled.asm["ptx"]
    assert "atom.global.sys.acquire" in ptx  # flag and abort-word polls
    assert "nanosleep.u32" in ptx  # a pause between polls
    assert "ld.volatile.global" in ptx  # the host's stop word, read fresh
    release = ptx.rindex("atom.global.sys.release.exch")  # the record's code, to the host
    before = ptx[:release]
    assert before.rfind("bar.sync") > before.rfind("st.global")


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_serve_row_kernels_compile(dtype: str) -> None:
    from afd_transport_nvshmem import serve_kernels

    _compile(
        serve_kernels._expand_kernel,
        {
            "window_words": "*i32",
            "item": "*i32",
            "counts": "*i64",
            "row_of_partial": "*i64",
            "partial_of_slot": "*i64",
            "slots_word": "i32",
            "slot_words": "i32",
            "ids_word": "i32",
            "partials_cap": "i32",
        },
        {"NUM_COUNTS": 64, "COUNT_BLOCK": 64, "TOPK": 6, "TOPK_BLOCK": 8, "ROWS": 256},
    )
    for expand in (False, True):
        _compile(
            serve_kernels._gather_rows_kernel,
            {
                "window_rows": f"*{dtype}",
                "item": "*i32",
                "row_of_partial": "*i64",
                "out": f"*{dtype}",
                "slots_elem": "i64",
                "slot_elems": "i64",
                "rows_elem": "i64",
                "hidden": "i32",
            },
            {"EXPAND": expand, "ROWS": 8, "BLOCK": 1024},
        )
    for reduce in (False, True):
        _compile(
            serve_kernels._reply_rows_kernel,
            {
                "out": f"*{dtype}",
                "window_floats": "*fp32",
                "item": "*i32",
                "partial_of_slot": "*i64",
                "peer_windows": "*i64",
                "reply_rows_byte": "i64",
                "slot_bytes": "i64",
                "slots_float": "i64",
                "slot_floats": "i64",
                "weights_float": "i64",
                "hidden": "i32",
            },
            {"REDUCE": reduce, "TOPK": 6, "ROWS": 8, "BLOCK": 1024},
        )


def test_the_serve_reply_publishes_its_flag_after_the_header_with_a_release() -> None:
    from afd_transport_nvshmem import serve_kernels

    names = ["window_words", "item", "state", "records"]
    signature = dict.fromkeys(names, "*i32")
    signature |= {"peer_windows": "*i64", "crc_columns": "*i32"}
    scalars = ["reply_header_byte", "reply_flag_byte", "slot_bytes", "slots_word", "slot_words"]
    signature |= dict.fromkeys(scalars, "i64")
    signature |= {"crc_base": "i32", "rank": "i32", "num_records": "i32"}
    compiled = _compile(
        serve_kernels._reply_header_kernel,
        signature,
        {**SERVE_CONSTANTS, "SLOT_BLOCK": 8, "REPLY_FLAGS": 4},
    )
    ptx = compiled.asm["ptx"]
    flag = ptx.index("atom.global.sys.release.exch")  # the reply's flag, to the peer
    before = ptx[:flag]
    assert "st.global" in before  # the header words
    assert before.rfind("bar.sync") > before.rfind("st.global")


@pytest.mark.parametrize("per_rank", [False, True])
def test_the_device_plan_kernels_compile(per_rank: bool) -> None:
    """The three launches of ``device_plan`` at V3's shape (256 experts top-8, 8 FFN ranks)."""
    shape = {"TOPK": 8, "FLATS": device_plan.FLATS, "TOKENS": device_plan.TOKENS, "KEYS": 256}
    ranks = {"RANKS": 16, "PER_RANK": per_rank}
    tables = {"ids": "*i32", "wire_of": "*i64", "owner_of": "*i64"}
    sizes = {"num_flat": "i32", "num_tokens": "i32", "num_experts": "i32", "num_ffn": "i32"}
    _compile(
        device_plan._count_kernel,
        {
            **tables,
            **sizes,
            "block_keys": "*i32",
            "block_hits": "*i32",
            "block_min": "*i64",
            "block_max": "*i64",
        },
        {**shape, **ranks},
    )
    _compile(
        device_plan._scan_kernel,
        {
            "block_keys": "*i32",
            "block_hits": "*i32",
            "block_min": "*i64",
            "block_max": "*i64",
            "num_blocks": "i32",
            "num_flat": "i32",
            "num_experts": "i32",
            "num_ffn": "i32",
            "rank_wire_offsets": "*i64",
            "key_base": "*i64",
            "rank_base": "*i64",
            "expert_counts": "*i64",
            "key_start": "*i64",
            "segment_offsets": "*i64",
            "expert_bounds": "*i64",
            "token_row_offsets": "*i64",
        },
        {"KEYS": 256, "CHUNK": device_plan.CHUNK, **ranks},
    )
    _compile(
        device_plan._place_kernel,
        {
            **tables,
            **sizes,
            "key_base": "*i64",
            "rank_base": "*i64",
            "key_start": "*i64",
            "token_row_offsets": "*i64",
            "order": "*i64",
            "row_token": "*i64",
            "wire_position": "*i64",
            "token_rows": "*i64",
            "token_row_positions": "*i64",
        },
        {**shape, **ranks, "ORDER": True},
    )


def test_the_input_fetch_compiles_to_loads_from_addresses_read_at_run_time() -> None:
    from afd_transport_nvshmem import input_fetch

    compiled = _compile(
        input_fetch._fetch_kernel,
        {
            "sources": "*i64",
            "dst0": "*i16",
            "dst1": "*i16",
            "dst2": "*i16",
            "n0": "i32",
            "n1": "i32",
            "n2": "i32",
        },
        {"BLOCK": input_fetch.BLOCK},
    )
    assert "ld.global" in compiled.asm["ptx"]


def _put_extents_signature() -> dict[str, str]:
    return {
        "staging": "*i64",
        "dest_bases": "*i64",
        "pes": "*i32",
        "rules": "*i64",
        "slot_offset": "i64",
    }


def _put_constants(copy: bool) -> dict[str, Any]:
    from afd_transport_nvshmem import put_path

    return {
        "N_RULES": 5,
        "RULE_COLUMNS": put_path.RULE_COLUMNS,
        "CHUNKS": put_path.CHUNKS,
        "COPY": copy,
        "COPY_BLOCK": put_path.COPY_BLOCK,
    }


def test_the_put_extent_kernel_compiles_in_its_copy_variant() -> None:
    """The COPY variant (loads and stores) needs no NVSHMEM; it holds the extent arithmetic
    the put variant shares, and calls no device library function."""
    from afd_transport_nvshmem import put_path

    compiled = _compile(
        put_path._put_extents_kernel, _put_extents_signature(), _put_constants(True)
    )
    ptx = compiled.asm["ptx"]
    assert "st.global" in ptx
    assert "nvshmemx_putmem_block" not in ptx
    assert ".extern .func" not in ptx


def test_the_put_kernels_link_nvshmem_device_functions_where_the_library_is() -> None:
    """With NVSHMEM's device bitcode installed (the GPU image; CI has none, and skips):
    both put kernels compile for sm_90 with the device functions linked in."""
    from afd_transport_nvshmem import put_path
    from afd_transport_nvshmem.library import NvshmemUnavailable, find_host_library

    try:
        bitcode = put_path.find_device_library(find_host_library())
    except NvshmemUnavailable as exc:
        pytest.skip(str(exc))
    options = {"extern_libs": {"libnvshmem_device": str(bitcode)}}
    for kernel, signature, constants in (
        (put_path._put_extents_kernel, _put_extents_signature(), _put_constants(False)),
        (
            put_path._put_flags_kernel,
            {"request": "*i32", "dest_bases": "*i64", "pes": "*i32", "flag_offset": "i64"},
            {},
        ),
    ):
        for name in constants:
            signature[name] = "constexpr"
        source = ASTSource(kernel, signature, constexprs=constants)
        compiled = triton.compile(source, target=HOPPER, options=options)
        # Linked: no device function is left as an unresolved declaration.
        assert ".extern .func" not in compiled.asm["ptx"]
