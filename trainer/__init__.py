"""The trainer: `python -m trainer` trains a torchvision ResNet, data-parallel.

    mpirun -np 4 python -m trainer                  # embedded dataset, no files needed
    python -m trainer --help                         # the manual
"""
