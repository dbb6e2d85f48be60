"""`prime-trainer`: trainer + orchestrator (built in the trainer issue)."""

from __future__ import annotations

import typer

app = typer.Typer(
    help="prime-swarm trainer and orchestrator.", no_args_is_help=True, add_completion=False
)


@app.command()
def version() -> None:
    """Print the protocol version this trainer speaks."""
    from protocol import PROTOCOL_VERSION

    print(f"prime-swarm protocol v{PROTOCOL_VERSION}")


if __name__ == "__main__":
    app()
