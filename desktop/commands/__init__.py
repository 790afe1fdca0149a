"""CLI subcommands, one module per area, each exposing `register(subparsers)`."""
