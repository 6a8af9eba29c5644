"""What `pagedserve serve` sizes from the machine (cluster/serve/node_layout.py): read from a fake
/sys and /proc, then planned."""

from __future__ import annotations

from pathlib import Path

from pagedserve.cluster.serve.node_layout import (
    CPU_KV_MAX_BYTES,
    CPU_KV_MEMORY_FRACTION,
    CPU_MAX_NUM_SEQS,
    NodeResources,
    model_weight_bytes,
    plan,
)

GIB = 1 << 30


def _machine(root: Path, nodes: list[str], available_kib: int | None) -> Path:
    for i, cpulist in enumerate(nodes):
        node = root / f"sys/devices/system/node/node{i}"
        node.mkdir(parents=True)
        (node / "cpulist").write_text(cpulist + "\n")
    (root / "proc").mkdir()
    lines = ["MemTotal:       32000000 kB"]
    if available_kib is not None:
        lines.append(f"MemAvailable:   {available_kib} kB")
    (root / "proc/meminfo").write_text("\n".join(lines) + "\n")
    return root


def test_cores_are_grouped_by_numa_node_and_only_usable_ones_count(tmp_path, monkeypatch):
    root = _machine(tmp_path, ["0-3", "4-7", ""], available_kib=16 * 1024 * 1024)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {1, 2, 5})
    node = NodeResources.of_this_machine(num_gpus=0, sys_root=root)
    assert node.numa_cores == ((1, 2), (5,))
    assert node.available_bytes == 16 * GIB and node.num_cores == 3


def test_a_machine_that_does_not_say_is_one_node_and_keeps_the_engine_s_pool(tmp_path, monkeypatch):
    root = _machine(tmp_path, [], available_kib=None)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    node = NodeResources.of_this_machine(num_gpus=0, sys_root=root)
    assert node.numa_cores == ((0, 1),) and node.available_bytes == 0
    layout = plan({"engine": {}}, node)
    assert layout.settings == {"num_workers": 2, "worker_share_cores": True}
    assert layout.engine == {"max_num_seqs": CPU_MAX_NUM_SEQS}  # no memory figure: no pool size


def test_two_workers_share_each_numa_node_s_cores_and_a_capped_share_of_memory():
    node = NodeResources(numa_cores=((0, 1, 2), (3, 4, 5)), available_bytes=40 * GIB, num_gpus=0)
    layout = plan({"engine": {}}, node)
    assert layout.settings == {"num_workers": 4, "worker_share_cores": True}
    assert layout.engine == {
        "max_num_seqs": CPU_MAX_NUM_SEQS,
        "kv_cache_bytes": int(40 * GIB * CPU_KV_MEMORY_FRACTION) // 4,
    }
    assert "4 worker(s) (2 per NUMA node)" in layout.describe()
    assert "the workers share the 6 core(s)" in layout.describe()
    big = NodeResources(numa_cores=((0, 1),), available_bytes=500 * GIB, num_gpus=0)
    assert plan({"engine": {}}, big).engine["kv_cache_bytes"] == CPU_KV_MAX_BYTES


def test_a_single_core_node_gets_one_worker_on_its_core():
    node = NodeResources(numa_cores=((0,),), available_bytes=8 * GIB, num_gpus=0)
    layout = plan({"engine": {}}, node)
    assert layout.settings == {"num_workers": 1, "worker_threads": 1}


def test_a_model_whose_copies_would_not_fit_gets_one_worker_per_numa_node(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    with open(model / "model.safetensors", "wb") as weights:
        weights.truncate(3 * GIB)  # sparse: only its size is read
    assert model_weight_bytes(str(model)) == 3 * GIB
    node = NodeResources(numa_cores=((0, 1, 2, 3),), available_bytes=16 * GIB, num_gpus=0)
    layout = plan({"engine": {"model": str(model)}}, node)
    assert layout.settings == {"num_workers": 1, "worker_threads": 4}
    assert "one per NUMA node: 2 copies of the model's ~3.0 GiB would pass 25%" in (
        layout.describe()
    )
    roomy = NodeResources(numa_cores=((0, 1, 2, 3),), available_bytes=64 * GIB, num_gpus=0)
    assert plan({"engine": {"model": str(model)}}, roomy).settings["num_workers"] == 2
    assert model_weight_bytes("tiny-llama") == 0 and model_weight_bytes(str(tmp_path / "x")) is None


def test_what_the_user_set_is_kept_and_shapes_the_rest():
    node = NodeResources(numa_cores=((0, 1, 2, 3),), available_bytes=8 * GIB, num_gpus=0)
    layout = plan(
        {"scaling": {"num_workers": 3}, "engine": {"num_kv_blocks": 100, "max_num_seqs": 8}},
        node,
    )
    assert layout.settings == {"worker_share_cores": True}  # the user's 3 share the 4 cores
    assert layout.engine == {}  # a block count wins over a byte budget
    assert layout.describe().startswith("the workers share the 4 core(s)")
    given = {"max_num_seqs": 8, "kv_cache_bytes": 123}
    layout = plan({"placement": {"worker_threads": 1}, "engine": given}, node)
    assert layout.settings == {"num_workers": 1} and layout.engine == {}
    assert layout.describe() == "4 core(s) on 1 NUMA node(s): 1 worker(s)"  # only what it chose
    layout = plan({"placement": {"worker_share_cores": False}, "engine": given}, node)
    assert layout.settings == {"num_workers": 1, "worker_threads": 4}  # threads of its own
    layout = plan({"scaling": {"num_workers": 2}, "placement": {"worker_share_cores": False}}, node)
    assert layout.settings == {"worker_threads": 2}  # the cores split, not shared
    layout = plan({"placement": {"worker_share_cores": True}}, node)
    assert layout.settings == {"num_workers": 2}  # the user's choice, and 2 workers for it
    layout = plan({"scaling": {"num_workers": 1}, "engine": given}, node)
    assert layout.settings == {"worker_threads": 4}  # alone: every core
    layout = plan(
        {"placement": {"worker_cpus": "1"}, "engine": {}}, node
    )  # pinned: a thread per its core
    assert "worker_threads" not in layout.settings
    assert "worker_share_cores" not in layout.settings


def test_pd_roles_count_as_workers():
    node = NodeResources(numa_cores=((0, 1),), available_bytes=8 * GIB, num_gpus=0)
    layout = plan({"scaling": {"prefill_workers": 1, "decode_workers": 2}, "engine": {}}, node)
    assert layout.settings == {"num_workers": 3, "worker_share_cores": True}
    assert "3 worker(s) for 3 P/D role(s)" in layout.describe()


def test_gpus_get_a_worker_each_and_the_device_s_own_pool():
    node = NodeResources(numa_cores=((0, 1),), available_bytes=8 * GIB, num_gpus=4)
    layout = plan({"engine": {}}, node)
    assert layout.settings == {"num_workers": 4, "worker_num_gpus": 1.0}
    assert layout.engine == {"device": "cuda"}  # the engine's own pool and max_num_seqs


def test_tensor_parallel_workers_span_k_gpus_and_split_the_cpu_kv_share():
    gpus = NodeResources(numa_cores=((0, 1),), available_bytes=8 * GIB, num_gpus=4)
    layout = plan({"engine": {"tensor_parallel_size": 2}}, gpus)
    assert layout.settings == {"num_workers": 2, "worker_num_gpus": 1.0}
    assert "one worker per GPU group of 2" in layout.describe()
    cpus = NodeResources(numa_cores=((0, 1),), available_bytes=8 * GIB, num_gpus=0)
    layout = plan({"engine": {"tensor_parallel_size": 2}}, cpus)
    # `kv_cache_bytes` is per rank: the worker's share of memory split over its 2 ranks.
    assert layout.engine["kv_cache_bytes"] == int(8 * GIB * CPU_KV_MEMORY_FRACTION) // 2
    # One worker (its ranks split the cores: 1 thread each), not two sharing them.
    assert layout.settings == {"num_workers": 1, "worker_threads": 2}


def test_a_cpu_worker_admits_vllm_s_128_sequences_unless_the_user_said():
    node = NodeResources(numa_cores=((0, 1),), available_bytes=8 * GIB, num_gpus=0)
    layout = plan({"engine": {}}, node)
    assert layout.engine["max_num_seqs"] == CPU_MAX_NUM_SEQS == 128
    assert "128 sequences at once per worker" in layout.describe()
    layout = plan({"engine": {"max_num_seqs": 32}}, node)
    assert "max_num_seqs" not in layout.engine
    assert "sequences at once" not in layout.describe()
