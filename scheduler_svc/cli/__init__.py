"""The `batchwire` command line (commands.py) and the Python client it uses (client.py)."""

from scheduler_svc.cli.commands import build_parser, main

__all__ = ["build_parser", "main"]
