"""The planner's cost model: calibration against published figures, byte counts against brute force."""
import json
import subprocess
import sys

import numpy as np
import pytest

from expertrail.tools.cli import main
from expertrail.errors import ConfigError
from expertrail.plan.architecture import MODELS
from expertrail.plan.catalog import HARDWARE, MoEModel, from_hf_config, load_hardware, load_model
from expertrail.plan.calibration import KERNEL_FIGURES
from expertrail.plan.cost import EPLayout, Routing, count_traffic, link_bandwidth, predict, row_bytes
from expertrail.plan.simulate import parse_ints, simulate, usable_eps


def within(pred, published, tol=0.2):
    return abs(pred - published) <= tol * published


def test_deepep_h800_intranode_normal_kernels():
    """DeepEP normal kernels, H800 EP8, 4096 tokens, hidden 7168, top-4 groups, top-8 experts,
    FP8 dispatch / BF16 combine, 20 SMs: 153 / 158 GB/s of NVLink (bytes received / time)."""
    model = MODELS["deepseek-v3"]
    idx = Routing("grouped").sample(model, 4096)
    p = predict(HARDWARE["h800"], model, EPLayout(8, 8), "dedup", idx, sms=20, precision="fp8")
    received = count_traffic(idx, model, EPLayout(8, 8), "dedup").stages[0]["recv"]
    published = KERNEL_FIGURES["deepep h800 intranode ep8"]
    assert within(received * row_bytes(model, "fp8", "dispatch") / p.dispatch_s / 1e9, published["dispatch_GBps"])
    assert within(received * row_bytes(model, "bf16", "combine") / p.combine_s / 1e9, published["combine_GBps"])


def test_hybrid_ep_b200_ep8():
    """Hybrid-EP, B200 EP8, 16 SMs, 4096 tokens, hidden 7168, top-8 uniform, 8 local experts:
    algorithm bandwidth BF16 dispatch 535.94, FP8 dispatch 409.71, combine 530.86 GB/s."""
    model = MoEModel("hybrid-ep-test", 7168, 64, 8, 2048, 1)
    idx = Routing("uniform").sample(model, 4096)
    logical = count_traffic(idx, model, EPLayout(8, 8), "hierarchical").logical_rows * 7168
    bf16 = predict(HARDWARE["b200"], model, EPLayout(8, 8), "hierarchical", idx, sms=16)
    fp8 = predict(HARDWARE["b200"], model, EPLayout(8, 8), "hierarchical", idx, sms=16, precision="fp8")
    published = KERNEL_FIGURES["hybrid-ep b200 ep8"]
    assert within(2 * logical / bf16.dispatch_s / 1e9, published["bf16_dispatch_GBps"])
    assert within(logical / fp8.dispatch_s / 1e9, published["fp8_dispatch_GBps"])
    assert within(2 * logical / bf16.combine_s / 1e9, published["combine_GBps"])


@pytest.mark.parametrize("hardware,link,sms", [("h100", "nvlink", 8), ("h100", "nic", 4), ("gb200-nvl36", "nvlink", 16)])
def test_published_saturating_sm_counts(hardware, link, sms):
    """8 SMs fill NVLink on DGX H100, ~4 SMs approach the 400 Gb/s NIC, 16 SMs fill GB200 NVL36."""
    hw = HARDWARE[hardware]
    assert link_bandwidth(hw, link, sms) >= 0.9 * link_bandwidth(hw, link, 132)
    assert link_bandwidth(hw, link, sms // 4) < 0.7 * link_bandwidth(hw, link, 132)


def brute_force_rows(idx, experts, ep, domain, algorithm):
    """Rows rank 0 sends per link class, counted token by token."""
    local = experts // ep
    rows = {"self": 0, "intra": 0, "inter": 0}

    def cls(q):
        return "self" if q == 0 else ("intra" if q < domain else "inter")
    for token in idx.tolist():
        experts_of_token = [e for e in token if e >= 0]
        ranks = sorted({e // local for e in experts_of_token})
        if algorithm == "alltoall":
            for e in experts_of_token:
                rows[cls(e // local)] += 1
        elif algorithm == "dedup":
            for q in ranks:
                rows[cls(q)] += 1
        elif algorithm == "hierarchical":
            domains = {q // domain for q in ranks}
            rows["self"] += 0 in domains
            rows["inter"] += len(domains - {0})
        elif algorithm == "allgather":
            rows["self"] += 1
            rows["intra"] += domain - 1
            rows["inter"] += ep - domain
    return rows


@pytest.mark.parametrize("algorithm", ["alltoall", "dedup", "hierarchical", "allgather"])
@pytest.mark.parametrize("ep,domain", [(8, 4), (8, 2), (4, 4), (16, 1)])
def test_byte_counts_match_brute_force(algorithm, ep, domain):
    model = MoEModel("small", 64, 16, 3, 32, 1)
    idx = Routing("zipf:0.8").sample(model, 200, seed=3)
    idx[::7, 1] = -1
    counted = count_traffic(idx, model, EPLayout(ep, domain), algorithm).rows
    expected = brute_force_rows(idx, 16, ep, domain, algorithm)
    if algorithm == "hierarchical":      # its intra-domain rows are forwarded ones, checked below
        counted = {k: counted[k] for k in ("self", "inter")}
        expected = {k: expected[k] for k in ("self", "inter")}
    assert counted == expected


def test_hierarchical_forwarding_rows_match_brute_force():
    """Inside a domain, the rail peer forwards each arriving row to the other ranks holding its
    experts; with every sender routing alike, the busiest forwarder's rows are counted."""
    model = MoEModel("small", 64, 16, 3, 32, 1)
    idx = Routing("uniform").sample(model, 120, seed=5)
    ep, domain = 8, 4
    local = 16 // ep
    busiest = 0
    for dom in range(ep // domain):
        for lidx in range(domain):
            me = dom * domain + lidx
            per_sender = sum(len({e // local for e in t if e >= 0 and (e // local) // domain == dom} - {me})
                             for t in idx.tolist())
            busiest = max(busiest, per_sender * (ep // domain))
    assert count_traffic(idx, model, EPLayout(ep, domain), "hierarchical").rows["intra"] == busiest


def test_grouped_routing_limits_groups():
    """Megatron's group-limited top-k: at most group_topk groups a token, and the kept groups
    (the best by their two best scores) hold its experts: nearly 4 groups a token, where groups
    chosen blindly and then experts in them give 3.6."""
    model = MODELS["deepseek-v3"]
    idx = Routing("grouped").sample(model, 2000)
    groups = [len(set(row)) for row in (idx // (256 // 8)).tolist()]
    assert max(groups) <= 4 and sum(groups) / len(groups) > 3.9


def test_hf_config_and_files(tmp_path):
    cfg = {"model_type": "qwen3_moe", "hidden_size": 2048, "num_experts": 128, "num_experts_per_tok": 8,
           "moe_intermediate_size": 768, "num_hidden_layers": 48}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    model = load_model(str(path))
    assert (model.hidden, model.num_experts, model.topk, model.moe_ffn) == (2048, 128, 8, 768)
    assert from_hf_config({**cfg, "n_routed_experts": 256, "first_k_dense_replace": 3}).layers == 45


def test_hf_model_directory_and_unusable_files(tmp_path):
    cfg = {"model_type": "qwen3_moe", "hidden_size": 2048, "num_experts": 128, "num_experts_per_tok": 8,
           "moe_intermediate_size": 768, "num_hidden_layers": 48}
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(cfg))
    assert load_model(str(tmp_path / "model")).num_experts == 128            # a model directory: its config.json
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="directory without a config.json"):
        load_model(str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="a directory"):
        load_hardware(str(tmp_path / "empty"))
    for name, text in (("e.json", ""), ("b.json", "{"), ("l.yaml", "- 1\n")):
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError, match=name):
            load_model(str(tmp_path / name))
    (tmp_path / "partial.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "num_experts_per_tok"}))
    with pytest.raises(ConfigError, match="lacks num_experts_per_tok"):
        load_model(str(tmp_path / "partial.json"))
    (tmp_path / "topk.json").write_text(json.dumps({"name": "x", "hidden": 64, "num_experts": 4, "topk": 8,
                                                    "moe_ffn": 32, "layers": 1}))
    with pytest.raises(ConfigError, match="topk 8 exceeds num_experts 4"):
        load_model(str(tmp_path / "topk.json"))


def test_routing_errors_name_the_option(tmp_path):
    model = MODELS["qwen3-30b-a3b"]
    for spec, words in (("zipf:abc", "Zipf exponent"), ("zipf:-1", "Zipf exponent"), ("grouped", "expert groups"),
                        ("nope", "uniform, zipf")):
        with pytest.raises(ConfigError, match=words):
            Routing(spec).sample(model, 16)
    np.save(tmp_path / "big.npy", np.full((4, 8), 500))
    with pytest.raises(ConfigError, match="do not fit the 128 experts"):
        Routing(str(tmp_path / "big.npy")).sample(model, 16)
    for tokens in (0, -5):
        with pytest.raises(ConfigError, match="--tokens"):
            Routing("uniform").sample(model, tokens)


def test_parse_ints_and_usable_eps():
    assert parse_ints("8..64:8") == [8, 16, 24, 32, 40, 48, 56, 64] and parse_ints("4,8,8") == [4, 8]
    for bad in ("x", "0", "8..x", "64..8", "8..64:0", ""):
        with pytest.raises(ConfigError, match="--ep"):
            parse_ints(bad, "--ep")
    ok, skipped = usable_eps(MODELS["deepseek-v3"], [1, 8, 24, 32], domain_size=None)
    assert ok == [8, 32] and [ep for ep, _ in skipped] == [1, 24]
    with pytest.raises(ConfigError, match="--ep 24: not a divisor of the 256 experts"):
        simulate(HARDWARE["h100"], MODELS["deepseek-v3"], 64, [8, 24], [20])


def test_simulate_cli_text_plot_and_no_torch(tmp_path):
    np.save(tmp_path / "route.npy", Routing("uniform").sample(MODELS["qwen3-30b-a3b"], 256))
    code = ("import sys; from expertrail.tools.cli import main; "
            f"rc = main(['simulate', '--hardware', 'h100', '--model', 'qwen3-30b-a3b', '--ep', '8,16', "
            f"'--sms', '8..24', '--routing', r'{tmp_path / 'route.npy'}', '--tokens', '256', "
            f"'--plot', r'{tmp_path / 'sim.png'}']); "
            "assert 'torch' not in sys.modules; sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "hierarchical (deepep)" in out.stdout and "bottleneck" in out.stdout
    assert (tmp_path / "sim.png").read_bytes()[:4] == b"\x89PNG"


def test_simulate_cli_json_names_every_algorithm(capsys):
    assert main(["simulate", "--hardware", "gb200-nvl72", "--model", "deepseek-v3", "--ep", "64", "--tokens", "512",
                 "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {r["algorithm"]: r["field_name"] for r in rows} == {
        "allgather": "allgather", "alltoall": "alltoall", "dedup": "deepep", "hierarchical": "hybridep",
        "deepep-ll": "deepep low-latency"}
    assert all(r["domain"] == 64 and r["bytes"]["inter"] == 0 for r in rows)   # EP 64 fits one NVL72 rack


def test_simulate_skips_non_dividing_eps_with_a_note(capsys):
    """The documented sweep `--ep 8..64:8` used to fail at EP 24."""
    assert main(["simulate", "--hardware", "h100", "--model", "deepseek-v3", "--ep", "8..64:8", "--tokens", "256",
                 "--backends", "alltoall,hierarchical", "--json"]) == 0
    captured = capsys.readouterr()
    js = json.loads(captured.out)
    assert sorted({r["ep"] for r in js["rows"]}) == [8, 16, 32, 64]
    assert [s["ep"] for s in js["skipped"]] == [24, 40, 48, 56]
    assert "note: skipped EP 24, 40, 48, 56: not a divisor of the 256 experts of deepseek-v3" in captured.err


@pytest.mark.parametrize("algorithm", ["alltoall", "dedup", "hierarchical", "allgather"])
def test_engine_local_passes_take_the_measured_pass_time(algorithm):
    """On a measured machine with local pass figures, predicting expertrail's engine adds its
    copies to dispatch and its sums to combine at those speeds; other predictions do not."""
    from dataclasses import replace
    bare = replace(HARDWARE["h100"], measured=True, nvlink_latency_us=500.0, nic_latency_us=700.0)
    timed = replace(bare, local_copy_GBps=3.0, local_reduce_GBps=6.0)
    model = MoEModel("m", 1024, 32, 8, 512, 1)
    layout = EPLayout(4, 2)
    idx = Routing("uniform").sample(model, 1024)
    tr = count_traffic(idx, model, layout, algorithm)
    row = row_bytes(model, "bf16", "dispatch")
    without = predict(bare, model, layout, algorithm, idx, engine=True)
    with_passes = predict(timed, model, layout, algorithm, idx, engine=True)
    assert with_passes.dispatch_s - without.dispatch_s == pytest.approx(tr.passes["copy"] * row / 3e9)
    assert with_passes.combine_s - without.combine_s == pytest.approx(tr.passes["reduce"] * row / 6e9)
    kernels = predict(timed, model, layout, algorithm, idx)
    assert kernels.dispatch_s < with_passes.dispatch_s


def test_engine_local_rows_follow_each_backends_passes():
    """alltoall copies and sums each sent (token, expert) row once; dedup also expands and
    pre-sums on the expert side; hierarchical does so for its rail rows, its domain rows and
    the expert rows."""
    model = MoEModel("m", 64, 32, 8, 64, 1)
    layout = EPLayout(4, 2)
    idx = Routing("uniform").sample(model, 512)
    pairs = int((idx >= 0).sum())
    member = np.zeros((512, 4), bool)
    np.put_along_axis(member, idx // 8, True, axis=1)
    in_domain = member.reshape(512, 2, 2).any(2)
    assert count_traffic(idx, model, layout, "alltoall").passes == {"copy": pairs, "reduce": pairs}
    assert count_traffic(idx, model, layout, "dedup").passes["copy"] == int(member.sum()) + pairs
    assert count_traffic(idx, model, layout, "hierarchical").passes["reduce"] == \
        int(in_domain.sum()) + int(member.sum()) + pairs


# Internode figures of the two-level kernels, as published: (token, destination node) rows,
# the sender's own node included, x row bytes / kernel time (DeepEP's tests/test_internode.py
# counts `num_rdma_token_sent` over every node; its V2 README: "90 GB/s actually contains local
# rank traffic"). Cross-node predictions are compared on the same count.
DEEPEP_V1_H800 = KERNEL_FIGURES["deepep h800 internode"]["by_ep"]              # FP8 dispatch, BF16 combine
HYBRID_EP_H100_KERNEL_8_SMS = KERNEL_FIGURES["hybrid-ep h100 internode"]["by_ep"]


@pytest.mark.parametrize("ep", [16, 32, 64])
def test_deepep_h800_internode_normal_kernels(ep):
    """DeepEP V1 normal kernels, H800 + CX7 400 Gb/s, 4096 tokens, hidden 7168, 256 experts,
    top-8; its test groups the experts by node and limits a token to min(nodes, 4) of them."""
    nodes = ep // 8
    model = MoEModel("deepep-internode-test", 7168, 256, 8, 2048, 1, num_groups=nodes, group_topk=min(nodes, 4))
    idx = Routing("grouped").sample(model, 4096)
    p = predict(HARDWARE["h800"], model, EPLayout(ep, 8), "hierarchical", idx, sms=24, precision="fp8")
    dispatch, combine = DEEPEP_V1_H800[ep]
    assert within(p.slow_link_GBps["dispatch"], dispatch, 0.25)
    assert within(p.slow_link_GBps["combine"], combine, 0.25)


@pytest.mark.parametrize("ep", [16, 32, 64])
def test_hybrid_ep_h100_internode_kernels(ep):
    """Hybrid-EP on DGX H100 + CX7, 4096 tokens, hidden 7168, top-8 uniform, 8 local experts,
    8 SMs, kernel time (docs/README_Hybrid-EP.md of DeepEP's hybrid-ep branch)."""
    model = MoEModel("hybrid-ep-internode-test", 7168, 8 * ep, 8, 2048, 1)
    idx = Routing("uniform").sample(model, 4096)
    fp8 = predict(HARDWARE["h100"], model, EPLayout(ep, 8), "hierarchical", idx, sms=8, precision="fp8")
    bf16 = predict(HARDWARE["h100"], model, EPLayout(ep, 8), "hierarchical", idx, sms=8)
    published = HYBRID_EP_H100_KERNEL_8_SMS[ep]
    assert within(fp8.slow_link_GBps["dispatch"], published[0])
    assert within(bf16.slow_link_GBps["dispatch"], published[1])
    assert within(bf16.slow_link_GBps["combine"], published[2])


def test_internode_figure_counts_the_own_node_rows():
    """The published figure's rows are the NIC's rows plus the sender's own-node rows: with d
    domains about d / (d - 1) times the rows that cross the NIC (2x, 1.33x, 1.14x at 2, 4, 8)."""
    for ep, ratio in ((16, 2.0), (32, 4 / 3), (64, 8 / 7)):
        model = MoEModel("m", 7168, 8 * ep, 8, 2048, 1)
        idx = Routing("uniform").sample(model, 4096)
        tr = count_traffic(idx, model, EPLayout(ep, 8), "hierarchical")
        assert tr.domain_rows == tr.rows["self"] + tr.rows["inter"]
        assert tr.domain_rows / tr.rows["inter"] == pytest.approx(ratio, rel=0.03)
    inside = predict(HARDWARE["h100"], model, EPLayout(8, 8), "hierarchical", idx[:, :8] % 64, sms=8)
    assert inside.slow_link_GBps is None


def test_piped_stages_take_the_slowest_plus_a_piece_of_the_others():
    """The two-level route as a pipeline of n pieces: n = 1 is the stages one after the other,
    many pieces approach the slowest stage alone (DeepEP's and Hybrid-EP's streaming)."""
    from expertrail.plan.cost import piped
    assert piped([3.0, 1.0], False) == 4.0
    assert piped([3.0, 1.0], True) == 3.0
    assert piped([3.0, 1.0, 2.0], 4) == 3.0 + 3.0 / 4
    assert piped([], 4) == 0.0
