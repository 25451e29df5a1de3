"""Subcommands of the ``layerskip`` CLI; each module has ``register(subparsers)``."""
