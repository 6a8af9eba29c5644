"""`pagedserve serve --kv-host-tier-bytes N --kv-disk-tier-dir D --kv-disk-tier-bytes M`:
the flags reach every worker's engine config (each worker with its own disk subdirectory),
and bad values are refused by name."""

from __future__ import annotations

import os

import pytest

from pagedserve.cli import build_parser
from pagedserve.cluster.config import ClusterConfig
from pagedserve.cluster.serve.cli import cluster_config_from_args


def serve_config(*argv: str) -> ClusterConfig:
    args = build_parser().parse_args(["serve", *argv])
    return ClusterConfig.from_dict(cluster_config_from_args(args, num_gpus=0))


def test_tier_flags_reach_each_workers_engine(tmp_path):
    config = serve_config(
        "--kv-host-tier-bytes", "1048576",
        "--kv-disk-tier-dir", str(tmp_path),
        "--kv-disk-tier-bytes", "8388608",
    )  # fmt: skip
    engine = config.worker_engine
    assert (engine.kv_host_tier_bytes, engine.kv_disk_tier_bytes) == (1 << 20, 8 << 20)
    assert engine.for_worker("pagedserve-worker-1").kv_disk_tier_dir == os.path.join(
        str(tmp_path), "pagedserve-worker-1"
    )
    assert engine.for_worker("../x").kv_disk_tier_dir == os.path.join(str(tmp_path), ".._x")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--kv-host-tier-bytes", "-1"], "kv_host_tier_bytes must be an integer >= 0"),
        (["--kv-disk-tier-dir", "/tmp/x"], "kv_disk_tier_bytes must be > 0"),
        (["--kv-disk-tier-bytes", "-3"], "kv_disk_tier_bytes must be an integer >= 0"),
        (["--kv-disk-tier-bytes", "10"], "kv_disk_tier_bytes is set but kv_disk_tier_dir"),
    ],
)
def test_bad_tier_settings_are_refused_by_name(argv, message):
    with pytest.raises(ValueError, match=message):
        serve_config(*argv)
