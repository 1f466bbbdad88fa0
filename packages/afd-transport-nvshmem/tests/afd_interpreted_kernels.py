"""Run the Triton kernels of the transport on the CPU through Triton's interpreter and compare
them with the torch references of afd_transport_nvshmem.kernel_specs and afd_protocol's
reference_reduce_partials, and the per_rank pack also with the host plan (run by
test_kernels_interpreted.py in a subprocess with TRITON_INTERPRET=1; the variable must be set
before Triton compiles anything, so it cannot share the test process)."""

from __future__ import annotations

import os
import sys

import afd_interpreter_xor
import torch

from afd_protocol import (
    FLAG_ROWS_PER_TOKEN,
    HEADER_FIXED_WORDS,
    ExpertPlacement,
    Header,
    MessageKind,
    PartialsToReduce,
    SharedPlacement,
    Topology,
    WireFormat,
    decode_header,
    encode_words,
    plan_dispatch,
    plan_on_device,
    reference_reduce_partials,
)
from afd_transport_nvshmem.kernel_specs import (
    CombineInputs,
    PackInputs,
    TokenRowInputs,
    crc_tables,
    reference_device_pack,
    reference_fused_combine,
)


def routing(tokens: int, experts: int, topk: int, gen: torch.Generator) -> torch.Tensor:
    if not tokens:
        return torch.empty(0, topk, dtype=torch.long)
    return torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)])


def check_pack(
    topo: Topology,
    tokens: int,
    hidden: int,
    topk: int,
    dtype: torch.dtype,
    wire_format: WireFormat = WireFormat.PER_CHOICE,
) -> None:
    from afd_transport_nvshmem.device_pack import triton_device_pack

    gen = torch.Generator().manual_seed(tokens * 31 + topo.num_ffn_ranks)
    ids = routing(tokens, topo.num_experts, topk, gen)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weights = torch.rand(tokens, topk, generator=gen).to(dtype)
    per_rank = wire_format is WireFormat.PER_RANK
    plan = plan_on_device(ids, topo, SharedPlacement.ATTENTION, wire_format)
    ffn = topo.num_ffn_ranks
    fixed = []
    for d in range(ffn):
        counts = (0,) * len(topo.local_experts(d))
        header = Header(
            MessageKind.DISPATCH,
            0,
            5,
            1,
            tokens,
            0,
            0,
            seq=10 + d,
            flags=FLAG_ROWS_PER_TOKEN if per_rank else 0,
            expert_counts=counts,
        )
        fixed += encode_words(header)[:HEADER_FIXED_WORDS]
    fixed_words = torch.tensor(fixed, dtype=torch.int32).view(ffn, -1)
    base, columns = crc_tables(topo.expert_placement, torch.device("cpu"))
    cap = max(1, tokens * topk)
    results = []
    # Each pack also reads the rows by address (a graph-replayed dispatch's): its hidden is
    # then NaN, so a row read from there instead would differ.
    poisoned = torch.full_like(x, float("nan"))
    address = torch.tensor([x.data_ptr()], dtype=torch.int64)
    for pack, by_address in (
        (reference_device_pack, False),
        (triton_device_pack, False),
        (reference_device_pack, True),
        (triton_device_pack, True),
    ):
        rows = tuple(torch.full((cap, hidden), -3.0, dtype=dtype) for _ in range(ffn))
        index = tuple(torch.full((cap,), -1, dtype=torch.int32) for _ in range(ffn))
        headers = tuple(
            torch.full((HEADER_FIXED_WORDS + 64,), -1, dtype=torch.int32) for _ in range(ffn)
        )
        token_rows = None
        if per_rank:
            placement = topo.expert_placement
            token_rows = TokenRowInputs(
                topk_ids=ids,
                topk_weights=weights,
                expert_owner=torch.tensor(placement.owner, dtype=torch.int32),
                expert_local_id=torch.tensor(placement.local_id, dtype=torch.int32),
                route_ids=tuple(torch.full((cap, topk), 7, dtype=torch.int32) for _ in range(ffn)),
                route_weights=tuple(torch.full((cap, topk), -2.0) for _ in range(ffn)),
            )
        pack(
            PackInputs(
                hidden=poisoned if by_address else x,
                plan=plan,
                rank_wire_offsets=topo.expert_placement.rank_wire_offsets,
                fixed_words=fixed_words,
                routed_rows=rows,
                route_index=index,
                headers=headers,
                crc_base=base,
                crc_columns=columns,
                token_row_inputs=token_rows,
                hidden_address=address if by_address else None,
            )
        )
        extra = () if token_rows is None else (token_rows.route_ids, token_rows.route_weights)
        results.append((rows, index, headers, *extra))
    for other in results[1:]:
        for expected, got in zip(results[0], other, strict=True):
            for a, b in zip(expected, got, strict=True):
                assert torch.equal(a, b), (topo, tokens, a, b)
    host = plan_dispatch(ids, topo, wire_format=wire_format)
    for d, words in enumerate(results[1][2]):
        decoded = decode_header(words)  # the device-computed CRC checks out
        assert decoded.expert_counts == host.host_group_list(d)
        if not per_rank:
            assert decoded.routed_rows == host.routed_rows(d)
            continue
        # Against the host plan, an independent computation of the same rows.
        n = host.rank_rows(d)
        assert decoded.routed_rows == n
        assert host.rank_tokens is not None
        assert host.rank_local_ids is not None
        segment = host.rank_segment(d)
        _, index, _, route_ids, route_weights = results[1]
        assert torch.equal(index[d][:n].long(), host.rank_tokens[segment])
        assert torch.equal(results[1][0][d][:n], x[host.rank_tokens[segment]])
        assert torch.equal(route_ids[d][:n], host.rank_local_ids[segment])
        assert torch.equal(route_weights[d][:n], host.rank_weights(weights)[segment])


def check_combine(topo: Topology, tokens: int, hidden: int, topk: int, shared: bool) -> None:
    from afd_transport_nvshmem.fused_combine import triton_fused_combine

    gen = torch.Generator().manual_seed(tokens * 7 + hidden)
    ids = routing(tokens, topo.num_experts, topk, gen)
    plan = plan_dispatch(ids, topo)
    ffn = topo.num_ffn_ranks
    stride = (tokens * topk + tokens + 1) * hidden
    rows = torch.randn(2 * ffn * stride, generator=gen)
    inputs = CombineInputs(
        rows=rows,
        routed_starts=torch.arange(ffn) * stride,
        shared_starts=(torch.arange(ffn) + ffn) * stride if shared else None,
        segment_offsets=torch.tensor(plan.segment_offsets),
        wire_position=plan.wire_position,
        topk_weights=torch.rand(tokens, topk, generator=gen),
        hidden_size=hidden,
        out_dtype=torch.float32,
    )
    torch.testing.assert_close(
        triton_fused_combine(inputs), reference_fused_combine(inputs), rtol=1e-5, atol=1e-5
    )


def check_reduced_combine(topo: Topology, tokens: int, hidden: int, topk: int) -> None:
    """The fused combine of replies reduced on the FFN side: one unit-weight position per
    (token, FFN rank), -1 where the token sent nothing there (skipped, even over NaN)."""
    from afd_transport_nvshmem.fused_combine import triton_fused_combine

    gen = torch.Generator().manual_seed(tokens * 5 + hidden)
    ids = routing(tokens, topo.num_experts, topk, gen)
    plan = plan_on_device(ids, topo, SharedPlacement.ATTENTION, WireFormat.PER_RANK)
    assert plan.token_rows is not None
    assert plan.token_row_offsets is not None
    ffn = topo.num_ffn_ranks
    stride = (tokens + 1) * hidden
    rows = torch.full((ffn * stride,), float("nan"))
    offsets = plan.token_row_offsets.tolist()
    for d in range(ffn):
        n = offsets[d + 1] - offsets[d]
        rows[d * stride : d * stride + n * hidden] = torch.randn(n * hidden, generator=gen)
    inputs = CombineInputs(
        rows=rows,
        routed_starts=torch.arange(ffn) * stride,
        shared_starts=None,
        segment_offsets=plan.token_row_offsets,
        wire_position=plan.token_row_positions,
        topk_weights=torch.ones(tokens, ffn),
        hidden_size=hidden,
        out_dtype=torch.float32,
    )
    expected = torch.zeros(tokens, hidden, dtype=torch.float64)
    for t in range(tokens):
        for d in range(ffn):
            row = int(plan.token_rows[t, d])
            if row >= 0:
                expected[t] += rows[d * stride + row * hidden :][:hidden].double()
    reference = reference_fused_combine(inputs)
    torch.testing.assert_close(reference.double(), expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(triton_fused_combine(inputs), reference, rtol=1e-5, atol=1e-5)


def check_reduce(rows: int, hidden: int, topk: int, dtype: torch.dtype) -> None:
    from afd_transport_nvshmem.reduce_partials import triton_reduce_partials

    gen = torch.Generator().manual_seed(rows * 3 + topk)
    owned = torch.rand(rows, topk, generator=gen) < 0.5
    owned[:, 0] |= ~owned.any(dim=1)  # every row has at least one partial here
    route_ids = torch.where(owned, torch.randint(0, 4, (rows, topk), generator=gen), -1)
    slots = torch.nonzero(owned.reshape(-1)).squeeze(1)
    slots = slots[torch.randperm(slots.numel(), generator=gen)]  # any expansion order
    inputs = PartialsToReduce(
        out=torch.randn(slots.numel(), hidden, generator=gen).to(dtype),
        slots=slots,
        route_ids=route_ids.to(torch.int32),
        route_weights=torch.rand(rows, topk, generator=gen),
    )
    got = triton_reduce_partials(inputs)
    assert got.dtype == dtype
    assert got.shape == (rows, hidden)
    torch.testing.assert_close(
        got.float(), reference_reduce_partials(inputs).float(), rtol=1e-2, atol=1e-2
    )


def check_publish() -> None:
    """The one-launch publish sets each flag word to its value, after earlier writes,
    and nothing else; a reused key's block carries the next values."""
    from afd_transport_nvshmem.flag_publish import FlagPublisher

    first, second = torch.zeros(8, dtype=torch.int32), torch.zeros(8, dtype=torch.int32)
    publisher = FlagPublisher(torch.device("cpu"), max_flags=3)
    addresses = [first.data_ptr() + 4 * 5, second.data_ptr() + 4 * 2]
    publisher.publish("ring 0", [7, -9], lambda: addresses)
    want_first, want_second = torch.zeros(8, dtype=torch.int32), torch.zeros(8, dtype=torch.int32)
    want_first[5], want_second[2] = 7, -9
    assert torch.equal(first, want_first), first
    assert torch.equal(second, want_second), second

    def not_again() -> list[int]:
        raise AssertionError("a key's addresses are read on its first publish only")

    publisher.publish("ring 0", [2**31 - 1, 1], not_again)  # the same key: its block reused
    want_first[5], want_second[2] = 2**31 - 1, 1
    assert torch.equal(first, want_first), first
    assert torch.equal(second, want_second), second
    block = publisher.block("ring 0", not_again)
    block.prepare()  # loads the kernel, sets nothing
    assert torch.equal(first, want_first), first
    assert torch.equal(second, want_second), second
    block.write([3, 4])  # the capturable half: values now, stores when launched
    assert torch.equal(first, want_first), first
    block.launch()
    want_first[5], want_second[2] = 3, 4
    assert torch.equal(first, want_first), first
    assert torch.equal(second, want_second), second
    import pytest

    with pytest.raises(ValueError, match=r"a publish sets 1\.\.3 flags, got 0"):
        publisher.publish("none", [], list)
    with pytest.raises(ValueError, match=r"a publish sets 1\.\.3 flags, got 4"):
        publisher.publish("four", [1, 2, 3, 4], lambda: [0, 0, 0, 0])
    with pytest.raises(ValueError, match="one value per address; got 1 values for 2 addresses"):
        publisher.publish("ring 0", [1], not_again)


def check_fetch() -> None:
    """The graphed dispatch's input fetch: three sources of different dtypes and sizes
    (past one block, not a multiple of it) copied from their addresses, and the reference
    (memmove) agreeing."""
    from afd_transport_nvshmem.input_fetch import BLOCK, triton_fetch_inputs
    from afd_transport_nvshmem.kernel_specs import reference_fetch_inputs

    gen = torch.Generator().manual_seed(5)
    for tokens in (1, 3, BLOCK // 4 + 7):
        sources = [
            torch.randn(tokens, 48, generator=gen).to(torch.bfloat16),
            torch.randint(0, 64, (tokens, 6), generator=gen),
            torch.rand(tokens, 6, generator=gen),
        ]
        addresses = torch.tensor([t.data_ptr() for t in sources], dtype=torch.int64)
        for fetch in (triton_fetch_inputs, reference_fetch_inputs):
            out = [torch.full_like(t, 7) for t in sources]
            fetch(addresses, out)
            for want, got in zip(sources, out, strict=True):
                assert torch.equal(want, got), (fetch.__name__, tokens, want.dtype)


def check_copy_words() -> None:
    """The graphed dispatch's word copies: int32 and int64, sizes inside one loop step, at
    its end and past several, against the reference (``copy_``); and the refusals."""
    import pytest

    from afd_transport_nvshmem.kernel_specs import MAX_COPIED_WORDS, reference_copy_words
    from afd_transport_nvshmem.word_copy import BLOCK, triton_copy_words

    gen = torch.Generator().manual_seed(9)
    for dtype in (torch.int32, torch.int64):
        for n in (1, 3, BLOCK, 2 * BLOCK + 5, MAX_COPIED_WORDS):
            source = torch.randint(-(2**31), 2**31 - 1, (n,), generator=gen).to(dtype)
            for copy in (triton_copy_words, reference_copy_words):
                out = torch.full((n + 4,), -7, dtype=dtype)
                copy(out[:n], source)
                assert torch.equal(out[:n], source), (copy.__name__, dtype, n)
                assert (out[n:] == -7).all(), (copy.__name__, dtype, n)  # nothing past n
    words = torch.zeros(8, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"one dtype and count: got torch.int64 \[8\]"):
        triton_copy_words(words, torch.zeros(8, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"got torch.int32 \[4\] into torch.int32 \[8\]"):
        triton_copy_words(words, torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="contiguous words only"):
        triton_copy_words(words, torch.zeros(16, dtype=torch.int32)[::2])
    big = torch.zeros(MAX_COPIED_WORDS + 1, dtype=torch.int32)
    with pytest.raises(ValueError, match=f"at most {MAX_COPIED_WORDS} words, got"):
        triton_copy_words(big, big.clone())


def check_put_extents() -> int:
    """The put path's extent kernel (its COPY variant: loads and stores where a GPU puts)
    against reference_put_extents: both wire formats, shared rows, empty messages, counts
    past a field's capacity and negative ones; two destinations with different headers.
    Each case splits the extents over 1, 3 or 7 programs (pieces that do not divide evenly)
    and one case per wire format over the put's own CHUNKS. Returns the number of cases."""
    from afd_protocol import SlotLayout, Word
    from afd_transport_nvshmem.put_path import CHUNKS, copy_extents, reference_put_extents

    gen = torch.Generator().manual_seed(11)
    cases = 0
    for wire in ("per_choice", "per_rank"):
        topo = Topology(2, 2, 8)
        slot = SlotLayout(
            topo, 48, 40, 3, dtype="bfloat16", shared_placement="ffn", wire_format=wire
        )
        window = slot.window(ring_depth=2)
        local = slot.header_words - HEADER_FIXED_WORDS
        for counts in (
            (0, 0, 0, local),
            (1, 1, 1, 1),
            (40, 37, 20, local),
            (40, 10**6, 10**6, 0),
            (-3, 5, -1, -2),
        ):
            staging = [
                torch.randint(0, 256, (window.total_bytes,), generator=gen, dtype=torch.uint8)
                for _ in range(2)
            ]
            slot_offset = window.slot_offset(1, 1)
            for d, buffer in enumerate(staging):
                header = buffer[slot_offset : slot_offset + 4 * slot.header_words].view(torch.int32)
                tokens, routed, shared, num_counts = counts
                header[Word.NUM_TOKENS] = tokens
                header[Word.ROUTED_ROWS] = routed - d  # the two destinations differ
                header[Word.SHARED_ROWS] = shared
                header[Word.NUM_COUNTS] = num_counts
            got = [torch.full_like(b, 0xFF) for b in staging]
            want = [torch.full_like(b, 0xFF) for b in staging]
            copy_extents(
                [b.data_ptr() for b in staging],
                [g.data_ptr() for g in got],
                window,
                slot_offset,
                torch.device("cpu"),
                chunks=CHUNKS if counts[0] == 40 and counts[1] == 37 else (1, 3, 7)[cases % 3],
            )
            for source, target in zip(staging, want, strict=True):
                reference_put_extents(source, target, window, slot_offset)
            for g, w in zip(got, want, strict=True):
                assert torch.equal(g, w), (wire, counts)
            cases += 1
    return cases


TOPOLOGIES = (
    Topology(1, 1, 8),
    Topology(1, 2, 16),
    Topology(1, 3, 10, placement=ExpertPlacement.contiguous(10, 3)),  # 4 + 3 + 3 experts
    Topology(1, 4, 64),
)
TOKEN_COUNTS = (1, 5, 33)


def check_exchange_kernels() -> int:
    """The flag publish, the fetch by address and the put path's extent copy; the case count."""
    check_publish()
    check_fetch()
    check_copy_words()
    return 3 + check_put_extents()


def check_pack_kernels() -> int:
    """The device pack, both wire formats, over every topology and token count."""
    cases = 0
    for topo in TOPOLOGIES:
        for tokens in TOKEN_COUNTS:
            for dtype in (torch.float32, torch.bfloat16):
                check_pack(topo, tokens, 48, min(4, topo.num_experts), dtype)
                cases += 1
            # The per_choice cases cover both dtypes; here the one a GPU carries.
            check_pack(
                topo, tokens, 48, min(4, topo.num_experts), torch.bfloat16, WireFormat.PER_RANK
            )
            cases += 1
    return cases


def check_combine_kernels() -> int:
    """The fused combine (per-partial and reduced replies) and the FFN-side reduce."""
    cases = 0
    for topo in TOPOLOGIES:
        for tokens in TOKEN_COUNTS:
            for shared in (False, True):
                check_combine(topo, tokens, 70, min(3, topo.num_experts), shared)
                cases += 1
            check_reduced_combine(topo, tokens, 40, min(3, topo.num_experts))
            cases += 1
    for rows, hidden, topk in ((1, 16, 1), (9, 70, 6), (33, 48, 8)):
        for dtype in (torch.float32, torch.bfloat16):
            check_reduce(rows, hidden, topk, dtype)
            cases += 1
    return cases


GROUPS = {
    "exchange": check_exchange_kernels,
    "pack": check_pack_kernels,
    "combine": check_combine_kernels,
}


def main(argv: list[str]) -> int:
    """Run the named groups (all of them when none is named); each group is its own test in
    CI, so no one interpreter run carries every kernel."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    afd_interpreter_xor.install()
    unknown = [name for name in argv if name not in GROUPS]
    if unknown:
        print(f"unknown group(s) {unknown}; choose from {sorted(GROUPS)}", file=sys.stderr)
        return 2
    for name in argv or list(GROUPS):
        cases = GROUPS[name]()
        print(f"{name}: {cases} interpreted kernel cases match their references")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
