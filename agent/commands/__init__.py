"""One module per ``ridgeline`` subcommand; each exposes ``register(subparsers)``."""
