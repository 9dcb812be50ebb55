"""docs/writing_a_sync_strategy.md: its code runs, and its numbers are right."""
import os
import re

import pytest

from distributed import run_world
from test_docs_figures import quoted_tutorial_bytes

TUTORIAL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs",
                        "writing_a_sync_strategy.md")


def tutorial_namespace():
    """Execute every ```python block of the tutorial, in order, in one namespace."""
    with open(TUTORIAL) as text:
        blocks = re.findall(r"```python\n(.*?)```", text.read(), re.DOTALL)
    assert len(blocks) >= 4
    namespace = {}
    from collectives.sync import base
    base._REGISTRY.pop("sign", None)  # the tutorial registers it
    for block in blocks:
        exec(compile(block, TUTORIAL, "exec"), namespace)
    return namespace


def run_tutorial(comm):
    namespace = tutorial_namespace()
    losses = namespace["train_a_little"](comm)
    return (losses[0], losses[-1], namespace["bytes_per_step"](comm, "sign"),
            namespace["bytes_per_step"](comm, "allreduce"))


@pytest.mark.timeout(120)
def test_tutorial_strategy_trains_and_sends_a_quarter_of_the_bytes():
    for first, last, sign_bytes, dense_bytes in run_world(run_tutorial, 2, timeout=100):
        assert last < 0.1 * first, (first, last)
        assert (sign_bytes, dense_bytes) == quoted_tutorial_bytes()  # what the doc says
