"""Dispatch and combine through the Triton kernels (interpreted on the CPU) on 4 gloo ranks."""
import pytest

import expertrail as er

import kernels_ranks

pytest.importorskip("triton")


@pytest.mark.parametrize("backend", sorted(er.BACKENDS))
def test_triton_kernels_inside_dispatch_and_combine(world4, backend):
    assert sum(world4.run(kernels_ranks.triton_path_matches_torch, backend)) > 0
