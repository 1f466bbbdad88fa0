"""``tools/dev/mask_work.py``: the boolean mask's extra attention work, counted on paper,
against pair counts worked out by hand."""

from __future__ import annotations

import math
from types import ModuleType

import pytest
from scripts import load_script

from afd_tools.prefill.workload import Request


@pytest.fixture(scope="module")
def mask_work() -> ModuleType:
    return load_script("dev/mask_work.py")


def test_a_piece_at_zero_is_causal_in_both_forms(mask_work: ModuleType) -> None:
    assert mask_work.piece_work(0, 8) == (32.0, 32.0)
    # 4 queries at 8..11 over keys 0..11: the rectangle 4 x 12 against 4 x 8 + 16 / 2.
    assert mask_work.piece_work(8, 4) == (48.0, 40.0)


def test_one_prompt_cut_in_two_stages_costs_a_quarter_more_with_the_mask(
    mask_work: ModuleType,
) -> None:
    one = [Request(0, 1000, 0.0, 0)]
    masked, causal = mask_work.replica_work(one, 4096, 2)
    # [0, 500) causal: 125,000; [500, 1000) as a rectangle 500 x 1000 against 375,000.
    assert (masked, causal) == (625_000.0, 500_000.0)
    assert mask_work.replica_work(one, 4096, 1) == (500_000.0, 500_000.0)


def test_a_chunk_continuing_a_prompt_pays_the_rectangle_at_one_stage(
    mask_work: ModuleType,
) -> None:
    # A 2,000-token prompt under a 1,000-token budget: [0, 1000) then [1000, 2000).
    masked, causal = mask_work.replica_work([Request(0, 2000, 0.0, 0)], 1000, 1)
    assert causal == 2000 * 2000 / 2
    assert masked == 1000 * 1000 / 2 + 1000 * 2000
    assert math.isclose(masked / causal, 1.25)


def test_the_table_prints_every_replica_and_stage_count(
    mask_work: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--requests", "6", "--max-prompt-len", "2048", "--max-num-batched-tokens", "1024"]
    assert mask_work.main([*argv, "--replicas", "1,2", "--stages", "1,2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line[2:3].isdigit()]
    assert [tuple(r.split(" | ")[:2]) for r in rows] == [
        ("| 1", "1"),
        ("| 1", "2"),
        ("| 2", "1"),
        ("| 2", "2"),
    ]
    for row in rows:
        ratio = float(row.split(" | ")[2])
        assert math.isfinite(ratio)
        assert ratio >= 1.0
