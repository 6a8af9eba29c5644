"""`pagedserve serve` flags come from ClusterConfig's sections and EngineConfig: names,
choices, help; a flag lands in its section of the config data."""

from __future__ import annotations

import dataclasses

import pytest

from pagedserve.cli import build_parser
from pagedserve.cluster.config import FAILURE_MODES, SECTIONS, ClusterConfig
from pagedserve.cluster.routing.policies import policy_names
from pagedserve.cluster.serve.cli import ENGINE_FIELDS_SET_BY_THE_CLUSTER, cluster_config_from_args
from pagedserve.cluster.serve.node_layout import NodeResources
from pagedserve.kernels.backends import BACKENDS
from pagedserve.workers.config_flags import attribute_docs
from pagedserve.workers.engine.config import EngineConfig
from pagedserve.workers.kv.manager import ALLOCATION_MODES
from pagedserve.workers.scheduler.policy import PREEMPTION_MODES, SchedulingPolicy

# The machine the defaults are sized to in these tests: 2 cores on one NUMA node, 8 GiB free.
NODE = NodeResources(numa_cores=((0, 1),), available_bytes=8 << 30, num_gpus=0)


def _serve_args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def _serve_actions() -> dict[str, object]:
    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]
    return {action.dest: action for action in serve._actions}


@pytest.mark.parametrize("config_class", [ClusterConfig, EngineConfig, *SECTIONS.values()])
def test_every_config_field_has_help(config_class):
    docs = attribute_docs(config_class)
    assert [f.name for f in dataclasses.fields(config_class) if not docs.get(f.name)] == []


def test_the_flags_users_know_keep_their_names():
    args = _serve_args(
        "--model", "m", "--num-workers", "3", "--routing-policy", "round_robin",
        "--block-size", "8", "--num-kv-blocks", "64", "--kv-cache-bytes", "1024",
        "--dtype", "float16", "--on-worker-failure", "fail", "--max-num-seqs", "16",
    )  # fmt: skip
    data = cluster_config_from_args(args, num_gpus=0, node=NODE)
    assert data["engine"] == {
        "model": "m",
        "block_size": 8,
        "num_kv_blocks": 64,
        "kv_cache_bytes": 1024,
        "dtype": "float16",
        "max_num_seqs": 16,
    }
    assert data["scaling"]["num_workers"] == 3
    assert data["routing"]["routing_policy"] == "round_robin"
    assert data["failure"]["on_worker_failure"] == "fail"


def test_choices_come_from_the_registries_and_tuples():
    actions = _serve_actions()
    assert actions["routing_policy"].choices == policy_names()  # the registry, default first
    assert actions["on_worker_failure"].choices == FAILURE_MODES
    assert actions["attention_backend"].choices == BACKENDS
    assert actions["kv_allocation"].choices == ALLOCATION_MODES
    assert actions["scheduling_policy"].choices == tuple(SchedulingPolicy.registry)
    assert actions["preemption_mode"].choices == PREEMPTION_MODES
    assert not set(ENGINE_FIELDS_SET_BY_THE_CLUSTER) & set(actions)


def test_flags_override_the_file_and_only_where_given(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(
        "scaling:\n  num_workers: 4\nlimits:\n  max_inflight: 7\n"
        "engine:\n  block_size: 32\n  max_num_seqs: 5\n",
        encoding="utf-8",
    )
    args = _serve_args("--config", str(path), "--block-size", "8", "--no-enable-pull")
    data = cluster_config_from_args(args, num_gpus=0, node=NODE)
    assert data["engine"] == {
        "block_size": 8,
        "max_num_seqs": 5,
        "kv_cache_bytes": int((8 << 30) * 0.4) // 4,
    }
    assert data["scaling"]["num_workers"] == 4 and data["limits"] == {"max_inflight": 7}
    assert data["routing"] == {"enable_pull": False}
    config = ClusterConfig.from_dict(data)
    assert config.engine.block_size == 8 and config.failure.stats_interval_s == 1.0


def test_a_flat_key_of_an_older_file_lands_in_its_section(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("num_workers: 3\nrouting:\n  enable_push: false\n", encoding="utf-8")
    args = _serve_args("--config", str(path), "--no-enable-pull")
    data = cluster_config_from_args(args, num_gpus=0, node=NODE)
    assert "num_workers" not in data and data["scaling"]["num_workers"] == 3
    assert data["routing"] == {"enable_push": False, "enable_pull": False}
    path.write_text("num_workers: 3\nscaling:\n  num_workers: 2\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"num_workers is given twice.*scaling\.num_workers"):
        cluster_config_from_args(_serve_args("--config", str(path)), num_gpus=0, node=NODE)


def test_a_cpu_machine_gets_two_workers_per_numa_node_sharing_its_cores_and_a_kv_share():
    data = cluster_config_from_args(_serve_args(), num_gpus=0, node=NODE)
    assert (data["scaling"]["num_workers"], data["placement"]["worker_share_cores"]) == (2, True)
    assert data["engine"]["kv_cache_bytes"] == int((8 << 30) * 0.4) // 2
    two_nodes = NodeResources(numa_cores=((0, 1, 2, 3), (4, 5, 6, 7)), available_bytes=64 << 30,
                              num_gpus=0)  # fmt: skip
    data = cluster_config_from_args(_serve_args(), num_gpus=0, node=two_nodes)
    assert (data["scaling"]["num_workers"], data["placement"]["worker_share_cores"]) == (4, True)
    assert data["engine"]["kv_cache_bytes"] == 4 << 30  # the cap per worker
    data = cluster_config_from_args(_serve_args("--num-workers", "1"), 0, node=two_nodes)
    assert (data["scaling"]["num_workers"], data["placement"]["worker_threads"]) == (1, 8)
    args = _serve_args("--num-workers", "4", "--no-worker-share-cores")
    data = cluster_config_from_args(args, 0, node=two_nodes)
    assert data["placement"] == {"worker_share_cores": False, "worker_threads": 2}


def test_joining_a_cluster_by_address_sizes_nothing_from_this_machine():
    args = _serve_args("--address", "auto")
    data = cluster_config_from_args(args, num_gpus=0, node=NODE)
    assert data["scaling"]["num_workers"] == 2 and "worker_threads" not in data["placement"]
    assert "kv_cache_bytes" not in data["engine"]


def test_machine_defaults_yield_to_flags():
    gpus = NodeResources(numa_cores=((0, 1),), available_bytes=8 << 30, num_gpus=2)
    data = cluster_config_from_args(_serve_args(), num_gpus=2, node=gpus)
    assert (data["scaling"]["num_workers"], data["engine"]["device"]) == (2, "cuda")
    assert "kv_cache_bytes" not in data["engine"]  # the engine's own: a share of the device
    args = _serve_args("--num-workers", "1", "--device", "cpu")
    data = cluster_config_from_args(args, 2, node=gpus)
    assert (data["scaling"]["num_workers"], data["engine"]["device"]) == (1, "cpu")


def test_a_bad_choice_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        _serve_args("--routing-policy", "random")
    assert "--routing-policy" in capsys.readouterr().err


def test_prefill_and_decode_worker_flags_make_a_pd_layout():
    data = cluster_config_from_args(
        _serve_args("--prefill-workers", "1", "--decode-workers", "1"), 0, node=NODE
    )
    scaling = ClusterConfig.from_dict(data).scaling
    assert (scaling.num_workers, scaling.prefill_workers, scaling.decode_workers) == (2, 1, 1)
    # Without --num-workers a larger layout sizes the pool; with it, the rest are mixed.
    data = cluster_config_from_args(
        _serve_args("--prefill-workers", "1", "--decode-workers", "2"), 0, node=NODE
    )
    assert ClusterConfig.from_dict(data).scaling.num_workers == 3
    args = _serve_args("--prefill-workers", "1", "--decode-workers", "1", "--num-workers", "4")
    assert ClusterConfig.from_dict(cluster_config_from_args(args, 0, NODE)).scaling.num_workers == 4
    with pytest.raises(ValueError, match="decode_workers"):
        args = _serve_args("--prefill-workers", "1", "--decode-workers", "2", "--num-workers", "2")
        ClusterConfig.from_dict(cluster_config_from_args(args, 0, NODE))


def test_lora_modules_take_vllms_flag_shape():
    args = _serve_args("--lora-modules", "sql=/a/sql", "chat=/a/chat", "--max-loras", "2")
    config = ClusterConfig.from_dict(cluster_config_from_args(args, num_gpus=0, node=NODE))
    assert config.engine.lora_modules == ("sql=/a/sql", "chat=/a/chat")
    assert config.engine.max_loras == 2
    with pytest.raises(ValueError, match="NAME=PATH"):
        ClusterConfig.from_dict({"engine": {"lora_modules": ["sql"]}})
