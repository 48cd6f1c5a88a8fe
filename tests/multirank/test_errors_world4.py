"""Bad input on one rank raises a clear error on every rank: no hang, no silent wrong result."""
import pytest

import expertrail as er

import workers

INPUT_ERRORS = {
    "expert_out_of_range": "topk_idx values must be in [-1, 8)",
    "expert_below_minus_one": "topk_idx values must be in [-1, 8)",
    "k_mismatch": "topk_weights (5, 1) must have the shape of topk_idx (5, 2)",
    "n_mismatch": "topk_weights (4, 2) must have the shape of topk_idx (5, 2)",
    "nonfinite_weights": "topk_weights holds NaN or Inf",
    "x_dtype": "x must be float32, bfloat16, float16 or float64",
    "idx_dtype": "topk_idx must be an integer tensor",
    "device": "x is on meta but this EP group communicates on cpu",
    "hidden": "x has hidden size 5 but the dispatcher was built with hidden=4",
    "x_rank3": "x must be [N, H]",
}


@pytest.mark.parametrize("backend", sorted(er.BACKENDS))
@pytest.mark.parametrize("kind", sorted(INPUT_ERRORS))
def test_bad_input_on_one_rank_raises_on_every_rank(world4, kind, backend):
    errors = world4.run_expect_error(workers.bad_dispatch, kind, 2, backend)
    assert all(isinstance(e, er.InvalidInputError) for e in errors.values())
    assert INPUT_ERRORS[kind] in str(errors[2]), str(errors[2])
    for rank in (0, 1, 3):
        assert "EP rank 2" in str(errors[rank]), str(errors[rank])
    assert sum(world4.run(workers.healthy_dispatch, backend)) > 0


CONSTRUCTION_ERRORS = {
    "experts_not_divisible": (er.ConfigError, "num_experts=6 must be a positive multiple of ep_size=4"),
    "domain_not_dividing": (er.ConfigError, "domain_size=3 must divide ep_size=4"),
    "ep_not_dividing": (er.ConfigError, "ep_size=3 must divide the group size 4"),
    "num_experts_differ": (er.ConfigMismatchError, "num_experts: rank 0=16, rank 1=8"),
    "hidden_differs": (er.ConfigMismatchError, "hidden: rank 0=32, rank 1=32, rank 2=32, rank 3=64"),
    "backend_differs": (er.ConfigMismatchError, "backend:"),
    "unknown_backend": (er.ConfigError, "unknown backend 'ring'"),
    "alignment": (er.ConfigError, "expert_alignment=0 must be >= 1"),
    "layout_differs": (er.ConfigMismatchError, "backend options (this rank: {'land_in_place': "),
    "bad_layout": (er.ConfigError, "land_in_place='yes'; use True, False or None"),
}


@pytest.mark.parametrize("kind", sorted(CONSTRUCTION_ERRORS))
def test_bad_construction_raises_on_every_rank(world4, kind):
    cls, text = CONSTRUCTION_ERRORS[kind]
    errors = world4.run_expect_error(workers.bad_construction, kind)
    for exc in errors.values():
        assert isinstance(exc, cls) and text in str(exc), repr(exc)
    assert sum(world4.run(workers.healthy_dispatch)) > 0


def test_hidden_size_differing_between_calls_raises_everywhere(world4):
    errors = world4.run_expect_error(workers.hidden_differs_per_call)
    for exc in errors.values():
        assert isinstance(exc, er.InvalidInputError)
        assert "hidden differs across EP ranks (rank 0=6, rank 1=4" in str(exc)
