"""Composing conf/ with Hydra for the commands, and Hydra's errors as one line naming the override.

`compose_config` is for the commands that compose without @hydra.main (costs, peer, bench sim);
`exit_on_bad_overrides` is the first line of those that use it (run, plan, lesson, roofline, profile,
serve): an unknown group option or a bad override ends the command with one "config error:" line that
lists the valid options, before Hydra starts.
"""
from __future__ import annotations

from omegaconf import DictConfig

from experiments.config import CONF_DIR, ConfigError


def hydra_problem(e: Exception) -> str:
    """A Hydra error as one line; a missing group option lists the valid ones."""
    from hydra.errors import MissingConfigException

    line = str(e).strip().splitlines()[0]
    if isinstance(e, MissingConfigException) and e.options:
        group = (e.missing_cfg_file or "").rsplit("/", 1)[0]
        line += f"; {group} can be one of: " + ", ".join(e.options)
    return line


def compose_config(name: str, overrides: list[str]) -> DictConfig:
    """conf/<name>.yaml composed with `overrides`, for the commands that compose without @hydra.main; a
    Hydra error (an unknown group option, a bad override) raises ConfigError in one line naming it."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            return compose(name, overrides=overrides)
    except HydraException as e:
        raise ConfigError(hydra_problem(e)) from None


def precheck(argv: list[str], name: str = "config") -> str | None:
    """Compose conf/<name>.yaml with the command line's overrides once (the first value of each sweep),
    so that a Hydra error is reported as one line naming the override, before Hydra starts; None: fine."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    args = [a for a in argv if not a.startswith("-") and "=" in a and not a.lstrip("+~").startswith("hydra")]
    try:
        parsed = OverridesParser.create().parse_overrides(args)
        firsts = []
        for o in parsed:
            if o.is_delete():
                firsts.append(o.get_key_element())
                continue
            value = next(iter(o.sweep_string_iterator())) if o.is_sweep_override() else o.get_value_element_as_str()
            firsts.append(f"{o.get_key_element()}={value}")
        compose_config(name, firsts)
    except ConfigError as e:
        return str(e)
    except Exception as e:
        return hydra_problem(e)
    return None


def exit_on_bad_overrides(name: str) -> None:
    """A Hydra command's first line: exit 2 with one "config error:" line when its overrides cannot compose."""
    import sys

    problem = precheck(sys.argv[1:], name)
    if problem:
        print(f"config error: {problem}", file=sys.stderr)
        sys.exit(2)
