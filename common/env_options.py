"""Command-line options that containers set as BATCHWIRE_<OPTION> environment variables.

One reader for both services' command lines (`batchwire serve|scheduler` and
`python -m worker_svc`): an option's variable, when set, replaces its built-in default, and a flag
on the command line wins over both.
"""

from __future__ import annotations

import os
from typing import Any

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


def env_name(option: str) -> str:
    """'--no-prefix-caching' or 'no_prefix_caching' -> 'BATCHWIRE_NO_PREFIX_CACHING'."""
    return "BATCHWIRE_" + option.lstrip("-").replace("-", "_").upper()


def env_default(option: str, default: Any) -> Any:
    """The option's default: its variable's text when set, else `default`. argparse converts a
    text default with the option's `type`, so a bad value is refused naming the option."""
    value = os.environ.get(env_name(option))
    return default if value is None else value


def env_bool(option: str) -> bool | None:
    """A yes/no option's variable: True or False, or None when it is unset or neither."""
    value = os.environ.get(env_name(option), "").lower()
    return True if value in TRUE else False if value in FALSE else None


def env_flag(option: str, default: bool = False) -> bool:
    """An on/off option's default: `default` when its variable is unset, else whether the
    variable says yes (1, true, yes, on)."""
    if env_name(option) not in os.environ:
        return default
    return env_bool(option) is True
