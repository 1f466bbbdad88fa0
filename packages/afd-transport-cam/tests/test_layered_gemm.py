"""The layer-select GEMM references against per-row loops written here: the layer comes
from a one-element tensor, groups from counts or cumulative ends, int8 products exact,
SwiGLU on the halves, and the int8 output within half a step."""

from __future__ import annotations

import pytest
import torch

from afd_protocol import InvalidArgument
from afd_transport_cam.emulator.gemm import (
    decode_scale,
    gmm_swiglu_quant_v2_layered,
    grouped_matmul_layered,
)
from afd_transport_cam.quant import dequantize

GEN = torch.Generator().manual_seed(0)
COUNTS = torch.tensor([3, 0, 2, 4])  # 9 rows over 4 experts; x has 11 (2 past the groups)


def expert_of_rows(counts: torch.Tensor) -> list[int]:
    return [e for e, n in enumerate(counts.tolist()) for _ in range(n)]


def test_w2_float_selects_the_layer_and_each_rows_expert() -> None:
    x = torch.randn(11, 5, generator=GEN)
    weights = [torch.randn(4, 5, 6, generator=GEN) for _ in range(3)]
    biases = [torch.randn(4, 6, generator=GEN) for _ in range(3)]
    for layer in range(3):
        (y,) = grouped_matmul_layered(
            [x], weights, biases, [], torch.tensor([layer]), COUNTS, output_dtype=torch.float32
        )
        for row, expert in enumerate(expert_of_rows(COUNTS)):
            want = x[row].double() @ weights[layer][expert].double() + biases[layer][expert]
            torch.testing.assert_close(y[row].double(), want, rtol=1e-5, atol=1e-5)
        assert torch.equal(y[9:], torch.zeros(2, 6))  # rows past the groups
    cumulative = COUNTS.cumsum(0)
    (same,) = grouped_matmul_layered(
        [x], weights, biases, [], torch.tensor([2]), cumulative, group_list_type=0,
        output_dtype=torch.float32,
    )  # fmt: skip
    torch.testing.assert_close(same, y)


def test_w2_int8_is_exact_then_dequantised_per_channel_and_per_token() -> None:
    x = torch.randint(-127, 128, (11, 5), generator=GEN, dtype=torch.int8)
    weights = [torch.randint(-127, 128, (4, 5, 6), generator=GEN, dtype=torch.int8)]
    scale = torch.rand(4, 6, generator=GEN) / 100
    token_scale = torch.rand(11, generator=GEN) / 100
    encoded = scale.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    encoded = encoded | (encoded << 32)  # the fp32 bits in both halves, as the NPU takes them
    assert torch.equal(decode_scale(encoded), scale)
    for scales in ([scale], [encoded]):
        (y,) = grouped_matmul_layered(
            [x], weights, [], scales, torch.tensor([0]), COUNTS, per_token_scale=token_scale,
            output_dtype=torch.float32,
        )  # fmt: skip
        for row, expert in enumerate(expert_of_rows(COUNTS)):
            exact = (x[row].long() @ weights[0][expert].long()).double()
            want = exact * scale[expert].double() * float(token_scale[row])
            torch.testing.assert_close(y[row].double(), want, rtol=1e-5, atol=1e-6)
    (default,) = grouped_matmul_layered([x], weights, [], [scale], torch.tensor([0]), COUNTS)
    assert default.dtype == torch.bfloat16  # int8 in, bf16 out unless told


def test_w1_is_gate_up_swiglu_and_int8_within_half_a_step() -> None:
    x = torch.randint(-127, 128, (11, 5), generator=GEN, dtype=torch.int8)
    x_scale = torch.rand(11, generator=GEN) / 50
    weights = [
        torch.randint(-127, 128, (4, 5, 8), generator=GEN, dtype=torch.int8) for _ in range(2)
    ]
    scales = [torch.rand(4, 8, generator=GEN) / 100 for _ in range(2)]
    y, y_scale = gmm_swiglu_quant_v2_layered(
        x, weights, scales, [], x_scale, COUNTS.cumsum(0), torch.tensor([1])
    )
    assert (y.dtype, y.shape, y_scale.shape) == (torch.int8, (11, 4), (11,))
    got = dequantize(y, y_scale, torch.float64)
    for row, expert in enumerate(expert_of_rows(COUNTS)):
        h = (x[row].long() @ weights[1][expert].long()).double()
        h = h * scales[1][expert].double() * float(x_scale[row])
        want = torch.nn.functional.silu(h[:4]) * h[4:]
        step = want.abs().max() / 254
        assert torch.all((got[row] - want).abs() <= step + 1e-9), (row, got[row], want)
    assert torch.equal(y[9:], torch.zeros(2, 4, dtype=torch.int8))


LAYER0 = torch.tensor([0])


def w2(x: torch.Tensor, w: list[torch.Tensor], **changes: object) -> object:
    args: dict[str, object] = {"layer_index": LAYER0, "group_list": COUNTS, **changes}
    return grouped_matmul_layered([x], w, [], [], **args)  # type: ignore[arg-type]


BAD_CALLS = {
    "layer_index 2 is outside the 1 layers": lambda x, w: w2(x, w, layer_index=torch.tensor([2])),
    "layer_index must be an int64 tensor": lambda x, w: w2(x, w, layer_index=torch.tensor([0.0])),
    "group_list covers 18 rows but x has 11": lambda x, w: w2(x, w, group_list=COUNTS * 2),
    "split_item must be 3": lambda x, w: w2(x, w, split_item=2),
    "both int8 \\(W8A8\\) or both floating": lambda x, w: w2(x.to(torch.int8), w),
    "per-channel weight scales": lambda x, w: gmm_swiglu_quant_v2_layered(
        x, w, [], [], x[:, 0], COUNTS, LAYER0, dequant_mode=1
    ),
}


@pytest.mark.parametrize("message", list(BAD_CALLS))
def test_bad_calls_name_what_is_wrong(message: str) -> None:
    x = torch.randn(11, 5, generator=GEN)
    weights = [torch.randn(4, 5, 6, generator=GEN)]
    with pytest.raises(InvalidArgument, match=message):
        BAD_CALLS[message](x, weights)


def test_the_gemms_are_registered_beside_the_communication_operators() -> None:
    from afd_transport_cam.emulator import register_emulated_ops

    register_emulated_ops()
    x = torch.randn(11, 5, generator=GEN)
    weights = [torch.randn(4, 5, 6, generator=GEN)]
    (y,) = torch.ops.afd_ascend.grouped_matmul_layered(
        [x], weights, [], [], torch.tensor([0]), COUNTS, None, 1, 3, torch.float32
    )
    (want,) = grouped_matmul_layered(
        [x], weights, [], [], torch.tensor([0]), COUNTS, output_dtype=torch.float32
    )
    torch.testing.assert_close(y, want)
