"""`bench ablate`'s arms (bench/ablate_arms.py): the tiers factor turns into the engine's tier
settings, and the pd factor into a P/D layout."""

from pagedserve.bench.ablate_arms import AblateConfig, arms


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
