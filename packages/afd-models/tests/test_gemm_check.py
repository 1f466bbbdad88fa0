"""The GEMM start-up probe (afd_models.gemm_check): it finds an output element a product
left unwritten, says which product and how many, and passes a device that writes all.
The library's fault is reproduced on the CPU by a ``torch.mm`` that skips elements; on a
GPU the probe's verdict is compared with an independent sweep
(``tools/tests/test_gemm_check_gpu.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from afd_models import DeviceError, check_gemms_write_every_output, gemm_check
from afd_models.gemm_check import unwritten_outputs

SMALL = {"shapes": ((16, 24), (8, 40)), "rows": (1, 5, 33)}


def skipping_mm(skip: Callable[[torch.Tensor], bool]) -> Callable[..., torch.Tensor]:
    """``torch.mm`` that leaves ``out[-1, -1]`` as it was for products where ``skip(out)``."""
    real = torch.mm

    def mm(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
        kept = out[-1, -1].clone()
        real(a, b, out=out)
        if skip(out):
            out[-1, -1] = kept
        return out

    return mm


def test_a_device_that_writes_every_output_passes() -> None:
    assert unwritten_outputs("cpu", **SMALL) == []  # type: ignore[arg-type]


def test_an_unwritten_element_is_found_and_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "mm", skipping_mm(lambda out: out.shape == (33, 40)))
    found = unwritten_outputs("cpu", **SMALL)  # type: ignore[arg-type]
    assert found == [
        "bfloat16 [33 x 8] @ [8 x 40]: 1 of 1320 elements unwritten",
        "float32 [33 x 8] @ [8 x 40]: 1 of 1320 elements unwritten",
    ]


def test_the_probe_leaves_the_process_random_state_alone() -> None:
    before = torch.random.get_rng_state()
    unwritten_outputs("cpu", **SMALL)  # type: ignore[arg-type]
    assert torch.equal(torch.random.get_rng_state(), before)


def test_the_check_raises_a_device_error_that_says_what_to_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(gemm_check, "unwritten_outputs", lambda device: ["bf16 probe: 3 of 9"])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: _Props(42))
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "33")
    gemm_check._check_cuda.cache_clear()
    with pytest.raises(DeviceError) as caught:
        gemm_check._check_cuda(0)
    message = str(caught.value)
    assert "cuda:0 (42 SMs, a CUDA MPS client at 33 %)" in message
    assert "in 1 of 98 probe products (bf16 probe: 3 of 9)" in message
    assert "use another SM share" in message
    gemm_check._check_cuda.cache_clear()


def test_a_cpu_device_is_not_probed(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: Any, **kwargs: Any) -> list[str]:
        raise AssertionError("the CPU was probed")

    monkeypatch.setattr(gemm_check, "unwritten_outputs", fail)
    check_gemms_write_every_output("cpu")


class _Props:
    def __init__(self, sms: int) -> None:
        self.multi_processor_count = sms


@pytest.mark.parametrize("build", ["monolithic", "attention", "ffn"])
def test_every_model_refuses_a_device_whose_gemms_drop_outputs(
    monkeypatch: pytest.MonkeyPatch, build: str
) -> None:
    """The probe runs where every model resolves its device, before anything is built."""
    from afd_models import AttentionRoleModel, FFNRoleExecutor, MonolithicModel, _common, preset

    probed: list[torch.device] = []

    def refuse(device: torch.device) -> None:
        probed.append(device)
        raise DeviceError(f"planted: {device} drops GEMM outputs")

    monkeypatch.setattr(_common, "check_gemms_write_every_output", refuse)
    config = preset("tiny")
    makers: dict[str, Callable[[], object]] = {
        "monolithic": lambda: MonolithicModel(config, device="cuda:3"),
        "attention": lambda: AttentionRoleModel(config, device="cuda:3"),
        "ffn": lambda: FFNRoleExecutor(config, [0, 1], device="cuda:3"),
    }
    with pytest.raises(DeviceError, match=r"planted: cuda:3 drops GEMM outputs"):
        makers[build]()
    assert probed == [torch.device("cuda:3")]
