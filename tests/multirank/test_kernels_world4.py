"""Dispatch and combine through the Triton kernels (interpreted on the CPU) on 4 gloo ranks."""
import pytest

import expertrail as er

import kernels_ranks

pytest.importorskip("triton")


@pytest.mark.parametrize("backend", sorted(er.BACKENDS))
def test_triton_kernels_inside_dispatch_and_combine(world4, backend):
    assert sum(world4.run(kernels_ranks.triton_path_matches_torch, backend)) > 0


@pytest.mark.parametrize("metadata_on_host", [True, False])
def test_lowlatency_mode_under_the_triton_kernels(world4, metadata_on_host):
    assert world4.run(kernels_ranks.lowlatency_under_triton, metadata_on_host) == [6] * 4
