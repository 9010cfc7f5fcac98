"""One module per command group; each exposes ``register(app: typer.Typer) -> None``."""
