"""Every backend against the single-process reference on 4 real gloo ranks."""
import pytest
import torch

import expertrail as er

import backends_ranks
import kernels_ranks
import ranks_common


@pytest.mark.parametrize("domain_size", [1, 2, 4])
@pytest.mark.parametrize("backend", sorted(er.BACKENDS))
def test_backend_matches_reference_forward_and_backward(world4, backend, domain_size):
    assert world4.run(backends_ranks.check_backend, backend, None, domain_size) == [8] * 4


@pytest.mark.parametrize("backend", sorted(er.BACKENDS))
def test_rows_bitwise_equal_across_backends_and_runs(world4, backend):
    """Same inputs: same rows in the same order on every backend, and the same combine bits run to run."""
    for dtype in (torch.float32, torch.bfloat16):
        base = world4.run(ranks_common.dispatch_rows, "alltoall", 2, "random", dtype)
        first = world4.run(ranks_common.dispatch_rows, backend, 2, "random", dtype)
        again = world4.run(ranks_common.dispatch_rows, backend, 2, "random", dtype)
        for b, f, a in zip(base, first, again):
            assert torch.equal(f[0], b[0]) and torch.equal(f[1], b[1]) and torch.equal(f[2], b[2])
            assert torch.equal(f[3], a[3]), "combine is not bitwise reproducible"
            fp32 = dtype == torch.float32   # bf16: partial sums are rounded where they cross a link
            torch.testing.assert_close(f[3].float(), b[3].float(), rtol=1e-6 if fp32 else 2e-2, atol=1e-6 if fp32 else 1e-2)


@pytest.mark.parametrize("land_in_place", [True, False])
def test_alltoall_both_layouts_match_reference(world4, land_in_place):
    """Runs landing in place, and blocks plus a local permutation: the reference's rows, combine
    and gradients (every scenario, fp32 and bf16), with padding and capacity drops, and on the
    Triton path (interpreted on the CPU)."""
    assert world4.run(backends_ranks.check_backend, "alltoall", None, 2, land_in_place=land_in_place) == [8] * 4
    world4.run(backends_ranks.check_options, "alltoall", 2, 8, 0.5, "position", True, land_in_place=land_in_place)
    world4.run(backends_ranks.check_options, "alltoall", 1, 4, None, "probs", False, land_in_place=land_in_place)
    world4.run(kernels_ranks.triton_path_matches_torch, "alltoall", land_in_place=land_in_place)


def test_alltoall_layouts_give_the_same_bits(world4):
    for dtype in (torch.float32, torch.bfloat16):
        runs = world4.run(ranks_common.dispatch_rows, "alltoall", 2, "random", dtype, land_in_place=True)
        blocks = world4.run(ranks_common.dispatch_rows, "alltoall", 2, "random", dtype, land_in_place=False)
        for r, b in zip(runs, blocks):
            assert all(torch.equal(u, v) for u, v in zip(r, b))


def test_alltoall_lands_in_place_from_the_threshold_run_size(world4):
    for picks, small, landed in world4.run(backends_ranks.alltoall_layout_choice):
        for (num_experts, hidden, at_threshold), lands in picks.items():
            # One local expert: a single run per peer, always in place; else from the threshold on.
            assert lands == (num_experts == 4 or at_threshold), (num_experts, hidden, at_threshold)
        assert not small and landed     # a tiny dispatch sends blocks unless told to land in place


def test_hierarchical_splits_its_domain_hop_only_across_domains(world4):
    """With several domains of several ranks, the domain hop is a SplitHop whose early part
    forwards only the rail hop's own block and whose late pieces are the rail hop's pieces of
    the other domain's block, in order; with one domain, or domains of one rank, it is not. A
    block is cut into no more pieces than keep ``pipeline_min_rows`` rows each, and by default
    not at all where every rank shares the host (the emulated cluster's nodes do not:
    tests/test_cluster.py runs the pipeline there)."""
    for domain_size, split in ((2, True), (1, False), (4, False)):
        for chunks, min_rows in ((None, 1), (1, 1), (3, 1), (3, 1000)):
            used = []
            for rank, (kinds, early_ok, pieces) in enumerate(
                    world4.run(backends_ranks.hierarchical_hop_kinds, domain_size, chunks, min_rows)):
                assert ("SplitHop" in kinds) == split, (domain_size, kinds)
                assert early_ok is (True if split else None)
                count = 1 if chunks is None else chunks          # by default no pipeline on one host
                other = 1 - rank // 2
                assert [p[:2] for p in pieces] == ([(other, j) for j in range(count)] if split else [])
                used.append(sum(full for *_, full in pieces))
            if split:
                # pieces of one row or more: some rank's block (of several rows) is cut; of 1000
                # rows or more: every block here (a few rows) goes whole
                whole = min_rows == 1000 or chunks in (None, 1)
                assert (max(used) == 1) if whole else (max(used) >= 2), (chunks, min_rows, used)


@pytest.mark.parametrize("chunks", [1, 3, 16])
def test_hierarchical_pipeline_chunks_match_reference(world4, chunks):
    """Any number of pieces (more than a block has rows too): rows, combine and gradients as
    the reference's."""
    assert world4.run(backends_ranks.check_backend, "hierarchical", None, 2, pipeline_chunks=chunks,
                      pipeline_min_rows=1) == [8] * 4


@pytest.mark.parametrize("backend", sorted(er.BACKENDS))
def test_route_describes_its_exchanges(world4, backend):
    """`Route.exchanges`: one per communicating hop, with the peers of its group, and the rows
    they send add up to the dispatch's stats."""
    for rank, (exchanges, rows_match) in enumerate(world4.run(backends_ranks.route_exchanges, backend, 2)):
        assert rows_match, (backend, rank)
        if backend == "hierarchical":
            rail, domain = [rank % 2, rank % 2 + 2], [rank // 2 * 2, rank // 2 * 2 + 1]
            assert exchanges == [("all-to-all", rail), ("all-to-all", domain)]
        else:
            assert exchanges == [("all-gather" if backend == "allgather" else "all-to-all", [0, 1, 2, 3])]


@pytest.mark.parametrize("backend", sorted(er.BACKENDS))
@pytest.mark.parametrize("alignment,capacity_factor,policy,pad", [
    (4, None, "probs", False), (1, 0.5, "probs", False), (1, 0.5, "position", False),
    (1, 0.75, "probs", True), (8, 0.5, "position", True)])
def test_alignment_capacity_and_unweighted_combine(world4, backend, alignment, capacity_factor, policy, pad):
    padding = world4.run(backends_ranks.check_options, backend, 2, alignment, capacity_factor, policy, pad)
    if pad or alignment > 1:
        assert sum(padding) > 0, "the case was meant to produce padding rows"


@pytest.mark.parametrize("backend", sorted(er.BACKENDS))
def test_distributed_gradcheck_fp64(world4, backend):
    assert all(n > 0 for n in world4.run(backends_ranks.dist_gradcheck, backend, 2)[:1])


@pytest.mark.parametrize("domain_size", [1, 2, 4])
def test_bytes_are_the_minimum_each_algorithm_promises(world4, domain_size):
    for backend in sorted(er.BACKENDS):
        results = world4.run(backends_ranks.bytes_moved, backend, domain_size)
        if backend != "allgather":
            # Combine sends back what each rank received: the same rows per link class in total.
            for link in ("self", "intra", "inter"):
                sent = sum(r["stats"][0][link] for r in results)
                back = sum(r["stats"][2][link] for r in results)
                assert back == sent and sum(r["stats"][3][link] for r in results) == back * 32
        for rank, r in enumerate(results):
            rows, nbytes, back_rows, back_bytes = r["stats"]
            data = r["row_bytes"]
            if backend == "alltoall":
                expect = {"self": r["self_pairs"], "intra": r["remote_pairs_intra"], "inter": r["remote_pairs_inter"]}
                meta = 16
            elif backend == "dedup":
                expect = {"self": r["ranks_self"], "intra": r["ranks_intra"], "inter": r["ranks_inter"]}
                meta = 16 * 4
            elif backend == "hierarchical":
                # Only hop 1 crosses domains: one row per (token, remote domain).
                assert rows["inter"] == r["remote_domains"]
                assert nbytes["inter"] == r["remote_domains"] * (data + 8 * (2 + 2 * 4))
                continue
            else:  # allgather: every (padded) token to every peer
                most = max(r["num_tokens"])
                expect = {"self": most, "intra": most * (domain_size - 1), "inter": most * (4 - domain_size)}
                meta = 16 * 4
            assert rows == expect, (backend, rank, rows, expect)
            assert nbytes == {k: v * (data + meta) for k, v in expect.items()}


@pytest.mark.parametrize("backend", sorted(er.BACKENDS))
def test_chunked_overlap_gives_identical_results(world4, backend):
    tokens = world4.run(backends_ranks.chunked_matches_unchunked, backend, 3)
    assert 0 in tokens  # a rank with no tokens takes part in every chunk


@pytest.mark.parametrize("backend", sorted(er.BACKENDS))
def test_combine_uses_weights_the_caller_changed(world4, backend):
    world4.run(backends_ranks.replaced_weights_are_used, backend)


@pytest.mark.parametrize("backend", sorted(er.BACKENDS))
def test_planner_counts_the_rows_and_bytes_the_engine_sends(world4, backend):
    """One traffic model: the planner's per-link rows and bytes (payload plus the engine's
    metadata) equal what every backend handed to its collectives, summed over ranks (random routing with -1 slots and an empty rank; one expert)."""
    from expertrail.plan.cost import EPLayout, metadata_bytes, rows_by_link
    row_bytes = 8 * 4 + metadata_bytes(backend, 4)          # hidden 8, fp32, top-4
    for domain_size in (1, 2, 4):
        for scenario in ("random", "one_expert", "duplicates_free_full"):
            results = world4.run(backends_ranks.rows_per_link, backend, domain_size, scenario)
            engine_rows = {c: sum(r[0][c] for r in results) for c in ("self", "intra", "inter")}
            engine_bytes = {c: sum(r[1][c] for r in results) for c in ("self", "intra", "inter")}
            planner = rows_by_link(results[0][2], 16, EPLayout(4, domain_size), backend)
            assert planner == engine_rows, (domain_size, scenario, planner, engine_rows)
            assert {c: n * row_bytes for c, n in planner.items()} == engine_bytes, (domain_size, scenario)


@pytest.mark.parametrize("backend", sorted(er.BACKENDS))
def test_fp8_payload_matches_the_quantized_reference(world4, backend):
    """payload="fp8" on every backend: the rows of the quantized input, bitwise (the same on
    every backend), within e4m3's step; fp8 output with scales; combine and gradients in x's
    dtype; dispatch bytes as the planner counts fp8 rows."""
    from expertrail.plan.catalog import MoEModel
    from expertrail.plan.cost import EPLayout, metadata_bytes, row_bytes, rows_by_link
    for domain_size, scenario, dtype in ((1, "random", torch.bfloat16), (2, "one_rank", torch.float32),
                                         (4, "one_expert", torch.bfloat16)):
        results = world4.run(backends_ranks.fp8_payload, backend, domain_size, scenario, dtype)
        rows = rows_by_link(results[0][3], 16, EPLayout(4, domain_size), backend)
        model = MoEModel(name="t", hidden=200, num_experts=16, topk=4, moe_ffn=8, layers=1)
        wire = row_bytes(model, "fp8", "dispatch") + metadata_bytes(backend, 4)
        fp8_bytes = {c: sum(r[1][c] for r in results) for c in rows}
        assert fp8_bytes == {c: n * wire for c, n in rows.items()}, (domain_size, scenario)


def test_fp8_rows_are_the_same_on_every_backend(world4):
    tokens = {b: world4.run(backends_ranks.fp8_payload, b, 2, "random", torch.bfloat16) for b in sorted(er.BACKENDS)}
    first = next(iter(tokens.values()))
    for b, results in tokens.items():
        for mine, theirs in zip(results, first):
            assert torch.equal(mine[0], theirs[0]), b


@pytest.mark.parametrize("backend", sorted(er.BACKENDS))
def test_workspace_reuses_buffers_safely(world4, backend):
    assert all(sizes[0] > 0 for sizes in world4.run(backends_ranks.workspace_reuse, backend))
