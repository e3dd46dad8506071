"""`python -m harmonaize_cli`: the `harmonaize` command, for a checkout without its entry point installed."""

from harmonaize_cli.main import main

main()
