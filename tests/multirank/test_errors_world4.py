"""Bad input on one rank raises a clear error on every rank: no hang, no silent wrong result."""
import pytest

import expertrail as er

import errors_ranks

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
    errors = world4.run_expect_error(errors_ranks.bad_dispatch, kind, 2, backend)
    assert all(isinstance(e, er.InvalidInputError) for e in errors.values())
    assert INPUT_ERRORS[kind] in str(errors[2]), str(errors[2])
    for rank in (0, 1, 3):
        assert "EP rank 2" in str(errors[rank]), str(errors[rank])
    assert sum(world4.run(errors_ranks.healthy_dispatch, backend)) > 0


CONSTRUCTION_ERRORS = {
    "experts_not_divisible": (er.ConfigError, "num_experts=6 must be a positive multiple of ep_size=4"),
    "domain_not_dividing": (er.ConfigError, "domain_size=3 must divide ep_size=4"),
    "ep_not_dividing": (er.ConfigError, "ep_size=3 must divide the group size 4"),
    "num_experts_differ": (er.ConfigMismatchError, "num_experts: rank 0=16, rank 1=8"),
    "hidden_differs": (er.ConfigMismatchError, "hidden: rank 0=32, rank 1=32, rank 2=32, rank 3=64"),
    "backend_differs": (er.ConfigMismatchError, "backend: rank 0='alltoall', rank 1='dedup', rank 2='alltoall'"),
    "unknown_backend": (er.ConfigError, "unknown backend 'ring'"),
    "alignment": (er.ConfigError, "expert_alignment=0 must be >= 1"),
    "layout_differs": (er.ConfigMismatchError, "backend options: rank 0={'land_in_place': False}, rank 1="),
    "bad_layout": (er.ConfigError, "land_in_place='yes'; use True, False or None"),
    "unknown_option": (er.ConfigError, "dedup: unknown option(s) hiden; the options are hidden, expert_alignment"),
    "option_of_another_backend": (er.ConfigError, "dedup: unknown option(s) land_in_place"),
}


@pytest.mark.parametrize("kind", sorted(CONSTRUCTION_ERRORS))
def test_bad_construction_raises_on_every_rank(world4, kind):
    cls, text = CONSTRUCTION_ERRORS[kind]
    errors = world4.run_expect_error(errors_ranks.bad_construction, kind)
    for exc in errors.values():
        assert isinstance(exc, cls) and text in str(exc), repr(exc)
    assert sum(world4.run(errors_ranks.healthy_dispatch)) > 0


def test_hidden_size_differing_between_calls_raises_everywhere(world4):
    errors = world4.run_expect_error(errors_ranks.hidden_differs_per_call)
    for exc in errors.values():
        assert isinstance(exc, er.InvalidInputError)
        assert "hidden differs across EP ranks (rank 0=6, rank 1=4" in str(exc)


def test_dtype_differing_between_ranks_is_named(world4):
    for exc in world4.run_expect_error(errors_ranks.dtype_differs_per_call).values():
        assert "dtype differs across EP ranks (rank 0=float32, rank 1=bfloat16, rank 2=float32" in str(exc), str(exc)


COMBINE_ERRORS = {
    "wider": "expert_out has width 8 but dispatch moved rows of hidden size 4",
    "fewer_rows": "expert_out must be [",
    "integer": "expert_out must be floating point, got torch.int64",
    "rank3": "expert_out must be [",
    "device": "expert_out is on meta but res.tokens is on cpu",
    "not_a_tensor": "expert_out must be a tensor",
}


@pytest.mark.parametrize("backend", sorted(er.BACKENDS))
@pytest.mark.parametrize("kind", sorted(COMBINE_ERRORS))
def test_bad_expert_out_on_one_rank_raises_on_every_rank(world4, kind, backend):
    messages = world4.run(errors_ranks.bad_combine, kind, 2, backend)
    assert COMBINE_ERRORS[kind] in messages[2], messages[2]
    for rank in (0, 1, 3):
        assert "invalid expert_out on EP rank 2" in messages[rank], messages[rank]


@pytest.mark.parametrize("backend", sorted(er.BACKENDS))
def test_wider_expert_out_on_every_rank_raises_on_every_rank(world4, backend):
    for message in world4.run(errors_ranks.bad_combine, "wider", None, backend):
        assert COMBINE_ERRORS["wider"] in message, message


@pytest.mark.parametrize("backend", sorted(er.BACKENDS))
def test_combine_needing_grad_on_one_rank_only_raises_everywhere(world4, backend):
    for message in world4.run(errors_ranks.bad_combine, "needs_grad", 2, backend):
        assert "whether gradients are needed differs across EP ranks" in message
        assert "rank 2=True" in message and "rank 0=False" in message


@pytest.mark.parametrize("backend", sorted(er.BACKENDS))
def test_expert_out_in_another_dtype_is_cast_to_the_dispatched_dtype(world4, backend):
    errors = world4.run(errors_ranks.combine_casts_to_dispatched_dtype, backend)
    assert max(errors) > 0       # rank 1's expert rows went through bf16 (and were not dropped)


@pytest.mark.parametrize("backend", sorted(er.BACKENDS))
def test_weights_are_applied_once_where_the_dispatcher_says(world4, backend):
    """weights_at: "expert" applies res.weights as changed (here on one rank only), exactly
    once; "source" (alltoall's default) the dispatched weights; None picks per backend."""
    for weights_at in (None, "expert", "source") if backend == "alltoall" else (None, "expert"):
        where = world4.run(errors_ranks.weights_changed_on_one_rank, backend, weights_at)
        assert where == [weights_at or ("source" if backend == "alltoall" else "expert")] * 4


def test_weights_at_source_is_refused_where_rows_are_per_rank(world4):
    errors = world4.run_expect_error(errors_ranks.weights_changed_on_one_rank, "dedup", "source")
    for exc in errors.values():
        assert isinstance(exc, er.ConfigError) and "weights_at='source' needs a backend" in str(exc), repr(exc)


def test_from_default_rejects_a_bad_timeout_on_every_rank(world4):
    for timeouts, text in (([0] * 4, "timeout=0 must be a positive number of seconds"),
                           ([-5] * 4, "timeout=-5 must be a positive"),
                           (["soon"] * 4, "timeout='soon' must be a positive"),
                           ([30, 30, 0, 30], "timeout: rank 0=30.0, rank 1=30.0, rank 2=0.0")):
        errors = world4.run_expect_error(errors_ranks.from_default_timeout, timeouts)
        for exc in errors.values():
            assert isinstance(exc, er.ConfigError) and text in str(exc), repr(exc)
