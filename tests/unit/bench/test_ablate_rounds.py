"""`bench ablate --repeats`: each round's arm against that round's baseline, then the median;
the tiers factor turns into the engine's tier settings, and the pd factor into a P/D layout."""

from pagedserve.bench.ablate import AblateConfig, Arm, ArmResult, arms, median_ratio_rows


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


def test_the_tiers_arm_configures_both_tiers():
    base, tiers = arms(["tiers"])
    config = AblateConfig(host_tier_bytes=1 << 20, disk_tier_bytes=1 << 24)
    assert "kv_host_tier_bytes" not in config.cluster(base, "/tmp/x")["engine"]
    engine = config.cluster(tiers, "/tmp/x")["engine"]
    assert (engine["kv_host_tier_bytes"], engine["kv_disk_tier_dir"]) == (1 << 20, "/tmp/x")
    assert engine["kv_disk_tier_bytes"] == 1 << 24 and "kv_tiers" not in engine


def test_the_pd_arm_makes_one_prefill_and_one_decode_worker():
    base, pd = arms(["pd"])
    config = AblateConfig(num_workers=2)
    assert "prefill_workers" not in config.cluster(base)["scaling"]
    cluster = config.cluster(pd)
    scaling = cluster["scaling"]
    assert (scaling["prefill_workers"], scaling["decode_workers"]) == (1, 1)
    assert scaling["num_workers"] == 2 and "pd_layout" not in cluster["engine"]
    from pagedserve.cluster.config import ClusterConfig

    assert ClusterConfig.from_dict(cluster).scaling.disaggregated
