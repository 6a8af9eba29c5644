"""`bench ablate --repeats` (bench/ablate_report.py): each round's arm against that round's
baseline, then the median."""

from pagedserve.bench.ablate_arms import Arm, ArmResult, arms
from pagedserve.bench.ablate_report import median_ratio_rows


def result(arm: Arm, throughput: float, ttft_p50: float, ttft_p99: float) -> ArmResult:
    summary = {
        "output_token_throughput": throughput,
        "ttft_s": {"median": ttft_p50, "p99": ttft_p99},
        "tpot_s": {"p99": 0.1},
        "e2e_s": {"p99": 1.0},
        "prefix_hit_rate": 0.5,
        "preemptions": 0,
        "failed": 0,
    }
    return ArmResult(arm, {}, summary=summary)


def test_median_of_per_round_ratios():
    base, tiers = arms(["tiers"])
    assert tiers.name == "kv_tiers=host+disk"
    rounds = [
        [result(base, 100, 1.0, 2.0), result(tiers, 50, 2.0, 2.0)],  # 0.5, 2.0, 1.0
        [result(base, 100, 1.0, 2.0), result(tiers, 100, 0.5, 8.0)],  # 1.0, 0.5, 4.0
        [result(base, 50, 2.0, 2.0), result(tiers, 100, 3.0, 4.0)],  # 2.0, 1.5, 2.0
    ]
    (row,) = median_ratio_rows(rounds)
    assert (row["throughput_ratio"], row["ttft_p50_ratio"], row["ttft_p99_ratio"]) == (
        1.0,
        1.5,
        2.0,
    )
    assert row["rounds"] == 3 and len(row["per_round"]) == 3
