"""afd_tools.run.capacity: a model whose routed experts cannot fit a GPU is refused before
any process starts, with both sizes and what to change; one that fits is not, nor a run
that starts no FFN rank, nor one whose GPU memory nvidia-smi cannot tell."""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_nvidia_smi import fake_nvidia_smi

from afd_models import preset
from afd_tools.prefill.workload import WorkloadError
from afd_tools.run.capacity import (
    GIB,
    check_experts_fit,
    largest_gpu_memory,
    routed_expert_bytes,
)
from afd_tools.run.devices import place

H100 = 81_559 * (1 << 20)  # an H100 80GB as torch reports it (79.6 GiB)
H200 = 143_771 * (1 << 20)
AFD = ("async", "sync", "colocated")


def test_routed_expert_bytes_count_every_moe_layers_gate_up_and_down() -> None:
    v3 = preset("v3-slice")  # 4 MoE layers of 256 experts, 7168 x 2048
    assert routed_expert_bytes(v3, "bfloat16") == 4 * 256 * 3 * 7168 * 2048 * 2
    assert routed_expert_bytes(v3, "float32") == 2 * routed_expert_bytes(v3, "bfloat16")
    v2 = preset("v2-lite")  # layer 0 is dense: 26 MoE layers of 64 experts, 2048 x 1408
    assert routed_expert_bytes(v2, "bfloat16") == 26 * 64 * 3 * 2048 * 1408 * 2


def test_v3_slice_on_one_h100_is_refused_with_both_sizes_and_what_to_change() -> None:
    placement = place("cuda", 2, 1, share_gpus=True, gpus=1)
    with pytest.raises(WorkloadError) as refused:
        check_experts_fit(preset("v3-slice"), "bfloat16", placement, AFD, H100)
    message = str(refused.value)
    assert "the routed experts do not fit cuda:0" in message
    assert "84.0 GiB" in message
    assert "79.6 GiB" in message
    assert "4 MoE layers x 256 experts / 1 FFN ranks, bfloat16" in message
    assert "use fewer --layers, or more --ffn-ranks on more GPUs" in message


def test_what_fits_is_not_refused() -> None:
    one_gpu = place("cuda", 2, 1, share_gpus=True, gpus=1)
    check_experts_fit(preset("v3-slice"), "bfloat16", one_gpu, AFD, H200)
    three = preset("v3-slice", num_layers=3)  # 63 GiB: how main-job runs 3A1F on one H200
    check_experts_fit(three, "bfloat16", place("cuda", 3, 1, True, gpus=1), AFD, H100)
    check_experts_fit(preset("v2-lite"), "bfloat16", one_gpu, AFD, H100)
    check_experts_fit(preset("v3-slice"), "bfloat16", place("cpu", 2, 1, False), AFD, 0)


def test_ffn_ranks_on_their_own_gpus_each_hold_a_share() -> None:
    """Two FFN ranks on two GPUs hold 42 GiB each: it fits two H100s, and a GPU of exactly
    half the experts, but not one byte less (then the first FFN GPU, cuda:2, is named);
    both on one GPU (--share-gpus on one) still hold all 84."""
    v3 = preset("v3-slice")
    half = routed_expert_bytes(v3, "bfloat16") // 2
    spread = place("cuda", 2, 2, share_gpus=False, gpus=4)
    check_experts_fit(v3, "bfloat16", spread, AFD, H100)
    check_experts_fit(v3, "bfloat16", spread, AFD, half)
    with pytest.raises(WorkloadError, match=r"do not fit cuda:2: its 1 FFN rank\(s\) hold 42\.0"):
        check_experts_fit(v3, "bfloat16", spread, AFD, half - 1)
    with pytest.raises(WorkloadError, match=r"its 2 FFN rank\(s\) hold 84\.0 GiB"):
        check_experts_fit(v3, "bfloat16", place("cuda", 2, 2, True, gpus=1), AFD, H100)


def test_the_lower_bound_is_the_experts_alone() -> None:
    """A GPU exactly the experts' size passes (the check never refuses what could fit);
    one byte less is refused."""
    v3 = preset("v3-slice")
    size = routed_expert_bytes(v3, "bfloat16")
    placement = place("cuda", 1, 1, share_gpus=True, gpus=1)
    check_experts_fit(v3, "bfloat16", placement, AFD, size)
    with pytest.raises(WorkloadError):
        check_experts_fit(v3, "bfloat16", placement, AFD, size - 1)
    assert size / GIB == pytest.approx(84.0)


def test_a_run_that_starts_no_ffn_rank_or_cannot_read_the_memory_is_not_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--mode colocated`` places FFN ranks but starts none (dp-ep spreads the experts
    over every GPU); a GPU whose memory nvidia-smi cannot tell is not guessed at."""
    v3 = preset("v3-slice")
    spread = place("cuda", 3, 1, share_gpus=False, gpus=4)
    check_experts_fit(v3, "bfloat16", spread, ("colocated",), H100)
    with pytest.raises(WorkloadError):
        check_experts_fit(v3, "bfloat16", spread, ("sync",), H100)
    from afd_tools.run import capacity

    monkeypatch.setattr(capacity, "largest_gpu_memory", lambda: None)  # nvidia-smi cannot say
    check_experts_fit(v3, "bfloat16", spread, AFD)


def test_the_memory_is_the_largest_gpu_nvidia_smi_lists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_nvidia_smi(tmp_path, monkeypatch, 'printf "81559\\n143771\\n"')
    assert largest_gpu_memory() == 143_771 << 20


@pytest.mark.parametrize(
    "script", ["exit 9", 'echo "[N/A]"', "echo", "sleep 60"], ids=["fails", "n/a", "empty", "hangs"]
)
def test_a_memory_nvidia_smi_cannot_tell_is_unknown(
    script: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from afd_tools.run import hardware

    monkeypatch.setattr(hardware, "NVIDIA_SMI_TIMEOUT_S", 2.0)  # not afd run's 30 s
    fake_nvidia_smi(tmp_path, monkeypatch, script)
    assert largest_gpu_memory() is None


def test_no_nvidia_smi_is_unknown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no nvidia-smi
    assert largest_gpu_memory() is None


def test_afd_run_refuses_it_before_any_process_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``afd run --device cuda`` on a (pretended) one-H100 machine: a one-line error, exit
    status 2, nothing started."""
    import torch

    from afd_tools.cli import main
    from afd_tools.run import capacity

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(capacity, "largest_gpu_memory", lambda: H100)
    argv = ["run", "--device", "cuda", "--share-gpus", "--preset", "v3-slice",
            "--attention-ranks", "2", "--ffn-ranks", "1", "--no-progress"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "the routed experts do not fit cuda:0" in err
    assert "use fewer --layers" in err
