import os
import sys

# Spawned ranks import test modules by name: make this folder importable for them.
sys.path.insert(0, os.path.dirname(__file__))
