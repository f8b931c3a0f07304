"""One machine, one route for the CPU linears: a real run left on engine.cpu_gemm_rows=auto takes the
route its machine's profile was timed on, so the simulator prices the engine that ran."""
import json

import pytest

from experiments.config import points
from experiments.serving.serve import engines_for
from tests.test_experiments import composed


def _spec(*overrides):
    return points(composed("compare=null", "layout=1p1d", *overrides))[0][2]


def _profile(tmp_path, **fields):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"kind": "pdlab-profile", **fields}))
    return path


@pytest.mark.parametrize("recorded", [512, None])
def test_auto_takes_the_profiles_route_for_every_role(tmp_path, recorded):
    path = _profile(tmp_path, cpu_gemm_rows=recorded)
    engines = engines_for(_spec(f"hardware.profile={path}", "model.device=cpu"))
    assert {e.cpu_gemm_rows for e in engines.values()} == {recorded}


def test_a_route_given_wins_over_the_profile(tmp_path):
    path = _profile(tmp_path, cpu_gemm_rows=512)
    engines = engines_for(_spec(f"hardware.profile={path}", "model.device=cpu", "engine.cpu_gemm_rows=256"))
    assert {e.cpu_gemm_rows for e in engines.values()} == {256}


def test_auto_stays_measured_without_a_recorded_route_or_on_a_gpu(tmp_path):
    unrecorded = _profile(tmp_path)
    engines = engines_for(_spec(f"hardware.profile={unrecorded}", "model.device=cpu"))
    assert {e.cpu_gemm_rows for e in engines.values()} == {"auto"}
    missing = tmp_path / "none.json"
    assert {e.cpu_gemm_rows for e in engines_for(_spec(f"hardware.profile={missing}")).values()} == {"auto"}
    recorded = _profile(tmp_path, cpu_gemm_rows=512)
    engines = engines_for(_spec(f"hardware.profile={recorded}", "model.device=cuda"))
    assert {e.cpu_gemm_rows for e in engines.values()} == {"auto"}


def test_a_profile_recording_a_route_no_engine_takes_is_refused_naming_it(tmp_path):
    from experiments.config import ConfigError

    path = _profile(tmp_path, cpu_gemm_rows=100)
    with pytest.raises(ConfigError, match=r"profile\.json: cpu_gemm_rows=100"):
        engines_for(_spec(f"hardware.profile={path}", "model.device=cpu"))


def test_workers_of_an_existing_cluster_measure_their_own_route(tmp_path):
    path = _profile(tmp_path, cpu_gemm_rows=512)
    engines = engines_for(_spec(f"hardware.profile={path}", "model.device=cpu", "cluster.address=auto"))
    assert {e.cpu_gemm_rows for e in engines.values()} == {"auto"}
