"""Machine load accounting from /proc, and the layouts whose workers cannot get their own cores."""
import subprocess
import sys

import pytest

from cluster.isolation import DRIVER_WARNING
from experiments.serving import machine
from experiments.serving.machine import (SHARED, Snapshot, combine, driver_warning, load_warning, shared_cores, snapshot,
                                         usage)


def test_usage_splits_the_machine_into_ours_others_and_stolen():
    # 1 s on 2 cores at 100 ticks/s = 200 ticks: 150 busy (80 ours, 70 others), 10 stolen, the rest idle
    a = Snapshot(time=0.0, load_1m=1.0, cpu={"total": 1000, "busy": 400, "steal": 10}, ours=100)
    b = Snapshot(time=1.0, load_1m=2.5, cpu={"total": 1200, "busy": 550, "steal": 20}, ours=180)
    u = usage(a, b, cores=2)
    tick = machine.TICK / 100
    assert u["ours_share"] == pytest.approx(0.4) and u["other_share"] == pytest.approx(0.35)
    assert u["steal_share"] == pytest.approx(0.05)
    assert u["ours_cores"] == pytest.approx(0.8 / tick) and u["other_cores"] == pytest.approx(0.7 / tick)
    assert u["load_1m_start"] == 1.0 and u["load_1m_end"] == 2.5 and u["overloaded"] is True
    assert usage(a, Snapshot(time=1.0, load_1m=1.9, cpu=b.cpu, ours=b.ours), cores=2)["overloaded"] is False
    text = load_warning(u)
    assert text.startswith("machine overloaded: 1-minute load average 2.5 on 2 cores (other processes used")
    assert load_warning(usage(a, a, cores=2)) is None


def test_without_proc_numbers_are_null_and_nothing_is_warned():
    u = usage(Snapshot(time=0.0), Snapshot(time=1.0), cores=2)
    assert u["other_share"] is None and u["overloaded"] is False and load_warning(u) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_cpu_time_of_a_child_counts_as_ours():
    before = snapshot()
    burn = "import time\nwhile time.process_time() < 0.3: pass"
    subprocess.run([sys.executable, "-c", burn], check=True)
    after = snapshot()
    assert before.load_1m is not None and before.cpu["total"] > 0
    assert (after.ours - before.ours) / machine.TICK >= 0.25     # CPU seconds, whatever the machine's load


def test_combine_keeps_the_worst_repeat():
    reps = [{"cores": 2, "load_1m_end": 1.5, "other_cores": 0.2, "overloaded": False},
            {"cores": 2, "load_1m_end": 3.0, "other_cores": 1.1, "overloaded": True, "workers_share_cores": True}]
    c = combine(reps)
    assert c["load_1m_end_max"] == 3.0 and c["other_cores_max"] == 1.1
    assert c["overloaded"] and c["workers_share_cores"] and c["per_repeat"] == reps
    assert load_warning(c).startswith("machine overloaded: 1-minute load average 3.0 on 2 cores")


def test_a_router_without_a_core_of_its_own_is_warned_of():
    assert driver_warning({"dedicated": True, "driver_cores": None, "driver_shares_cores": True}) == DRIVER_WARNING
    assert driver_warning({"dedicated": True, "driver_cores": [2, 3], "driver_shares_cores": False}) is None
    assert driver_warning({"dedicated": True, "driver_cores": None}) is None      # a run from before the field
    assert driver_warning(None) is None


def test_workers_share_cores_when_the_layout_needs_more_than_there_are():
    assert shared_cores(3, 0, embedded=True, ray_cpus=2, cores=2) == \
        f"{SHARED} (3 workers x 1 torch thread(s) on 2 cores)"
    assert shared_cores(2, 0, embedded=True, ray_cpus=2, cores=2) is None
    assert shared_cores(2, 2, embedded=True, ray_cpus=2, cores=2).startswith(SHARED)
    assert shared_cores(8, 0, embedded=False, cores=2) is None      # an existing cluster: its nodes, not ours
