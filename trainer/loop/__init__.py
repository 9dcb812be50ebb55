"""The training loop behind `python -m trainer`: flags, data, model, steps, checkpoints.

trainer/loop/train.py reads top to bottom as the steps of a run; the study tools
around the loop (bench, compare) are one folder up.
"""
