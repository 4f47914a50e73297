"""How every benchmark's --help reads: each option's help ends with its default."""

from __future__ import annotations

import argparse
import copy


class DefaultsSaid(argparse.HelpFormatter):
    """Each option's help ends with its default, unless the help says it itself (or there is
    none to say: None, a flag's False), so that what --help says is what a run uses; an option
    without a help text still gets a line with its default."""

    def _format_action(self, action: argparse.Action) -> str:
        if action.help is None and _has_default(action):
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or not _has_default(action):
            return text
        return text + " (default: %(default)s)"


def _has_default(action: argparse.Action) -> bool:
    return bool(action.option_strings) and action.default not in (None, False, argparse.SUPPRESS)
