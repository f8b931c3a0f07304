"""`pdlab`: every subcommand names a module that exists, and runs it as `python -m` would."""
import importlib.util
import subprocess
import sys

import pytest

from experiments import cli


def test_every_subcommand_names_a_module_with_a_main():
    for name, (module, _) in {**cli.COMMANDS, **cli.BENCHES}.items():
        spec = importlib.util.find_spec(module)
        assert spec is not None, f"pdlab {name}: no module {module}"
        assert "__main__" in open(spec.origin).read() or spec.submodule_search_locations, module


def test_resolve_and_its_errors():
    assert cli.resolve(["run", "repeats=1"]) == ("pdlab run", "experiments.run", ["repeats=1"])
    assert cli.resolve(["bench", "sim", "--requests", "5"])[1:] == ("experiments.sim.bench", ["--requests", "5"])
    for bad, said in ((["nope"], "unknown command 'nope'"), (["bench", "nope"], "unknown benchmark 'nope'"),
                      ([], "usage: pdlab COMMAND")):
        with pytest.raises(SystemExit, match=said):
            cli.resolve(bad)


def test_a_subcommand_runs_its_module_with_the_arguments():
    out = subprocess.run([sys.executable, "-m", "experiments.cli", "run", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "== Top-level keys ==" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "experiments.cli", "gpu-check", "--only", "nope"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown stage(s) ['nope']" in bad.stderr


def test_a_help_request_is_not_an_error():
    for flag in ("--help", "-h", "help"):
        out = subprocess.run([sys.executable, "-m", "experiments.cli", flag], capture_output=True, text=True)
        assert out.returncode == 0 and "usage: pdlab COMMAND" in out.stdout, flag
    bare = subprocess.run([sys.executable, "-m", "experiments.cli"], capture_output=True, text=True)
    assert bare.returncode == 1 and "usage: pdlab COMMAND" in bare.stderr
