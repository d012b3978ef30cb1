"""What every ``raylane`` command shares: the typer app, its consoles, and the one way a
command fails (a red ``error:`` line on stderr, and an exit code)."""

from __future__ import annotations

import os
import sys

import typer
from rich.console import Console
from rich.markup import escape

app = typer.Typer(
    name="raylane",
    help="Distributed training on heterogeneous, preemptible Ray clusters.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err = Console(stderr=True)

ADDRESS_HELP = ("Ray address to join (e.g. auto, or host:6379), given up after RAYLANE_CONNECT_TIMEOUT seconds (30). "
                "Default: an embedded local Ray, on 127.0.0.1 only.")


def fail(message: str, code: int = 2) -> None:
    """Say ``message`` on stderr as one ``error:`` line and leave with ``code`` (2: bad input)."""
    # escaped: a message may quote text with brackets (pip extras such as gymnasium[box2d]);
    # soft-wrapped: the terminal folds it, so a command in it stays one line to copy
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, markup=True, soft_wrap=True)
    raise typer.Exit(code)


def connect_failed(exc: Exception, code: int = 2) -> None:
    """A :class:`raylane.session.ConnectError`: said in one line. When ``ray.init`` is still
    stuck in its thread, leave at once: Ray's exit hooks would wait on it."""
    if getattr(exc, "stuck", False):
        err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, markup=True, soft_wrap=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    fail(str(exc), code)


def end(code: int) -> None:
    """Leave with ``code`` once Ray is shut down, or without waiting for it when the shutdown
    stalls: a signal to the whole process group may be stopping the embedded Ray right now,
    and a shutdown against it would wait out the core worker's 60 s reconnect."""
    from raylane import session

    if not session.shutdown_within(8.0):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if code:
        raise typer.Exit(code)
