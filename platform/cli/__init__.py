"""The ``raylane`` command line (typer): :mod:`raylane.cli.app` is what every command
shares; each other module holds one family of commands."""

from raylane.cli import commands, control, devcluster, submit, tune
from raylane.cli.app import app

control.register(app)  # the commands that talk to a running job
submit.register(app)  # Ray Jobs API commands
tune.register(app)  # searches
devcluster.register(app)  # the local dev cluster

__all__ = ["app", "commands", "main"]


def main() -> None:
    app(prog_name="raylane")
