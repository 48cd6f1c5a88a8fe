"""`expertrail validate`: every rule with a config that breaks it and one that satisfies it."""
import json
import subprocess
import sys

import pytest

from expertrail.plan.validate import RULES, load_config, validate

OVERLAP = {"overlap_moe_expert_parallel_comm": True, "expert_model_parallel_size": 8, "num_moe_experts": 64,
           "moe_token_dispatcher_type": "alltoall", "bf16": True}

CASES = {   # rule -> (breaking config, satisfying config)
    "ep-overlap-ep": ({**OVERLAP, "expert_model_parallel_size": 1, "num_moe_experts": 8}, OVERLAP),
    "ep-overlap-experts": ({**OVERLAP, "num_moe_experts": 1}, OVERLAP),
    "ep-overlap-dispatcher": ({**OVERLAP, "moe_token_dispatcher_type": "allgather"}, OVERLAP),
    "ep-overlap-precision": ({**OVERLAP, "bf16": False}, {**OVERLAP, "bf16": False, "fp16": True}),
    "ep-overlap-torch": ({**OVERLAP, "torch_version": "2.5.1"}, {**OVERLAP, "torch_version": "2.6.0+cu124"}),
    "ep-overlap-vpp": ({**OVERLAP, "pipeline_model_parallel_size": 2},
                       {**OVERLAP, "pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}),
    "ep-overlap-recompute": ({**OVERLAP, "recompute_granularity": "full"},
                             {**OVERLAP, "recompute_granularity": "selective"}),
    "ep-overlap-shared": ({**OVERLAP, "moe_shared_expert_overlap": True}, {**OVERLAP, "moe_shared_expert_overlap": False}),
    "ep-overlap-mtp": ({**OVERLAP, "mtp_num_layers": 2}, {**OVERLAP, "mtp_num_layers": 1}),
    "wgrad-needs-overlap": ({"delay_wgrad_compute": True}, {**OVERLAP, "delay_wgrad_compute": True}),
    "wgrad-graph-fusion": ({**OVERLAP, "delay_wgrad_compute": True, "cuda_graph_impl": "transformer_engine",
                            "cuda_graph_scope": "attn", "gradient_accumulation_fusion": False},
                           {**OVERLAP, "delay_wgrad_compute": True, "cuda_graph_impl": "transformer_engine",
                            "cuda_graph_scope": "attn", "gradient_accumulation_fusion": True}),
    "wgrad-graph-bias": ({**OVERLAP, "delay_wgrad_compute": True, "cuda_graph_impl": "local",
                          "cuda_graph_scope": "attn", "add_qkv_bias": True},
                         {**OVERLAP, "delay_wgrad_compute": True, "cuda_graph_impl": "none",
                          "cuda_graph_scope": "attn", "add_qkv_bias": True}),
    "flex-backend": ({"moe_token_dispatcher_type": "flex"},
                     {"moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_backend": "hybridep"}),
    "flex-no-pad": ({"moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_backend": "deepep",
                     "moe_pad_expert_input_to_capacity": True, "moe_expert_capacity_factor": 1.0},
                    {"moe_token_dispatcher_type": "alltoall", "moe_pad_expert_input_to_capacity": True,
                     "moe_expert_capacity_factor": 1.0}),
    "flex-gpu": ({"moe_flex_dispatcher_backend": "deepep", "moe_token_dispatcher_type": "flex",
                  "hardware": "{volta}"}, {"moe_flex_dispatcher_backend": "deepep",
                                            "moe_token_dispatcher_type": "flex", "hardware": "h100"}),
    "shared-overlap-dispatcher": ({"moe_shared_expert_overlap": True},
                                  {"moe_shared_expert_overlap": True, "moe_token_dispatcher_type": "alltoall"}),
    "capacity-balancing": ({"moe_expert_capacity_factor": 1.25, "moe_router_load_balancing_type": "sinkhorn"},
                           {"moe_expert_capacity_factor": 1.25}),
    "pad-needs-capacity": ({"moe_pad_expert_input_to_capacity": True},
                           {"moe_pad_expert_input_to_capacity": True, "moe_expert_capacity_factor": 1.0}),
    "group-divides-experts": ({"num_moe_experts": 256, "moe_router_num_groups": 6, "moe_router_group_topk": 4},
                              {"num_moe_experts": 256, "moe_router_num_groups": 8, "moe_router_group_topk": 4}),
    "group-topk": ({"num_moe_experts": 256, "moe_router_num_groups": 8, "moe_router_group_topk": 9},
                   {"num_moe_experts": 256, "moe_router_num_groups": 8, "moe_router_group_topk": 4,
                    "moe_router_topk": 8}),
    "top1-pre-softmax": ({"moe_router_topk": 1}, {"moe_router_topk": 1, "moe_router_pre_softmax": True}),
    "bias-needs-sigmoid": ({"moe_router_enable_expert_bias": True},
                           {"moe_router_enable_expert_bias": True, "moe_router_score_function": "sigmoid"}),
    "experts-divide-ep": ({"num_moe_experts": 60, "expert_model_parallel_size": 8},
                          {"num_moe_experts": 64, "expert_model_parallel_size": 8}),
    "parallel-sizes": ({"world_size": 64, "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 4,
                        "data_parallel_size": 4},
                       {"world_size": 64, "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 4,
                        "data_parallel_size": 8}),
    "expert-parallel-sizes": ({"num_nodes": 2, "gpus_per_node": 8, "pipeline_model_parallel_size": 2,
                               "expert_model_parallel_size": 16},
                              {"num_nodes": 2, "gpus_per_node": 8, "pipeline_model_parallel_size": 2,
                               "expert_model_parallel_size": 8}),
    "domain-divides-ep": ({"expert_model_parallel_size": 16, "num_of_hybrid_ep_ranks_per_nvlink_domain": 6},
                          {"expert_model_parallel_size": 16, "num_of_hybrid_ep_ranks_per_nvlink_domain": 8}),
    "domain-matches-hardware": ({"expert_model_parallel_size": 64, "num_of_hybrid_ep_ranks_per_nvlink_domain": 8,
                                 "hardware": "gb200-nvl72"},
                                {"expert_model_parallel_size": 64, "num_of_hybrid_ep_ranks_per_nvlink_domain": 64,
                                 "hardware": "gb200-nvl72"}),
}


def test_every_rule_has_a_case():
    assert set(CASES) == {r.id for r in RULES}


@pytest.mark.parametrize("rule", sorted(CASES))
def test_rule_breaks_and_holds(rule, tmp_path):
    bad, good = CASES[rule]
    for cfg in (bad, good):                   # a custom hardware file for the GPU-generation rule
        if cfg.get("hardware") == "{volta}":
            path = tmp_path / "v100.json"
            path.write_text(json.dumps({"name": "v100", "domain_size": 8, "nvlink_GBps": 150, "nic_GBps": 12.5,
                                        "sms": 80, "hbm_GB": 32, "hbm_TBps": 0.9, "bf16_TFLOPS": 125,
                                        "fp8_TFLOPS": 0, "arch": "volta"}))
            cfg["hardware"] = str(path)
    assert rule in {v.rule for v in validate(bad)}
    assert rule not in {v.rule for v in validate(good)}


def test_bridge_nested_yaml_and_overrides(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("model:\n  expert_model_parallel_size: 8\n  num_moe_experts: 64\n"
                    "  moe_token_dispatcher_type: alltoall\n  bf16: true\n"
                    "comm_overlap:\n  overlap_moe_expert_parallel_comm: true\n  delay_wgrad_compute: true\n")
    assert validate(load_config(str(path))) == []
    cfg = load_config(str(path), ["model.moe-token-dispatcher-type=allgather", "--mtp-num-layers=3"])
    assert {v.rule for v in validate(cfg)} == {"ep-overlap-dispatcher", "ep-overlap-mtp"}


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "expertrail", "validate", *args], capture_output=True, text=True,
                          timeout=60)


def test_cli_text_json_and_exit_codes(tmp_path):
    ok = run_cli("expert_model_parallel_size=8", "num_moe_experts=64")
    assert ok.returncode == 0 and "valid: " in ok.stdout
    bad = run_cli("overlap_moe_expert_parallel_comm=true", "expert_model_parallel_size=1")
    assert bad.returncode == 1
    assert "[ep-overlap-ep] EP overlap needs expert parallelism" in bad.stdout and "fix: " in bad.stdout
    js = json.loads(run_cli("moe_router_topk=1", "--json").stdout)
    assert js["valid"] is False and js["violations"][0]["rule"] == "top1-pre-softmax"
    missing = run_cli(str(tmp_path / "nope.yaml"))
    assert missing.returncode == 2 and "not found" in missing.stderr


def test_planner_never_imports_torch():
    code = ("import sys; from expertrail.cli import main; import expertrail.plan; "
            "rc = main(['validate', 'expert_model_parallel_size=8', 'hardware=h100']); "
            "assert 'torch' not in sys.modules, 'torch was imported'; print(rc)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
