"""8 real gloo ranks: every domain size, and EP 4 inside a world of 8 (two EP groups side by side)."""
import pytest

import expertrail as er

import backends_ranks


@pytest.mark.parametrize("ep_size,domain_size", [(8, 1), (8, 2), (8, 4), (8, 8), (4, 1), (4, 2), (4, 4)])
def test_every_backend_matches_reference(world8, ep_size, domain_size):
    for backend in sorted(er.BACKENDS):
        assert world8.run(backends_ranks.check_backend, backend, ep_size, domain_size) == [8] * 8, backend


def test_group_layout_ep4_domain2(world8):
    layouts = world8.run(backends_ranks.group_layout, 4, 2)
    for rank, lay in enumerate(layouts):
        base = rank // 4 * 4
        assert lay["ep"] == list(range(base, base + 4))
        assert lay["ep_rank"] == rank % 4
        assert lay["domain"] == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert lay["rail"] == [base + rank % 2, base + 2 + rank % 2]
        assert lay["domain_index"] == (rank % 4) // 2 and lay["domain_rank"] == rank % 2


def test_domain_size_defaults_from_environment(world8):
    hybrid = world8.run(backends_ranks.group_layout, None, None, {"NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN": "4"})
    assert all(lay["domain_size"] == 4 for lay in hybrid)
    local = world8.run(backends_ranks.group_layout, None, None, {"LOCAL_WORLD_SIZE": "2"})
    assert all(lay["domain_size"] == 2 for lay in local)
