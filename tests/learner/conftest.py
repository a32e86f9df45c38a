"""Fixtures shared by the trainer tests (tests/learner and its sub-folders)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def megatron_process():
    """World size 1 over gloo, with the CPU layer active only for this module's in-process tests."""
    from miles.learner.megatron import compat
    from miles.learner.megatron.parallel import destroy_parallel, initialize_parallel

    with compat.cpu_compat():
        initialize_parallel(1, 1, seed=0)
        try:
            yield
        finally:
            destroy_parallel()
