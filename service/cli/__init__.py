"""The `ringlab` command line (typer + rich). Errors are one readable line and a non-zero exit.

service.cli.commands builds the app and registers each command by name; each command lives in
the module of its concept (processes, demo, submit, watch, sweeps, results, compare, export,
kernels, database), beside what they share (console, specs, ports, text)."""

from service.cli.commands import app, main

__all__ = ["app", "main"]
