"""`python -m trainer`: the training loop; see trainer/loop/cli.py for the flags, or --help."""
from .loop.train import main

main()
