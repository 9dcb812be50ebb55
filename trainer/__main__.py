"""`python -m trainer`: see trainer/cli.py for the flags, or run it with --help."""
from .train import main

main()
