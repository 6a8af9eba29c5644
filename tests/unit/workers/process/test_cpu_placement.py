"""CPU placement: CPU lists read and written as Linux does, the workers' shares, config errors
that name the field, and pinning a process to cores it already has (a no-op move)."""

from __future__ import annotations

import os

import pytest

from pagedserve.cluster.config import ClusterConfig, PlacementConfig
from pagedserve.workers.process.cpu_placement import (
    available_cpus,
    check_available,
    descendants,
    format_cpu_list,
    may_lower_niceness,
    niceness,
    parse_cpu_list,
    pin_process,
    process_cpus,
    set_niceness,
    worker_share,
)


@pytest.mark.parametrize(
    ("text", "cpus", "canonical"),
    [("1", (1,), "1"), ("0-3", (0, 1, 2, 3), "0-3"), ("3,0-1, 5", (0, 1, 3, 5), "0-1,3,5")],
)
def test_cpu_lists_read_and_written_as_linux_does(text, cpus, canonical):
    assert parse_cpu_list(text) == cpus
    assert format_cpu_list(cpus) == canonical


@pytest.mark.parametrize(
    ("text", "match"),
    [("", "is empty"), ("a", "'a' is not a core"), ("3-1", "'3-1' is not a range"),
     ("-1", "'-1' is not a"), ("1,,2", "'' is not a core")],
)  # fmt: skip
def test_a_bad_cpu_list_is_refused_by_name(text, match):
    with pytest.raises(ValueError, match=f"worker_cpus: {match}|worker_cpus {match}"):
        parse_cpu_list(text, "worker_cpus")


def test_workers_on_one_machine_split_the_cores_in_order():
    cpus = (0, 1, 2, 3, 4)
    assert [worker_share(cpus, i, 2) for i in range(2)] == [(0, 1), (2, 3, 4)]
    assert worker_share(cpus, 0, 1) == cpus
    with pytest.raises(ValueError, match=r"2 core\(s\) for 3 workers"):
        worker_share((0, 1), 0, 3)


def test_the_config_derives_each_worker_s_cores_and_threads():
    config = PlacementConfig(worker_cpus="0-3", control_cpus="4")
    assert [config.worker_cpu_share(i, 2) for i in range(2)] == [(0, 1), (2, 3)]
    assert [config.worker_thread_count(i, 2) for i in range(2)] == [2, 2]
    assert config.worker_cpu_share(2, 2) == (0, 1)  # a worker added past the slices shares one
    assert config.control_cpu_set == (4,)
    unpinned = PlacementConfig()
    assert unpinned.worker_cpu_share(0, 1) is None and unpinned.worker_thread_count(0, 1) is None
    assert PlacementConfig(worker_threads=3).worker_thread_count(0, 1) == 3
    data = {"scaling": {"num_workers": 1}, "placement": {"worker_cpus": "1", "control_cpus": "0"}}
    assert ClusterConfig.from_dict(data).placement.worker_cpus == "1"


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"worker_cpus": "x"}, "worker_cpus: 'x'"),
        ({"control_cpus": "2-1"}, "control_cpus: '2-1'"),
        ({"num_workers": 3, "worker_cpus": "0-1"}, r"2 core\(s\) for 3 workers"),
        ({"num_workers": 1, "worker_cpus": "1", "worker_threads": 2}, r"worker_threads \(2\)"),
    ],
)
def test_placement_errors_name_the_field(options, match):
    with pytest.raises(ValueError, match=match):
        ClusterConfig.from_dict(options)


def test_cores_the_machine_lacks_are_named():
    missing = max(available_cpus()) + 1
    with pytest.raises(ValueError, match=f"worker_cpus names cores {missing}"):
        check_available([missing], "worker_cpus")


def test_pinning_moves_every_thread_of_a_process():
    before = process_cpus()
    assert pin_process(before) >= 1  # every thread of this process, to the cores it had
    assert process_cpus() == before == available_cpus()


def test_descendants_are_found_from_proc():
    assert os.getpid() in descendants(os.getppid())


def test_workers_and_the_control_plane_run_at_an_ordinary_priority_by_default():
    config = PlacementConfig()
    assert (config.worker_nice, config.control_nice) == (0, 5)  # not Ray's 15
    assert PlacementConfig(worker_nice=None, control_nice=None).worker_nice is None
    for bad in ({"worker_nice": 20}, {"control_nice": -21}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))} must be in -20..19"):
            PlacementConfig(**bad)


def test_setting_a_process_s_niceness_to_what_it_has_is_allowed():
    assert set_niceness(niceness()) is True
    with pytest.raises(ValueError, match="-20..19"):
        set_niceness(40)


def test_may_lower_niceness_reads_cap_sys_nice_from_the_effective_capabilities(tmp_path):
    status = tmp_path / "status"
    status.write_text("Name:\tx\nCapEff:\t0000000000800000\n")  # bit 23: CAP_SYS_NICE alone
    assert may_lower_niceness(status)
    status.write_text("Name:\tx\nCapEff:\t00000000007fffff\n")  # every lower capability
    assert not may_lower_niceness(status)
    status.write_text("Name:\tx\n")
    assert not may_lower_niceness(status)


def test_may_lower_niceness_agrees_with_what_the_system_allows():
    before = niceness()
    if before == -20:
        pytest.skip("already at the lowest niceness")
    try:
        assert set_niceness(before - 1) is may_lower_niceness()
    finally:
        set_niceness(before)  # raising it back is always allowed
