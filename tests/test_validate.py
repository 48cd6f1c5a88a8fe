"""`expertrail validate`: every rule with a config that breaks it and one that satisfies it; field
values, unknown fields, Megatron's argument forms, the command line."""
import json
import subprocess
import sys

import pytest

from expertrail.tools.cli import main
from expertrail.errors import ConfigError
from expertrail.plan.validate import RULES, load_config, split_arguments, unknown_fields, validate

OVERLAP = {"overlap_moe_expert_parallel_comm": True, "expert_model_parallel_size": 8, "num_moe_experts": 64,
           "moe_token_dispatcher_type": "alltoall", "bf16": True}

TE_GRAPHS = {"cuda_graph_impl": "transformer_engine", "num_moe_experts": 64, "expert_model_parallel_size": 8}
PADDED = {"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}

CASES = {   # rule -> (breaking config, satisfying config)
    "ep-overlap-ep": ({**OVERLAP, "expert_model_parallel_size": 1, "num_moe_experts": 8}, OVERLAP),
    "ep-overlap-experts": ({**OVERLAP, "num_moe_experts": 1}, OVERLAP),      # unset: the model's, not checked
    "ep-overlap-dispatcher": ({**OVERLAP, "moe_token_dispatcher_type": "allgather"}, OVERLAP),
    "ep-overlap-precision": ({**OVERLAP, "bf16": False}, {**OVERLAP, "bf16": False, "fp16": True}),
    "ep-overlap-torch": ({**OVERLAP, "torch_version": "2.5.1"}, {**OVERLAP, "torch_version": "2.6.0+cu124"}),
    "ep-overlap-vpp": ({**OVERLAP, "pipeline_model_parallel_size": 2},
                       {**OVERLAP, "pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}),
    "ep-overlap-recompute": ({**OVERLAP, "recompute_granularity": "full"},
                             {**OVERLAP, "recompute_granularity": "selective"}),
    "recompute-full-method": ({"recompute_granularity": "full", "recompute_method": "uniform"},
                              {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 2}),
    "recompute-selective-fields": ({"recompute_granularity": "selective", "recompute_num_layers": 1},
                                   {"recompute_granularity": "selective", "recompute_modules": ["moe_act"]}),
    "shared-experts-recompute-overlap": (
        {"recompute_granularity": "selective", "recompute_modules": ["shared_experts"],
         "moe_shared_expert_intermediate_size": 1024, "moe_shared_expert_overlap": True,
         "moe_token_dispatcher_type": "alltoall"},
        {"recompute_granularity": "selective", "recompute_modules": ["shared_experts"],
         "moe_shared_expert_intermediate_size": 1024, "moe_token_dispatcher_type": "alltoall"}),
    "moe-act-needs-grouped-gemm": ({"recompute_granularity": "selective", "recompute_modules": ["moe_act"],
                                    "moe_grouped_gemm": False},
                                   {"recompute_granularity": "selective", "recompute_modules": ["moe_act"],
                                    "moe_grouped_gemm": True}),
    "delayed-fp8-recompute": ({"fp8": "e4m3", "recompute_granularity": "selective", "recompute_modules": ["layernorm"]},
                              {"fp8": "e4m3", "fp8_recipe": "blockwise", "recompute_granularity": "selective",
                               "recompute_modules": ["layernorm"]}),
    "layout-vpp": ({"pipeline_model_parallel_size": 2, "pipeline_model_parallel_layout": "Et*4|t*4L",
                    "virtual_pipeline_model_parallel_size": 2, "num_layers": 8},
                   {"pipeline_model_parallel_size": 2, "pipeline_model_parallel_layout": "Et*2|t*2|t*2|t*2L",
                    "virtual_pipeline_model_parallel_size": 2, "num_layers": 8}),
    "offload-inside-moe-recompute": ({"fine_grained_activation_offloading": True, "offload_modules": ["moe_act"],
                                      "recompute_granularity": "selective", "recompute_modules": ["moe"]},
                                     {"fine_grained_activation_offloading": True, "offload_modules": ["moe_act"],
                                      "recompute_granularity": "selective", "recompute_modules": ["layernorm"]}),
    "offload-attn-proj-alone": ({"fine_grained_activation_offloading": True, "offload_modules": ["attn_proj"]},
                                {"fine_grained_activation_offloading": True, "offload_modules": ["attn_proj", "core_attn"]}),
    "paged-stash-needs-rank-capacity": ({"moe_paged_stash": True},
                                        {"moe_paged_stash": True, "moe_expert_rank_capacity_factor": 1.5,
                                         "moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_backend": "hybridep",
                                         "use_transformer_engine_op_fuser": True}),
    "padding-for-quantization-dispatcher": ({"moe_router_padding_for_quantization": True, "fp8": "e4m3"},
                                            {"moe_router_padding_for_quantization": True, "fp8": "e4m3",
                                             "moe_token_dispatcher_type": "alltoall"}),
    "param-gather-needs": ({"overlap_param_gather": True, "use_distributed_optimizer": True},
                           {"overlap_param_gather": True, "use_distributed_optimizer": True, "overlap_grad_reduce": True}),
    "param-gather-with-step-needs": ({"overlap_param_gather_with_optimizer_step": True, "use_distributed_optimizer": True,
                                      "overlap_param_gather": True, "overlap_grad_reduce": True,
                                      "pipeline_model_parallel_size": 4},
                                     {"overlap_param_gather_with_optimizer_step": True, "use_distributed_optimizer": True,
                                      "overlap_param_gather": True, "overlap_grad_reduce": True,
                                      "pipeline_model_parallel_size": 4, "virtual_pipeline_model_parallel_size": 2}),
    "cpu-optimizer-needs": ({"optimizer_cpu_offload": True},
                            {"optimizer_cpu_offload": True, "use_precision_aware_optimizer": True}),
    "probs-on-input-topk": ({"moe_apply_probs_on_input": True, "moe_router_topk": 2, "num_moe_experts": 8},
                            {"moe_apply_probs_on_input": True, "moe_router_topk": 1, "num_moe_experts": 8}),
    "optimizer-instances-divide": ({"num_distributed_optimizer_instances": 4, "world_size": 16,
                                    "expert_model_parallel_size": 8, "num_moe_experts": 64},
                                   {"num_distributed_optimizer_instances": 2, "world_size": 16,
                                    "expert_model_parallel_size": 8, "num_moe_experts": 64}),
    "hsdp-outer-sharding": ({"use_megatron_fsdp": True, "outer_dp_sharding_strategy": "optim",
                             "data_parallel_sharding_strategy": "optim_grads"},
                            {"use_megatron_fsdp": True, "outer_dp_sharding_strategy": "optim",
                             "data_parallel_sharding_strategy": "optim_grads_params"}),
    "removed-arguments": ({"batch_size": 4, "checkpoint_activations": True}, {"micro_batch_size": 4}),
    "emerging-optimizer-fsdp": ({"optimizer": "muon", "use_megatron_fsdp": True, "num_moe_experts": 8},
                                {"optimizer": "muon", "use_distributed_optimizer": True, "num_moe_experts": 8}),
    "distributed-saved-activations": ({"distribute_saved_activations": True, "tensor_model_parallel_size": 2,
                                       "recompute_granularity": "selective"},
                                      {"distribute_saved_activations": True, "tensor_model_parallel_size": 2,
                                       "recompute_granularity": "full", "recompute_method": "uniform",
                                       "recompute_num_layers": 1}),
    "moe-layer-recompute-full": ({"moe_layer_recompute": True, "recompute_granularity": "full",
                                  "recompute_method": "uniform", "recompute_num_layers": 1},
                                 {"moe_layer_recompute": True}),
    "paged-stash-offload": ({"moe_paged_stash": True, "moe_expert_rank_capacity_factor": 1.5,
                             "moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_backend": "hybridep",
                             "fine_grained_activation_offloading": True, "offload_modules": ["expert_fc1"]},
                            {"moe_paged_stash": True, "moe_expert_rank_capacity_factor": 1.5,
                             "moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_backend": "hybridep",
                             "fine_grained_activation_offloading": True, "offload_modules": ["core_attn"]}),
    "padding-for-quantization-precision": ({"moe_router_padding_for_fp8": True, "moe_token_dispatcher_type": "alltoall",
                                            "bf16": True},
                                           {"moe_router_padding_for_fp8": True, "moe_token_dispatcher_type": "alltoall",
                                            "bf16": True, "fp8": "e4m3", "fp8_recipe": "blockwise"}),
    "optimizer-dtypes-need-aware": ({"main_grads_dtype": "bf16", "exp_avg_dtype": "fp32"},
                                    {"main_grads_dtype": "bf16", "use_precision_aware_optimizer": True}),
    "group-topk-needs-groups": ({"moe_router_group_topk": 4, "num_moe_experts": 64},
                                {"moe_router_group_topk": 4, "moe_router_num_groups": 8, "num_moe_experts": 64}),
    "fp8-param-gather-needs": ({"fp8_param_gather": True, "fp8": "e4m3", "fp8_recipe": "blockwise",
                                "use_distributed_optimizer": False},
                               {"fp8_param_gather": True, "fp8": "e4m3", "fp8_recipe": "blockwise",
                                "use_distributed_optimizer": True}),
    "quantized-params-need-recipe": ({"fp8_param_gather": True, "bf16": True, "use_distributed_optimizer": True},
                                     {"fp8_param_gather": True, "bf16": True, "use_distributed_optimizer": True,
                                      "fp8": "e4m3", "fp8_recipe": "mxfp8"}),
    "torch-fsdp2-layout": ({"use_torch_fsdp2": True, "expert_model_parallel_size": 8, "num_moe_experts": 64},
                           {"use_torch_fsdp2": True, "num_moe_experts": 64}),
    "ep-overlap-shared": ({**OVERLAP, "moe_shared_expert_overlap": True}, {**OVERLAP, "moe_shared_expert_overlap": False}),
    "ep-overlap-mtp": ({**OVERLAP, "mtp_num_layers": 2}, {**OVERLAP, "mtp_num_layers": 1}),
    "ep-overlap-microbatches": ({**OVERLAP, "world_size": 64, "global_batch_size": 32, "micro_batch_size": 1},
                                {**OVERLAP, "world_size": 64, "global_batch_size": 128, "micro_batch_size": 1}),
    "moe-layer-pattern": ({"num_layers": 61, "moe_layer_freq": "([0]*3+[1]*57)"},
                          {"num_layers": 61, "moe_layer_freq": "([0]*3+[1]*58)"}),
    "batch-splits": ({"world_size": 512, "global_batch_size": 256},         # a micro-batch of 1 unless given
                     {"world_size": 512, "global_batch_size": 1024, "micro_batch_size": 2}),
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
    "moe-tp-needs-sp": ({"tensor_model_parallel_size": 2, "expert_model_parallel_size": 8},
                        {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 8, "sequence_parallel": True}),
    "ncclep-needs-flex": ({"moe_flex_dispatcher_backend": "ncclep", "moe_token_dispatcher_type": "alltoall"},
                          {"moe_flex_dispatcher_backend": "ncclep", "moe_token_dispatcher_type": "flex"}),
    "rank-capacity-backend": ({"moe_expert_rank_capacity_factor": 1.5, "moe_token_dispatcher_type": "flex",
                               "moe_flex_dispatcher_backend": "deepep"},
                              {"moe_expert_rank_capacity_factor": 1.5, "moe_token_dispatcher_type": "flex",
                               "moe_flex_dispatcher_backend": "hybridep"}),
    "ncclep-wire": ({"moe_dispatch_fwd_dtype": "mxfp8", "moe_token_dispatcher_type": "flex",
                     "moe_flex_dispatcher_backend": "ncclep"},
                    {"moe_dispatch_fwd_dtype": "mxfp8", "moe_token_dispatcher_type": "flex",
                     "moe_flex_dispatcher_backend": "ncclep", "use_transformer_engine_op_fuser": True,
                     "moe_grouped_gemm": True}),
    "deepep-needs-flex": ({"moe_enable_deepep": True, "moe_token_dispatcher_type": "alltoall"},
                          {"moe_enable_deepep": True, "moe_token_dispatcher_type": "flex"}),
    "deepep-one-backend": ({"moe_enable_deepep": True, "moe_token_dispatcher_type": "flex",
                            "moe_flex_dispatcher_backend": "hybridep"},
                           {"moe_enable_deepep": True, "moe_token_dispatcher_type": "flex",
                            "moe_flex_dispatcher_backend": "deepep"}),
    "flex-no-pad": ({"moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_backend": "deepep",
                     "moe_pad_expert_input_to_capacity": True, "moe_expert_capacity_factor": 1.0},
                    {"moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_backend": "hybridep",
                     "moe_pad_expert_input_to_capacity": True, "moe_expert_capacity_factor": 1.0}),
    "ncclep-no-drop": ({"moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_backend": "ncclep",
                        "moe_expert_capacity_factor": 1.25},
                       {"moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_backend": "deepep",
                        "moe_expert_capacity_factor": 1.25}),
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
    "topk-within-experts": ({"num_moe_experts": 8, "moe_router_topk": 300}, {"num_moe_experts": 8, "moe_router_topk": 8}),
    "one-half-precision": ({"bf16": True, "fp16": True}, {"bf16": True, "fp16": False}),
    "mxfp8-needs-blackwell": ({"fp8": "e4m3", "fp8_recipe": "mxfp8", "hardware": "h100"},
                              {"fp8": "e4m3", "fp8_recipe": "mxfp8", "hardware": "b200"}),
    "fp8-needs-gpu": ({"fp8": "hybrid", "hardware": "a100"}, {"fp8": "hybrid", "hardware": "h100"}),
    "fp4-or-fp8": ({"fp4": "e2m1", "fp8": "hybrid"}, {"fp4": "e2m1"}),
    "nvfp4-needs-blackwell": ({"fp4": "e2m1", "hardware": "h100"}, {"fp4": "e2m1", "hardware": "gb200-nvl72"}),
    "cp-splits-sequence": ({"seq_length": 4096, "context_parallel_size": 3}, {"seq_length": 4096, "context_parallel_size": 4}),
    "sp-splits-sequence": ({"seq_length": 4100, "tensor_model_parallel_size": 8, "sequence_parallel": True},
                           {"seq_length": 4096, "tensor_model_parallel_size": 8, "sequence_parallel": True}),
    "tp-splits-heads": ({"num_attention_heads": 64, "tensor_model_parallel_size": 3},
                        {"num_attention_heads": 64, "tensor_model_parallel_size": 4}),
    "tp-query-groups": ({"num_query_groups": 4, "tensor_model_parallel_size": 3},
                        {"num_query_groups": 4, "tensor_model_parallel_size": 8}),
    "etp-splits-expert": ({"moe_ffn_hidden_size": 2048, "tensor_model_parallel_size": 6},
                          {"moe_ffn_hidden_size": 2048, "tensor_model_parallel_size": 6,
                           "expert_tensor_parallel_size": 1}),
    "tp-splits-shared-expert": ({"moe_shared_expert_intermediate_size": 2048, "tensor_model_parallel_size": 3},
                                {"moe_shared_expert_intermediate_size": 2048, "tensor_model_parallel_size": 2}),
    "graph-scope-or-modules": ({**TE_GRAPHS, "cuda_graph_scope": ["attn"], "cuda_graph_modules": ["attn"]},
                               {**TE_GRAPHS, "cuda_graph_scope": ["attn"]}),
    "graph-moe-or-router": ({**TE_GRAPHS, **PADDED, "cuda_graph_modules": ["moe", "moe_router"]},
                            {**TE_GRAPHS, **PADDED, "cuda_graph_modules": ["moe"]}),
    "graph-preprocess-needs-router": ({**TE_GRAPHS, "cuda_graph_modules": ["moe_preprocess"]},
                                      {"cuda_graph_impl": "local", "cuda_graph_modules": ["moe_preprocess"]}),
    "graph-moe-needs-padding": ({**TE_GRAPHS, "cuda_graph_modules": ["moe"]},
                                {**TE_GRAPHS, **PADDED, "cuda_graph_modules": ["moe"]}),
    "graph-preprocess-sync": ({**TE_GRAPHS, "cuda_graph_modules": ["moe_router", "moe_preprocess"],
                               "moe_token_dispatcher_type": "alltoall", "moe_expert_capacity_factor": 1.0},
                              {**TE_GRAPHS, "cuda_graph_modules": ["moe_router", "moe_preprocess"],
                               "moe_token_dispatcher_type": "alltoall", **PADDED}),
    "graph-full-recompute": ({"enable_cuda_graph": True, "recompute_granularity": "full", "recompute_method": "uniform",
                              "recompute_num_layers": 1},
                             {"cuda_graph_impl": "full_iteration", "recompute_granularity": "full",
                              "recompute_method": "uniform", "recompute_num_layers": 1}),
    "graph-moe-recompute": ({**TE_GRAPHS, "cuda_graph_modules": ["moe_router"], "recompute_granularity": "selective",
                             "recompute_modules": ["moe"]},
                            {"cuda_graph_impl": "local", "cuda_graph_modules": ["moe_router"],
                             "recompute_granularity": "selective", "recompute_modules": ["moe"]}),
    "graph-full-iteration-modules": ({"cuda_graph_impl": "full_iteration", "cuda_graph_modules": ["attn"]},
                                     {"cuda_graph_impl": "full_iteration", "cuda_graph_scope": ["full_iteration"]}),
    "limited-devices-or-groups": ({"moe_router_topk_limited_devices": 3, "moe_router_group_topk": 3,
                                   "moe_router_num_groups": 8}, {"moe_router_topk_limited_devices": 3}),
    "limited-devices-range": ({"moe_router_topk_limited_devices": 16, "expert_model_parallel_size": 8,
                               "num_moe_experts": 64, "moe_router_topk": 8},
                              {"moe_router_topk_limited_devices": 2, "expert_model_parallel_size": 8,
                               "num_moe_experts": 64, "moe_router_topk": 8}),
    "top1-pre-softmax": ({"moe_router_topk": 1}, {"moe_router_topk": 1, "moe_router_pre_softmax": True}),
    "bias-needs-sigmoid": ({"moe_router_enable_expert_bias": True},
                           {"moe_router_enable_expert_bias": True, "moe_router_score_function": "sigmoid"}),
    "experts-divide-ep": ({"num_moe_experts": 60, "expert_model_parallel_size": 8},
                          {"num_moe_experts": 64, "expert_model_parallel_size": 8}),
    "state-offload-one-way": ({"offload_optimizer_states": True, "optimizer_cpu_offload": True},
                              {"chunked_optimizer_state_offload": True, "optimizer_cpu_offload": False}),
    "cpu-offload-pp": ({"cpu_offloading": True, "pipeline_model_parallel_size": 2},
                       {"cpu_offloading": True, "pipeline_model_parallel_size": 1}),
    "gdn-norm-out-needs-gdn": ({"recompute_granularity": "selective", "recompute_modules": ["gdn_norm_out"],
                                "experimental_attention_variant": "dsa"},
                               {"recompute_granularity": "selective", "recompute_modules": ["gdn_norm_out"],
                                "experimental_attention_variant": "gated_delta_net"}),
    "mla-up-proj-needs-mla": ({"recompute_granularity": "selective", "recompute_modules": ["mla_up_proj"],
                               "multi_latent_attention": False},
                              {"recompute_granularity": "selective", "recompute_modules": ["mla_up_proj"],
                               "multi_latent_attention": True}),
    "mhc-recompute": ({"recompute_granularity": "selective", "recompute_modules": ["mhc", "mlp"],
                       "enable_mhc_connections": True},
                      {"recompute_granularity": "selective", "recompute_modules": ["mhc"], "enable_mhc_connections": True}),
    "cpu-offload-recompute": ({"cpu_offloading": True, "recompute_granularity": "selective"},
                              {"cpu_offloading": True}),
    "cpu-offload-graphs": ({"cpu_offloading": True, "cuda_graph_impl": "transformer_engine"},
                           {"cpu_offloading": True, "cuda_graph_impl": "none"}),
    "cpu-offload-one-way": ({"cpu_offloading": True, "fine_grained_activation_offloading": True},
                            {"cpu_offloading": False, "fine_grained_activation_offloading": True}),
    "cpu-offload-layers": ({"cpu_offloading": True, "cpu_offloading_num_layers": 48, "num_layers": 48},
                           {"cpu_offloading": True, "cpu_offloading_num_layers": 47, "num_layers": 48}),
    "one-vpp-source": ({"pipeline_model_parallel_size": 2, "pipeline_model_parallel_layout": "Et|t|t|tL",
                        "num_virtual_stages_per_pipeline_rank": 2},
                       {"pipeline_model_parallel_size": 2, "pipeline_model_parallel_layout": "Et|t|t|tL"}),
    "pipeline-layout": ({"pipeline_model_parallel_size": 3, "pipeline_model_parallel_layout": "Et|(tt|)*2tL"},
                        {"pipeline_model_parallel_size": 2, "pipeline_model_parallel_layout": "Et|(tt|)*2tL"}),
    # A 94-layer model on PP 32 x VPP 3 (a published 256-GPU layout) splits only with the embedding
    # and the loss counted as layers.
    "pipeline-split": ({"num_layers": 94, "pipeline_model_parallel_size": 32, "virtual_pipeline_model_parallel_size": 3},
                       {"num_layers": 94, "pipeline_model_parallel_size": 32, "virtual_pipeline_model_parallel_size": 3,
                        "account_for_embedding_in_pipeline_split": True, "account_for_loss_in_pipeline_split": True}),
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


def test_a_pipeline_layout_gives_the_virtual_stages_ep_overlap_needs():
    """Megatron takes VPP from pipeline_model_parallel_layout (its stages over PP): ModelZoo's
    DeepSeek-V3 command (PP 8, EP overlap, "Et|(tt|)*30mL", 32 stages) needs no VPP beside it; a
    layout that does not parse is a violation, not a crash."""
    cfg = {**OVERLAP, "pipeline_model_parallel_size": 8, "pipeline_model_parallel_layout": "Et|(tt|)*30mL"}
    assert validate(cfg) == []
    assert {v.rule for v in validate({**cfg, "pipeline_model_parallel_layout": "Et|(tt|)*30mX"})} == \
        {"pipeline-layout", "ep-overlap-vpp"}


def test_virtual_stages_need_pipeline_parallelism_in_validate_and_estimate(capsys):
    """Megatron-LM asserts PP > 1 for the interleaved schedule, however the virtual stages are
    asked for (layers per virtual stage, stages per rank, a layout of several stages); validate
    and estimate refuse it alike, and a single-stage split at PP 1 stays valid."""
    base = {"num_layers": 48, "pipeline_model_parallel_size": 1}
    for vpp in ({"num_layers_per_virtual_pipeline_stage": 4}, {"num_virtual_stages_per_pipeline_rank": 2},
                {"pipeline_model_parallel_layout": "Et*24|t*24L"}):
        assert "pipeline-split" in {v.rule for v in validate({**base, **vpp})}, vpp
    assert validate({**base, "num_layers_per_virtual_pipeline_stage": 48}) == []
    flags = ["--hardware", "h100", "--gpus", "64", "--model", "qwen3-30b-a3b", "--expert-model-parallel-size", "8"]
    assert main(["estimate", *flags, "--num-layers-per-virtual-pipeline-stage", "4"]) == 2
    assert "need pipeline parallelism" in capsys.readouterr().err
    assert main(["estimate", *flags, "--pipeline-model-parallel-size", "2",
                 "--num-layers-per-virtual-pipeline-stage", "4"]) == 0


def test_bridge_nested_yaml_and_overrides(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("model:\n  expert_model_parallel_size: 8\n  num_moe_experts: 64\n"
                    "  moe_token_dispatcher_type: alltoall\n  bf16: true\n"
                    "comm_overlap:\n  overlap_moe_expert_parallel_comm: true\n  delay_wgrad_compute: true\n")
    assert validate(load_config(str(path))) == []
    cfg = load_config(str(path), ["model.moe-token-dispatcher-type=allgather", "--mtp-num-layers=3"])
    assert {v.rule for v in validate(cfg)} == {"ep-overlap-dispatcher", "ep-overlap-mtp"}


def test_numbers_yaml_reads_as_text_are_numbers_as_megatron_reads_them(tmp_path):
    """The ModelZoo's YAML writes Megatron flags as keys (``--norm-epsilon: 1e-6``); YAML 1.1 reads
    1e-6 and 1e-3 as text, Megatron's argparse as numbers: so does validate. Text that is no
    number (``2k``) is still refused, and a value quoted for the shell its launch line passes it
    through is read without those quotes."""
    path = tmp_path / "model.yaml"
    path.write_text("ENV_VARS:\n  CUDA_DEVICE_MAX_CONNECTIONS: 1\n  NCCL_NVLS_ENABLE: 0\n"
                    "MODEL_ARGS:\n  --norm-epsilon: 1e-6\n  --moe-router-bias-update-rate: 1e-3\n"
                    "  --micro-batch-size: '2'\n  --moe-ffn-hidden-size: 2k\n"
                    "  --moe-layer-freq: \"'([0]*1+[1]*60)'\"\n")
    cfg = load_config(str(path))
    assert "nccl_nvls_enable" not in cfg and not unknown_fields(cfg)    # the launch's environment, not fields
    assert cfg["layernorm_epsilon"] == 1e-6 and cfg["moe_router_bias_update_rate"] == 1e-3
    assert cfg["moe_layer_freq"] == "([0]*1+[1]*60)"           # quoted for the shell, as Kimi-K2.yaml writes it
    assert cfg["micro_batch_size"] == 2
    assert {f for v in validate(cfg) if v.rule == "field-value" for f in v.fields} == {"moe_ffn_hidden_size"}


def test_dtypes_written_as_torch_writes_them_read_as_megatrons_short_names(tmp_path):
    """Megatron-Core's OptimizerConfig takes torch dtypes, which Bridge's YAML writes as uncalled
    targets and overrides as ``torch.bfloat16``: they read as the short names Megatron-LM's flags
    take (uint8 is its stored "fp8" moment); a name no dtype field takes is still refused."""
    path = tmp_path / "dump.yaml"
    path.write_text("optimizer:\n  exp_avg_dtype:\n    _call_: false\n    _target_: torch.bfloat16\n"
                    "  main_grads_dtype: torch.float32\n  use_precision_aware_optimizer: true\n")
    cfg = load_config(str(path), ["optimizer.exp_avg_sq_dtype=torch.uint8", "main_params_dtype=float16"])
    assert (cfg["exp_avg_dtype"], cfg["main_grads_dtype"], cfg["exp_avg_sq_dtype"], cfg["main_params_dtype"]) == \
        ("bf16", "fp32", "fp8", "fp16")
    assert validate(cfg) == []
    assert [v.rule for v in validate({**cfg, "use_precision_aware_optimizer": False})] == ["optimizer-dtypes-need-aware"]
    assert {v.rule for v in validate(load_config(None, ["main_grads_dtype=torch.float16"]))} == {"field-value"}
    # Bridge's random-token dataset reads as Megatron-LM's --mock-data.
    path.write_text("dataset:\n  _target_: megatron.bridge.training.config.MockGPTDatasetConfig\n  seq_length: 4096\n")
    assert load_config(str(path))["mock"] is True


def run_cli(capsys, *args):
    """`expertrail validate ARGS` in this process: (exit status, stdout, stderr)."""
    try:
        rc = main(["validate", *args])
    except SystemExit as exit_:               # argparse's own errors
        rc = exit_.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_text_json_and_exit_codes(tmp_path, capsys):
    rc, out, _ = run_cli(capsys, "expert_model_parallel_size=8", "num_moe_experts=64")
    assert rc == 0 and out.startswith("valid: ")
    rc, out, _ = run_cli(capsys, "overlap_moe_expert_parallel_comm=true", "expert_model_parallel_size=1")
    assert rc == 1
    assert "[ep-overlap-ep] EP overlap needs expert parallelism" in out and "fix: " in out
    rc, out, _ = run_cli(capsys, "moe_router_topk=1", "--json")
    js = json.loads(out)
    assert rc == 1 and js["valid"] is False and js["violations"][0]["rule"] == "top1-pre-softmax"
    rc, _, err = run_cli(capsys, str(tmp_path / "nope.yaml"))
    assert rc == 2 and "not found" in err


# Plain nonsense used to pass.

@pytest.mark.parametrize("entry,field,words", [
    ("moe_token_dispatcher_type=alltoal", "moe_token_dispatcher_type", "did you mean 'alltoall'"),
    ("expert_model_parallel_size=abc", "expert_model_parallel_size", "whole number"),
    ("--expert-model-parallel-size=abc", "expert_model_parallel_size", "whole number"),
    ("expert_model_parallel_size=0", "expert_model_parallel_size", "at least 1"),
    ("num_moe_experts=2.5", "num_moe_experts", "whole number"),
    ("bf16=yes", "bf16", "true or false"),
    ("moe_router_score_function=sigmod", "moe_router_score_function", "did you mean 'sigmoid'"),
    ("moe_expert_capacity_factor=-1", "moe_expert_capacity_factor", "positive"),
    ("moe_router_load_balancing_type=aux", "moe_router_load_balancing_type", "not one of"),
    ("recompute_granularity=fulll", "recompute_granularity", "did you mean 'full'"),
])
def test_bad_values_are_violations_naming_the_field(entry, field, words, capsys):
    values = load_config(None, [entry, "num_moe_experts=64" if field != "num_moe_experts" else "bf16=true"])
    found = [v for v in validate(values) if v.rule == "field-value"]
    assert len(found) == 1 and field in found[0].title and words in found[0].title and field in found[0].fix
    assert not any("could not evaluate" in v.title for v in validate(values))
    rc, out, err = run_cli(capsys, entry)
    assert rc == 1 and "[field-value]" in out and field in out and "Traceback" not in out + err


def test_rules_reading_a_bad_value_are_left_out():
    found = validate({"expert_model_parallel_size": "abc", "num_moe_experts": 64, "world_size": 16})
    assert [v.rule for v in found] == ["field-value"]


def test_unknown_fields_are_warned_with_the_closest_name(capsys):
    values = load_config(None, ["expert_model_paralel_size=48", "num_moe_experts=64", "zzz_unrelated=1"])
    warned = {w["field"]: w["closest"] for w in unknown_fields(values)}
    assert warned == {"expert_model_paralel_size": "expert_model_parallel_size", "zzz_unrelated": None}
    rc, out, _ = run_cli(capsys, "expert_model_paralel_size=48")
    assert rc == 0 and "did you mean 'expert_model_parallel_size'" in out and "1 warning" in out
    rc, out, _ = run_cli(capsys, "expert_model_paralel_size=48", "--strict")
    assert rc == 1 and "not valid with --strict" in out
    rc, out, _ = run_cli(capsys, "expert_model_paralel_size=48", "--json")
    assert json.loads(out)["warnings"][0]["closest"] == "expert_model_parallel_size"


def test_real_megatron_and_bridge_fields_are_not_warned_about():
    real = ["lr=1e-4", "micro_batch_size=1", "global_batch_size=1024", "seq_length=4096", "num_layers=61",
            "hidden_size=7168", "moe_grouped_gemm=true", "moe_permute_fusion=true", "use_distributed_optimizer=true",
            "train.train_iters=10", "optimizer.weight_decay=0.1", "ddp.overlap_grad_reduce=true",
            "--no-gradient-accumulation-fusion", "--disable-bias-linear", "--num-experts", "8", "--fp8-format", "hybrid",
            "hardware=h100", "world_size=8", "num_of_hybrid_ep_ranks_per_nvlink_domain=8", "torch_version=2.7",
            # Bridge's GPTModelProvider fields, and a Bridge dump's loader keys
            "model.share_embeddings_and_output_weights=false", "model.hf_model_id=deepseek-ai/DeepSeek-V3",
            "model._target_=megatron.bridge.models.DeepSeekV3ModelProvider"]
    assert unknown_fields(load_config(None, real)) == []


def test_topk_above_the_experts_is_rejected(capsys):
    rc, out, _ = run_cli(capsys, "moe_router_topk=300", "num_moe_experts=8")
    assert rc == 1 and "[topk-within-experts]" in out


@pytest.mark.parametrize("name,text", [("empty.yaml", ""), ("empty.json", "  \n"), ("blank.yaml", "# nothing\n"),
                                       ("bad.json", "{not json"), ("bad.yaml", "a: [1, 2"),
                                       ("list.yaml", "- 1\n- 2\n"), ("nofields.json", "{}")])
def test_empty_or_unreadable_files_are_errors(name, text, tmp_path, capsys):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError):
        load_config(str(path))
    rc, out, err = run_cli(capsys, str(path))
    assert rc == 2 and name in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_nothing_to_validate(capsys):
    rc, _, err = run_cli(capsys)
    assert rc == 2 and "nothing to validate" in err
    rc, _, err = run_cli(capsys, "a.yaml", "b.yaml")
    assert rc == 2 and "at most one config file" in err


# Megatron's command-line forms, as written.

MEGATRON_FORMS = [
    ["--expert-model-parallel-size", "32", "--num-experts", "256", "--moe-router-topk", "8", "--moe-grouped-gemm",
     "--overlap-moe-expert-parallel-comm", "--moe-router-enable-expert-bias", "--bf16"],
    ["--expert-model-parallel-size=32", "--num-experts=256", "--moe-router-topk=8", "--moe-grouped-gemm",
     "--overlap-moe-expert-parallel-comm", "--moe-router-enable-expert-bias", "--bf16"],
    ["--expert_model_parallel_size", "32", "--num_experts", "256", "--moe_router_topk", "8", "--moe_grouped_gemm",
     "--overlap_moe_expert_parallel_comm", "--moe_router_enable_expert_bias", "--bf16"],
    ["expert_model_parallel_size=32", "num_moe_experts=256", "model.moe_router_topk=8", "moe_grouped_gemm=true",
     "comm_overlap.overlap_moe_expert_parallel_comm=true", "moe-router-enable-expert-bias=true", "bf16=true"],
]


@pytest.mark.parametrize("form", range(len(MEGATRON_FORMS)))
def test_megatron_argument_forms_read_alike(form):
    assert load_config(None, MEGATRON_FORMS[form]) == {
        "expert_model_parallel_size": 32, "num_moe_experts": 256, "moe_router_topk": 8, "moe_grouped_gemm": True,
        "overlap_moe_expert_parallel_comm": True, "moe_router_enable_expert_bias": True, "bf16": True}


def test_switches_lists_and_continuations():
    files, pairs = split_arguments(["cfg.yaml", "--no-gradient-accumulation-fusion", "\\", "--disable-bias-linear",
                                    "--moe-router-load-balancing-type", "seq_aux_loss", "aux_loss",
                                    "--moe-aux-loss-coeff", "1e-3", "--fp8-format", "e4m3", "--bf16", "false",
                                    "--seed", "-1", "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN=8"])
    assert files == ["cfg.yaml"]
    assert dict(pairs) == {"gradient_accumulation_fusion": False, "add_bias_linear": False,
                           "moe_router_load_balancing_type": ["seq_aux_loss", "aux_loss"],
                           "moe_aux_loss_coeff": 1e-3, "fp8": "e4m3", "bf16": False, "seed": -1,
                           "num_of_hybrid_ep_ranks_per_nvlink_domain": 8}
    with pytest.raises(ConfigError, match="--moe-router-topk needs a value"):
        split_arguments(["--moe-router-topk", "--bf16"])


def test_list_fields_written_as_one_bracketed_string_read_as_their_names(tmp_path):
    """Megatron-LM's functional-test configs write list flags as one YAML string in brackets
    (``--recompute-modules: "[layernorm moe_act]"``): each name is checked and read, by validate
    and by the layout alike; a name outside Megatron-Core's set is still refused by name."""
    from expertrail.plan.layout import TrainingLayout
    path = tmp_path / "model_config.yaml"
    path.write_text('MODEL_ARGS:\n  --recompute-granularity: selective\n  --recompute-modules: "[layernorm moe_act]"\n'
                    '  --cuda-graph-impl: transformer_engine\n  --cuda-graph-modules: "[attn moe_router]"\n')
    values = load_config(str(path), [])
    assert validate(values) == []
    layout = TrainingLayout.from_fields(values, 8)
    assert (layout.recompute_modules, layout.graph_scopes) == (("layernorm", "moe_act"), ("attn", "moe_router"))
    bad = load_config(str(path), ["recompute_modules=[layernorm,moe_actt]"])
    assert "'moe_actt' is not one of" in validate(bad)[0].title


def test_cli_reads_megatron_flags(capsys):
    """`validate --num-experts 256 --expert-model-parallel-size 48` used to fail with "give at most
    one config file" (or argparse's unrecognized arguments)."""
    rc, out, err = run_cli(capsys, "--num-experts", "256", "--expert-model-parallel-size", "48")
    assert rc == 1 and "[experts-divide-ep]" in out and "expert_model_parallel_size=48" in out, err
    rc, out, _ = run_cli(capsys, "--num-experts", "256", "--expert-model-parallel-size", "32", "--json",
                         "--moe-grouped-gemm")
    assert rc == 0 and json.loads(out)["valid"] is True


def test_planner_never_imports_torch():
    code = ("import sys; from expertrail.tools.cli import main; import expertrail.plan; "
            "rc = main(['validate', 'expert_model_parallel_size=8', 'hardware=h100']); "
            "assert 'torch' not in sys.modules, 'torch was imported'; print(rc)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_a_bridge_precision_recipe_name_expands_into_its_fields(tmp_path):
    """``mixed_precision: bf16_with_mxfp8_mixed`` (Bridge's recipe by name) sets the recipe's
    fields, under the configuration's own; an unknown name is refused with the list."""
    path = tmp_path / "bridge.yaml"
    path.write_text("model:\n  expert_model_parallel_size: 8\nmixed_precision: bf16-with-mxfp8-mixed\n")
    values = load_config(str(path), ["mixed_precision.fp8_param_gather=false"])
    assert (values["fp8"], values["fp8_recipe"], values["bf16"], values["fp8_param_gather"]) == ("e4m3", "mxfp8", True,
                                                                                                  False)
    assert unknown_fields(values) == [] and validate(values) == []
    with pytest.raises(ConfigError, match="bf16_with_mxfp8_mixed"):
        load_config(None, ["mixed_precision=bf16_fp8"])


def test_gdn_norm_out_recompute_needs_gated_deltanet():
    """Megatron-Core raises when recompute_modules names gdn_norm_out under another attention variant."""
    def rules(*extra):
        values = load_config(None, ["--recompute-granularity", "selective", "--recompute-modules", "gdn_norm_out", *extra])
        return [v.rule for v in validate(values)]
    assert rules("--experimental-attention-variant", "dsa") == ["gdn-norm-out-needs-gdn"]
    assert rules("--experimental-attention-variant", "gated_delta_net") == []
    assert rules("--experimental-attention-variant", "gdn2") == []


def test_an_attentions_recompute_modules_follow_the_model_named():
    """mla_up_proj and gdn_norm_out recompute parts of an attention the model may not have
    (Megatron-Core raises): with --model, validate reads the model's attention as estimate does, so
    both refuse Qwen3-235B's mla_up_proj and gdn_norm_out and take DeepSeek-V3's and Qwen3-Next's."""
    from expertrail.plan.architecture import ARCHITECTURES
    from expertrail.plan.catalog import HARDWARE
    from expertrail.plan.estimate import estimate
    from expertrail.plan.layout import TrainingLayout
    from expertrail.plan.validate import with_model_fields

    def refused(model, module):
        flags = ["--recompute-granularity", "selective", "--recompute-modules", module, "--expert-model-parallel-size",
                 "8", "--pipeline-model-parallel-size", "1"]
        arch = ARCHITECTURES[model]
        rules = {v.rule for v in validate(with_model_fields(load_config(None, flags), arch))}
        layout = TrainingLayout.from_fields(load_config(None, flags), 512)
        try:
            estimate(arch, HARDWARE["b200"], layout)
            estimated = True
        except ConfigError as err:
            assert module in str(err) and "drop it from recompute_modules" in str(err)
            estimated = False
        assert estimated == (not rules & {"mla-up-proj-needs-mla", "gdn-norm-out-needs-gdn"}), (model, module, rules)
        return not estimated
    assert refused("qwen3-235b-a22b", "mla_up_proj") and refused("qwen3-235b-a22b", "gdn_norm_out")
    assert not refused("deepseek-v3", "mla_up_proj") and refused("deepseek-v3", "gdn_norm_out")
    assert not refused("qwen3-next-80b-a3b", "gdn_norm_out") and refused("qwen3-next-80b-a3b", "mla_up_proj")


def test_mhc_recompute_needs_hyper_connections():
    def rules(*extra):
        values = load_config(None, ["--recompute-granularity", "selective", "--recompute-modules", "mhc", *extra])
        return [v.rule for v in validate(values)]
    assert rules() == ["mhc-recompute"]
    assert rules("--enable-mhc-connections") == []
    assert rules("--enable-mhc-connections", "--fine-grained-activation-offloading",
                 "--offload-modules", "moe_act") == ["mhc-recompute"]


def test_fields_the_named_model_cannot_take_are_violations_not_errors(capsys):
    """With --model, a field the model cannot take (a moe_layer_freq pattern of the wrong length,
    more experts a token than it has) is reported by its rule, exit 1, as without --model."""
    rc, out, _ = run_cli(capsys, "--model", "deepseek-v3", "--moe-layer-freq", "([0]*3+[1]*57)")
    assert rc == 1 and "[moe-layer-pattern]" in out and "gives 60 layers, the model has 61" in out
    rc, out, _ = run_cli(capsys, "--model", "deepseek-v3", "--moe-router-topk", "300")
    assert rc == 1 and "[topk-within-experts]" in out


def test_hardware_names_in_any_case_and_bridges_rack_names():
    """H100 is h100, and Megatron-Bridge's gb200 / gb300 are the NVL72 racks, for every command
    that takes a system; a name of no system is still refused with the list."""
    from expertrail.plan.catalog import load_hardware
    assert load_hardware("H100").name == "h100" and load_hardware("GB200").name == "gb200-nvl72"
    assert load_hardware("gb300").name == "gb300-nvl72" and load_hardware("GB200-NVL36").name == "gb200-nvl36"
    assert "mxfp8-needs-blackwell" in {v.rule for v in validate({"hardware": "H100", "fp8": "e4m3",
                                                                 "fp8_recipe": "mxfp8"})}
    with pytest.raises(ConfigError, match="choose one of a100, h100"):
        load_hardware("v100")


def test_bridges_performance_script_flags_read_as_the_fields_they_set():
    """A layout pasted from Megatron-Bridge's performance scripts (-tp 1 -pp 4 -ep 64 -vp 4 -mb 1
    -gb 4096 -ng 256 -c fp8_mx --moe_a2a_overlap true) reads as the fields those scripts set:
    the parallel sizes, the world size, the mixed-precision recipe their compute dtype picks
    (fp8_cs without BF16 first and last layers) and EP overlap with delayed weight gradients."""
    cfg = load_config(None, ["-tp", "1", "-pp", "4", "-ep", "64", "-vp", "4", "-mb", "1", "-gb", "4096", "-ng", "256",
                             "-sl", "4096", "-c", "fp8_mx", "--moe_a2a_overlap", "true"])
    assert (cfg["tensor_model_parallel_size"], cfg["pipeline_model_parallel_size"], cfg["expert_model_parallel_size"],
            cfg["virtual_pipeline_model_parallel_size"], cfg["world_size"]) == (1, 4, 64, 4, 256)
    assert (cfg["fp8_recipe"], cfg["overlap_moe_expert_parallel_comm"], cfg["delay_wgrad_compute"]) == \
        ("mxfp8", True, True)
    assert not unknown_fields(cfg)
    current = load_config(None, ["-c", "fp8_cs"])
    assert current["fp8_recipe"] == "tensorwise" and current["first_last_layers_bf16"] is False
    assert {v.rule for v in validate(load_config(None, ["-c", "fp9"]))} == {"field-value"}


def test_a_bridge_performance_script_recipe_names_the_model_validate_checks(capsys):
    """Bridge's -mr names the model for validate as for estimate: DeepSeek-V3's 61 layers are
    checked against the pipeline split the command asks for."""
    rc, out, _ = run_cli(capsys, "-mr", "deepseek_v3", "-g", "gb200", "-ng", "64", "-pp", "8", "-vp", "3", "-ep", "8")
    assert rc == 1 and "[pipeline-split]" in out and "num_layers=61" in out
