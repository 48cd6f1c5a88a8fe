"""Megatron's configuration field names, with the kind of value each takes (generated data).

`expertrail validate` reads it to warn about unknown keys (with the closest known name), to
check value types and choices, and to read Megatron's command-line forms: a ``bool`` field is a
``store_true`` switch (``--moe-grouped-gemm``); one that defaults to true is turned off with
``--no-<name>`` or ``--disable-<name>``; `FLAG_ALIASES` maps flags whose name differs from the
field they set (``--num-experts`` sets ``num_moe_experts``, ``--fp8-format`` sets ``fp8``).

Taken from Megatron-LM (main, commit d98e8a64dd): the dataclass fields of TransformerConfig,
ModelParallelConfig, OptimizerConfig, DistributedDataParallelConfig, the training configs
(TrainingConfig, ValidationConfig, SchedulerConfig, LoggerConfig, CheckpointConfig,
TokenizerConfig, RNGConfig, ProfilingConfig, DistributedInitConfig, RerunStateMachineConfig,
StragglerDetectionConfig), BlendedMegatronDatasetConfig / GPTDatasetConfig, and the arguments
declared in megatron/training/arguments.py. Names only, no code. ``ANY`` holds fields whose
type the validator does not check (unions, enums, callables).
"""

BOOL = frozenset("""
account_for_embedding_in_pipeline_split account_for_loss_in_pipeline_split
accumulate_allreduce_grads_in_fp32 activation_func_fp8_input_store add_bias_linear
add_extra_token_to_sequence add_position_embedding add_qkv_bias adlr_autoresume align_grad_reduce
align_param_gather allow_ambiguous_pad_tokens apply_query_key_layer_scaling
apply_residual_connection_post_layernorm apply_rope_fusion apply_wd_to_qk_layernorm async_ckpt_use_cpu_shm
async_save attention_output_gate attention_softmax_in_fp32 auto_detect_ckpt_format average_in_collective
barrier_with_L1_time batch_invariant_mode batch_p2p_comm batch_p2p_sync bert_binary_head bf16
bias_activation_fusion bias_dropout_fusion bias_gelu_fusion bias_swiglu_fusion
biencoder_shared_query_context_model cache_mla_latents calc_ft_timeouts calculate_per_token_loss
check_for_large_grads check_for_nan_in_grad check_for_nan_in_loss check_for_nan_in_loss_and_grad
check_for_spiky_loss checkpoint_activations ckpt_assume_constant_structure
ckpt_convert_update_legacy_dist_opt_format ckpt_drop_redundant_extra_state
ckpt_fully_parallel_load_per_rank_objects ckpt_fully_parallel_save ckpt_load_validate_sharding_integrity
ckpt_pg_tensors_cache_create clone_scatter_output_in_embedding cpu_offloading cpu_offloading_activations
cpu_offloading_double_buffering cpu_offloading_retain_pinned_cpu_buffers cpu_offloading_weights
create_all_gather_group create_attention_mask create_attention_mask_in_dataloader cross_entropy_loss_fusion
cuda_graph_retain_backward_graph cuda_graph_use_single_mempool data_parallel_random_init data_sharding
dataloader_defer_npy_index_mmap dataloader_fast_cache_load dataloader_inter_document_masking
ddp_average_in_collective ddp_pad_buckets_for_high_nccl_busbw ddp_reduce_scatter_with_fp32_accumulation
deallocate_pipeline_outputs decode_only_cuda_graphs decoupled_weight_decay decrease_batch_size_if_needed
defer_embedding_wgrad_compute defer_npy_index_mmap delay_offload_until_cuda_graph delay_wgrad_compute
deprecated_use_mcore_models deterministic_mode dino_norm_last_layer disable_bf16_reduced_precision_matmul
disable_jit_fuser disable_msc disable_parameter_transpose_cache disable_straggler_on_startup
disable_symmetric_registration dist_ckpt_optim_fully_reshardable dist_ckpt_save_pre_mcore_014
distrib_optim_fully_reshardable_mem_efficient distribute_saved_activations
drop_last_partial_validation_sequence dsa_indexer_k_norm_fp32 dsa_indexer_rope_interleaved
dsa_indexer_rotate_activation dsa_indexer_scoring_relu dsa_indexer_use_sparse_loss enable_autocast
enable_chunked_prefill enable_cuda_graph enable_experimental enable_ft_package enable_full_sharding_in_hsdp
enable_mhc_connections enable_msc enable_one_logger eod_mask_loss ep_overlap_early_attn_memory_release
exit_on_missing_checkpoint exit_signal_handler exit_signal_handler_for_dataloader
exit_signal_handler_for_training external_cuda_graph fake_process_group fast_cache_load filter_warnings
fim_data fine_grained_activation_offloading finetune first_last_layers_bf16 flash_decode
flight_recorder_dump_on_timeout flight_recorder_extra_dump_on_exec flight_recorder_include_only_active
flight_recorder_include_stack_trace fp16 fp16_lm_cross_entropy fp32_residual_connection fp4_param
fp4_param_gather fp8_dot_product_attention fp8_multi_head_attention fp8_output_proj fp8_param
fp8_param_gather fp8_wgrad freeze_all_layers fsdp_all_gather_in_start_param_sync
fsdp_db_use_persist_buf_on_alloc_fail fsdp_double_buffer fsdp_manual_registration full_validation
fully_parallel_load fully_parallel_save fused_residual_rmsnorm fused_single_qkv_rope gated_linear_unit
gdp_cutedsl_kernel grad_reduce_in_bf16 grad_reduce_in_fp32 gradient_accumulation_fusion
gradient_reduce_div_fusion group_query_attention grpo_filter_groups_with_same_reward
gtp_expert_remat_nccl_ub gtp_remat_nccl_ub gtp_remat_reduce_scatter_with_fp32_accumulation
hetereogenous_dist_checkpoint heterogeneous_block_specs high_priority_a2a_comm_stream
hybrid_context_parallel inference_cuda_graph_all_prefills inference_disable_triton_nvls_kernels
inference_dynamic_batching inference_dynamic_batching_track_generated_token_events
inference_dynamic_batching_track_paused_request_events inference_fuse_tp_communication
inference_moe_disable_fused_quant_kernels inference_rng_tracker init_method_xavier_uniform
init_model_with_meta_device inprocess_empty_cuda_cache inprocess_restart inter_document_masking
is_hybrid_model keep_fp8_transpose_cache layernorm_zero_centered_gamma lazy_mpu_init
load_main_params_from_ckpt load_optim load_rng log_device_memory_used log_energy
log_l2_norm_grad_to_tensorboard log_loss_scale_to_tensorboard log_max_attention_logit
log_memory_to_tensorboard log_num_zeros_in_grad log_params_norm log_progress log_runtime_to_tensorboard
log_straggler log_throughput log_throughput_to_tensorboard log_timers_to_tensorboard
log_validation_ppl_to_tensorboard log_world_size_to_tensorboard logits_load_ignore_errors manual_gc
manual_gc_eval masked_softmax_fusion megatron_fsdp_cuda_graph_mode
megatron_fsdp_enable_fine_grained_param_gather megatron_fsdp_max_pool_double_buffer
megatron_fsdp_use_decoupled_grad memory_efficient_layer_norm mla_down_proj_fusion mmap_bin_files mock
mock_data moe_apply_probs_on_input moe_enable_deepep moe_enable_routing_replay moe_grouped_gemm
moe_hybridep_pad_uneven_dispatch_inputs moe_layer_recompute moe_ncclep_zero_copy
moe_pad_expert_input_to_capacity moe_pad_experts_for_cuda_graph_inference moe_paged_stash
moe_per_layer_logging moe_permute_fusion moe_permute_fusion_into_hybridep moe_router_enable_expert_bias
moe_router_force_load_balancing moe_router_fusion moe_router_padding_for_fp8
moe_router_padding_for_quantization moe_router_pre_softmax moe_routing_trace_capture_hidden_states
moe_routing_trace_capture_logits moe_routing_trace_dump_weights moe_shared_expert_gate
moe_shared_expert_overlap moe_single_grouped_bias moe_single_grouped_weight moe_token_dropping
moe_use_grouped_tensor moe_use_upcycling mtp_detach_heads mtp_hsm mtp_standalone mtp_use_repeated_layer
multi_latent_attention multiple_validation_sets muon_nesterov muon_split_qkv muon_use_syrk
nccl_all_reduce_for_prefill nccl_ub no_load_optim no_load_rng no_persist_layer_norm no_save_optim
no_save_rng nvtx_ranges offset_sampling_seed_by_dp_rank one_logger_async openai_gelu optimizer_cpu_offload
optimizer_cuda_graph otel_enabled output_bert_embeddings overlap_cpu_optimizer_d2h_h2d
overlap_dispatch_backward_with_experts_wgrad overlap_grad_reduce overlap_moe_expert_parallel_comm
overlap_p2p_comm overlap_p2p_comm_warmup_flush overlap_param_gather overlap_param_gather_with_optimizer_step
override_opt_param_scheduler pad_buckets_for_high_nccl_busbw pad_vocab_size perform_initialization
perform_rl_step persist_layer_norm pin_cpu_grads pin_cpu_params pytorch_profiler_collect_callstack
pytorch_profiler_collect_chakra pytorch_profiler_collect_shapes qk_clip qk_l2_norm qk_layernorm quick_geglu
recompute_activations record_memory_history record_shapes reduce_scatter_with_fp32_accumulation replication
reset_attention_mask reset_position_ids retriever_score_scaling reuse_grad_buf_for_mxfp8_param_ag
rl_durable_rollout_bank rl_offload_optimizer_during_inference rl_profile rotary_interleaved
run_workload_inspector_server save_optim save_rng save_tokenizer_assets sequence_parallel
set_level_for_all_loggers sft skip_train soap_use_kl_shampoo squared_relu store_param_remainders
strict_fsdp_dtensor_load swiglu te_rng_tracker test_mode tokenizer_hf_no_include_special_tokens
tokenizer_hf_no_use_fast tokenizer_sentencepiece_ignore_extra_whitespaces tokenizer_sentencepiece_legacy
torch_fsdp2_reshard_after_forward tp_comm_atomic_ag tp_comm_atomic_rs tp_comm_bulk_dgrad tp_comm_bulk_wgrad
tp_comm_overlap tp_comm_overlap_ag tp_comm_overlap_disable_fc1 tp_comm_overlap_disable_qkv
tp_comm_overlap_rs tp_comm_overlap_rs_dgrad tp_comm_split_ag tp_comm_split_rs tp_only_amax_red
trust_remote_code untie_embeddings_and_output_weights use_checkpoint_args use_checkpoint_opt_param_scheduler
use_cpu_initialization use_custom_fsdp use_dist_ckpt use_distributed_optimizer use_flash_attn
use_fused_weighted_squared_relu use_gigatoken use_gloo_process_groups use_grouped_gemm_for_dense_mlp
use_grouped_gemm_for_shared_expert use_inference_optimized_layers use_kitchen use_kitchen_attention
use_layer_wise_distributed_optimizer use_layer_wise_param_layout use_legacy_static_engine
use_mamba_mem_eff_path use_megatron_fsdp use_mp_args_from_checkpoint_args use_mup use_nsys_profiler
use_one_sent_docs use_persistent_ckpt_worker use_precision_aware_optimizer use_pytorch_profiler
use_ring_exchange_p2p use_rope_scaling use_rotary_position_embeddings use_sharp use_te_activation_func
use_te_rng_tracker use_tokenizer_model_from_checkpoint_args use_torch_fsdp2
use_torch_optimizer_for_cpu_offload use_tp_pp_dp_mapping use_transformer_engine_op_fuser
variable_seq_lengths varlen_sbhd_validation verify_integrity vision_pretraining
yarn_correction_range_round_to_int
""".split())

INT = frozenset("""
adlr_autoresume_interval async_ckpt_cpu_priority async_ckpt_io_priority batch_size biencoder_projection_dim
bucket_size check_weight_hash_across_dp_replicas_interval ckpt_step context_parallel_size
cpu_offloading_num_layers cuda_graph_warmup_steps data_parallel_size ddp_bucket_size ddp_num_buckets
decoder_first_pipeline_num_layers decoder_last_pipeline_num_layers decoder_num_layers decoder_seq_length
delta_offload_bytes_across_pp_ranks dino_bottleneck_size dino_head_hidden_size dino_local_crops_number
dino_local_img_size dino_warmup_teacher_temp_epochs dist_ckpt_workers distributed_timeout_minutes
distributed_timeout_seconds_after_init dsa_indexer_head_dim dsa_indexer_n_heads dsa_indexer_skip_topk_offset
dsa_indexer_topk dsa_indexer_topk_freq encoder_num_layers encoder_seq_length error_injection_rate
eval_global_batch_size eval_interval eval_iters eval_micro_batch_size exit_duration_in_mins exit_interval
expert_gtp_weight_remat_size expert_model_parallel_size expert_tensor_parallel_num_weight_shards
expert_tensor_parallel_size ffn_hidden_size fine_grained_offloading_max_inflight_offloads
flight_recorder_trace_buffer_size fp8_amax_history_len fp8_interval fp8_margin ft_num_warmup_iters
gdp_num_chunk_states_to_recompute gdp_num_householder global_batch_size gpu_sniff_test_interval
grpo_group_size grpo_iterations grpo_prompts_per_step gtp_weight_remat_size hidden_size hysteresis
ict_head_size img_h img_w indexer_batch_size indexer_log_interval inference_batch_times_seqlen_threshold
inference_coordinator_port inference_cuda_graph_max_tokens inference_dynamic_batching_block_size
inference_dynamic_batching_cuda_graph_mixed_prefill_count inference_dynamic_batching_max_requests
inference_dynamic_batching_max_tokens inference_dynamic_batching_num_cuda_graphs
inference_dynamic_batching_unified_memory_level inference_logging_step_interval inference_max_requests
inference_max_seq_length inference_sampling_seed inprocess_active_world_size inprocess_max_iterations
iter_per_epoch kitchen_recipe_number kv_channels kv_lora_rank linear_conv_kernel_dim linear_key_head_dim
linear_num_key_heads linear_num_value_heads linear_value_head_dim local_rank log_interval
log_memory_interval logging_level logits_load_decode_threads logits_load_msc_prefetch_depth
logits_load_prefetch_factor logits_save_top_k logits_save_top_p_min_k lr_decay_iters lr_decay_samples
lr_decay_steps lr_warmup_iters lr_warmup_samples lr_warmup_steps lr_wsd_decay_iters lr_wsd_decay_samples
make_vocab_size_divisible_by mamba_head_dim mamba_num_groups mamba_num_heads mamba_state_dim
manual_gc_interval max_position_embeddings max_seqlen_per_dp_cp_rank max_sequence_length max_tokens_to_oom
megatron_fsdp_version mhc_num_residual_streams mhc_recompute_layer_num mhc_sinkhorn_iterations
micro_batch_size microbatch_group_size_per_vp_stage min_offloaded_tensor_size mlp_chunks_for_prefill
mlp_chunks_for_training model_parallel_size moe_deepep_num_sms moe_ffn_hidden_size
moe_flex_dispatcher_num_sms moe_hybridep_num_blocks_permute moe_hybridep_num_blocks_unpermute
moe_hybridep_num_sms moe_hybridep_num_sms_preprocessing moe_latent_size moe_mlp_glu_interleave_size
moe_paged_stash_page_size moe_router_group_topk moe_router_num_groups moe_router_topk
moe_router_topk_limited_devices moe_routing_trace_max_training_iters moe_shared_expert_glu_interleave_size
moe_shared_expert_intermediate_size moe_upcycling_granularity most_recent_k mtp_num_layers muon_num_ns_steps
mup_base_hidden_size non_persistent_save_interval null_tokenizer_eod_id null_tokenizer_pad_id
num_attention_heads num_buckets num_channels num_classes num_dataset_builder_threads
num_distributed_optimizer_instances num_layers num_layers_at_end_in_bf16 num_layers_at_start_in_bf16
num_layers_in_first_pipeline_stage num_layers_in_last_pipeline_stage num_layers_per_virtual_pipeline_stage
num_microbatches_with_partial_activation_checkpoints num_moe_experts num_query_groups num_speculative_tokens
num_virtual_stages_per_pipeline_rank num_workers original_max_position_embeddings override_ckpt_iteration
padded_vocab_size patch_dim pipeline_model_parallel_size profile_step_end profile_step_start q_lora_rank
qk_head_dim qk_pos_emb_head_dim random_seed recompute_num_layers relative_attention_max_distance
relative_attention_num_buckets replication_factor replication_jump rl_default_top_k
rl_inference_expert_model_parallel_size rl_inference_expert_tensor_model_parallel_size
rl_inference_model_unified_memory_level rl_inference_pipeline_model_parallel_size
rl_inference_tensor_model_parallel_size rl_max_inflight_requests rl_prompts_per_eval
rl_rollout_bank_max_bytes rl_sequence_packing_max_sequences_per_bin rotary_seq_len_interpolation_factor
save_activations_interval save_dgrads_interval save_interval save_params_interval save_retain_interval
save_tokens_per_expert_interval save_wgrads_interval seed seq_length sequence_length sequence_parallel_size
size start_eval_at_iter straggler_ctrlr_port straggler_minmax_count suggested_communication_unit_size
tensor_model_parallel_size tensor_parallel_num_weight_shards tensorboard_log_interval tensorboard_queue_size
throughput_window_size tiktoken_num_special_tokens token_dtype_code train_iters train_samples
train_sync_interval v_head_dim virtual_pipeline_model_parallel_size vocab_extra_ids vocab_size warmup
wd_incr_steps wgrad_deferral_limit wsd_decay_steps yarn_original_max_position_embeddings
""".split())

FLOAT = frozenset("""
activation_func_clamp_value activation_offload_fraction adam_beta1 adam_beta2 adam_eps adaptive_muon_beta2
adaptive_muon_eps attention_dropout beta_fast beta_slow classes_fraction clip_grad data_per_class_fraction
decoupled_lr decoupled_min_lr dino_freeze_last_layer dino_teacher_temp dino_warmup_teacher_temp
dsa_indexer_k_norm_epsilon dsa_indexer_loss_coeff embedding_init_method_std end_weight_decay
fim_fragment_rate fim_rate fim_spm_rate glu_linear_offset grad_norm_skip_threshold grpo_clamp_eps_lower
grpo_clamp_eps_upper grpo_entropy_term_weight grpo_kl_beta head_lr_mult hidden_dropout
inference_dynamic_batching_buffer_size_gb inference_dynamic_batching_mamba_memory_ratio
inference_dynamic_batching_paused_buffer_size_gb inference_dynamic_batching_prefix_caching_mamba_gb
inference_dynamic_batching_prefix_caching_routing_alpha init_method_std initial_loss_scale
inprocess_barrier_timeout inprocess_completion_timeout inprocess_hard_timeout inprocess_heartbeat_interval
inprocess_heartbeat_timeout inprocess_last_call_wait inprocess_monitor_process_interval
inprocess_monitor_thread_interval inprocess_progress_watchdog_interval inprocess_soft_timeout
inprocess_termination_grace_time layernorm_epsilon lion_beta1 lion_beta2 logits_load_kd_loss_alpha
logits_save_top_p loss_scale loss_scale_window lr lr_warmup_fraction lr_warmup_init mask_factor mask_prob
mhc_init_gating_factor mid_level_dataset_surplus min_loss_scale min_lr moe_expert_capacity_factor
moe_expert_rank_capacity_factor moe_input_jitter_eps moe_paged_stash_buffer_size_factor_cpu
moe_paged_stash_buffer_size_factor_cuda moe_router_bias_update_rate moe_router_force_biased
moe_router_quantile_balancing_ema moe_router_topk_scaling_factor moe_z_loss_coeff mscale mscale_all_dim
mtp_loss_scaling_factor muon_extra_scale_factor muon_momentum mup_attn_scale_power mup_base_head_dim
mup_embedding_mult mup_output_mult mup_width_mult optimizer_offload_fraction qk_clip_alpha qk_clip_threshold
query_in_block_prob rl_default_temperature rl_default_top_p rl_generation_lag
rl_importance_sampling_truncation_coef rope_scaling_factor rotary_base rotary_percent rotary_scaling_factor
sample_rate sgd_momentum short_seq_prob soap_shampoo_beta softmax_scale start_weight_decay weight_decay
yarn_beta_fast yarn_beta_slow
""".split())

STR = frozenset("""
adaptive_muon_moment2_method app_tag_run_name app_tag_run_version bert_load block_data_path chat_template
ckpt_convert_save ckpt_pg_tensors_cache_path config_logger_dir data_args_path data_cache_path
data_parallel_sharding_strategy dist_ckpt_format dump_param_to_param_group_map embedding_path
evidence_data_path fim_eod_token fim_middle_token fim_no_prefix fim_pad_token fim_prefix_token
fim_split_sample fim_suffix_token flight_recorder_dump_path fp4_quantizer_factory fp8_quantizer_factory
heterogeneous_layers_config_encoded_json heterogeneous_layers_config_path hybrid_layer_pattern
hybrid_override_pattern ict_load inference_disable_ep_consensus
inference_dynamic_batching_enable_prefix_caching inference_shards inference_text_gen_server_logging
inference_use_synchronous_zmq_collectives inference_wandb_logging kitchen_config_file langrl_env_config load
logits_load_dir logits_save_dir memory_snapshot_path merge_file metadata_path moe_routing_trace_path
mtp_hybrid_override_pattern muon_coefficient_type muon_fp32_matmul_prec muon_scalar_optimizer
muon_scale_mode muon_tp_mode name nccl_communicator_config_path non_persistent_global_ckpt_dir
non_persistent_local_ckpt_dir object_storage_cache_path one_logger_project one_logger_run_name optimizer
otel_service_name otel_span_groups outer_dp_sharding_strategy path_to_cache per_dataset_sequences_path
per_split_data_args_path phase_transition_iterations pretrained_checkpoint result_rejected_tracker_filename
rl_offload_inference_model_weights_when_idle rl_partial_rollouts rl_profile_dir rl_rollout_bank_dir
rl_verify_model_weights_swap rope_type runtime_time_unit save save_config_filepath
sft_mock_dataset_config_json sft_tokenizer_prompt_format split step_batch_size_schedule
te_precision_config_file tensorboard_dir titles_data_path tokenizer_model tp_comm_overlap_cfg
varlen_mock_dataset_config_json vocab_file wandb_entity wandb_exp_name wandb_project wandb_save_dir yaml_cfg
""".split())

LIST = frozenset("""
blend blend_per_split cp_comm_type cuda_graph_modules cuda_graph_scope data_path
ddp_param_name_patterns_for_fp32_local_accumulation gtp_remat_opt_in_modules
hierarchical_context_parallel_sizes high_priority_stream_groups iterations_to_skip modules_to_filter
moe_aux_loss_coeff mrope_section offload_modules param_name_patterns_for_fp32_local_accumulation
profile_ranks rampup_batch_size recompute_modules retriever_report_topk_accuracies rl_inference_parsers spec
special_tokens split_matrix test_data_path train_data_path valid_data_path validation_set_names window_size
""".split())

ANY = frozenset("""
activation_func attention_backend attr autocast_dtype embedding_init_method empty_unused_memory_level
exit_signal experimental_attention_variant_loss_scale_func finalize_model_grads_func flash_attention_version
fn grad_scale_func grad_sync_func inference_cuda_graph_scope init_method linear_attention_freq memory_keys
moe_grad_scale_func moe_layer_freq mtp_grad_scale_func no_rope_freq no_sync_func onnx_safe
output_layer_init_method param_sync_func params_dtype pipeline_dtype pipeline_model_parallel_layout
predicate quant_recipe rl_inference_logprobs_is_correction rl_persist_cuda_graphs rl_skip_bos_token
rl_training_cuda_graphs rl_use_sequence_packing sequences_per_dataset timers timing_log_level tokenizer
window_attn_skip_freq with_name_predicate
""".split())

TRUE_BY_DEFAULT = frozenset("""
add_bias_linear add_extra_token_to_sequence add_position_embedding align_grad_reduce align_param_gather
apply_rope_fusion attention_softmax_in_fp32 barrier_with_L1_time batch_p2p_comm batch_p2p_sync
bert_binary_head bias_dropout_fusion bias_gelu_fusion bias_swiglu_fusion check_for_nan_in_loss
check_for_nan_in_loss_and_grad ckpt_load_validate_sharding_integrity clone_scatter_output_in_embedding
cpu_offloading_activations create_attention_mask create_attention_mask_in_dataloader
cuda_graph_use_single_mempool data_sharding decoupled_weight_decay drop_last_partial_validation_sequence
dsa_indexer_rotate_activation dsa_indexer_scoring_relu enable_one_logger filter_warnings
flight_recorder_dump_on_timeout flight_recorder_extra_dump_on_exec flight_recorder_include_only_active
fp8_wgrad fsdp_all_gather_in_start_param_sync fully_parallel_save gradient_accumulation_fusion
gradient_reduce_div_fusion load_optim load_rng log_loss_scale_to_tensorboard manual_gc_eval
masked_softmax_fusion mmap_bin_files multi_latent_attention muon_split_qkv offset_sampling_seed_by_dp_rank
overlap_p2p_comm pad_vocab_size perform_initialization pin_cpu_grads pin_cpu_params save_optim save_rng
save_tokenizer_assets soap_use_kl_shampoo store_param_remainders strict_fsdp_dtensor_load
tokenizer_sentencepiece_ignore_extra_whitespaces torch_fsdp2_reshard_after_forward tp_comm_bulk_dgrad
tp_comm_bulk_wgrad tp_comm_overlap_ag tp_comm_overlap_rs tp_comm_split_ag tp_comm_split_rs
use_gloo_process_groups use_layer_wise_param_layout use_mamba_mem_eff_path
use_tokenizer_model_from_checkpoint_args yarn_correction_range_round_to_int
""".split())

CHOICES = {
    'async_strategy': ('nvrx', 'mcore'),
    'batch_invariant_backend': ('te_native', 'deepgemm', 'triton'),
    'bert_embedder_type': ('megatron', 'huggingface'),
    'ckpt_convert_format': ('torch', 'torch_dist'),
    'ckpt_format': ('torch', 'torch_dist', 'torch_dcp', 'fsdp_dtensor'),
    'ckpt_fully_parallel_load_exchange_algo': ('broadcast', 'gather_rounds', 'gather_object'),
    'ckpt_fully_parallel_load_process_group': ('dp', 'ep_dp'),
    'ckpt_fully_parallel_save_process_group': ('dp', 'ep_dp'),
    'cross_entropy_fusion_impl': ('native', 'te'),
    'cuda_graph_impl': ('none', 'local', 'transformer_engine', 'full_iteration'),
    'dataloader_type': ('single', 'cyclic', 'external'),
    'dist_ckpt_strictness': ('assume_ok_unexpected', 'log_unexpected', 'log_all', 'raise_unexpected',
        'raise_all', 'return_unexpected', 'return_all', 'ignore_all'),
    'distributed_backend': ('nccl', 'gloo'),
    'dsa_kernel_backend': ('none', 'tilelang', 'cudnn'),
    'error_injection_type': ('correct_result', 'transient_error', 'persistent_error'),
    'exp_avg_dtype': ('fp32', 'fp16', 'bf16', 'fp8'),
    'exp_avg_sq_dtype': ('fp32', 'fp16', 'bf16', 'fp8'),
    'experimental_attention_variant': ('gdn', 'gdn2', 'dsa', 'gated_delta_net'),
    'fp4': ('e2m1',),
    'fp4_recipe': ('nvfp4', 'custom'),
    'fp8': ('e4m3', 'hybrid'),
    'fp8_amax_compute_algo': ('most_recent', 'max'),
    'fp8_recipe': ('tensorwise', 'delayed', 'mxfp8', 'blockwise', 'custom'),
    'inference_dynamic_batching_async_sched_mode': ('legacy', 'async'),
    'inference_dynamic_batching_cuda_graph_sizing_distribution': ('exponential', 'linear'),
    'inference_dynamic_batching_logprobs_mode': ('raw_logprobs', 'processed_logprobs'),
    'inference_dynamic_batching_prefix_caching_coordinator_policy': ('longest_prefix', 'first_prefix_block',
        'load_balanced'),
    'inference_dynamic_batching_prefix_caching_eviction_policy': ('ref_zero', 'lru'),
    'inference_dynamic_batching_sampling_backend': ('torch', 'flashinfer'),
    'inference_grouped_gemm_backend': ('flashinfer', 'torch', 'vllm'),
    'inference_moe_token_dispatcher_type': ('nccl', 'nvls'),
    'inprocess_granularity': ('node', 'rank'),
    'kitchen_attention_backend': ('sdpa', 'fa'),
    'logit_dtype': ('bf16', 'fp32'),
    'logits_save_dtype': ('fp16', 'bf16', 'fp32'),
    'lr_decay_style': ('constant', 'linear', 'cosine', 'inverse-square-root', 'WSD'),
    'lr_wsd_decay_style': ('exponential', 'linear', 'cosine', 'minus_sqrt'),
    'main_grads_dtype': ('fp32', 'bf16'),
    'main_params_dtype': ('fp32', 'fp16'),
    'mamba_inference_conv_states_dtype': ('bf16', 'fp16', 'fp32'),
    'mamba_inference_ssm_states_dtype': ('bf16', 'fp16', 'fp32'),
    'mamba_training_ssm_states_dtype': ('fp32', 'bf16'),
    'mask_type': ('random', 'row'),
    'megatron_fsdp_grad_comm_dtype': ('fp32', 'fp16', 'bf16', 'auto'),
    'megatron_fsdp_main_grads_dtype': ('fp32', 'bf16', 'fp16', 'auto'),
    'megatron_fsdp_main_params_dtype': ('fp32', 'bf16', 'fp16', 'auto'),
    'moe_combine_bwd_dtype': ('bf16', 'mxfp8'),
    'moe_dispatch_fwd_dtype': ('bf16', 'mxfp8'),
    'moe_flex_dispatcher_backend': ('deepep', 'hybridep', 'ncclep'),
    'moe_router_dtype': ('fp32', 'fp64'),
    'moe_router_score_function': ('softmax', 'sigmoid', 'sqrtsoftplus'),
    'moe_token_dispatcher_type': ('allgather', 'alltoall', 'flex'),
    'moe_token_drop_policy': ('probs', 'position'),
    'no_weight_decay_cond_type': ('qwen3_next',),
    'non_persistent_ckpt_type': ('global', 'local', 'in_memory'),
    'non_persistent_local_ckpt_algo': ('fully_parallel', 'atomic'),
    'normalization': ('LayerNorm', 'RMSNorm'),
    'pipeline_model_parallel_comm_backend': ('nccl', 'ucc'),
    'position_embedding_type': ('learned_absolute', 'rope', 'yarn', 'mrope', 'relative', 'none'),
    'recompute_granularity': ('full', 'selective'),
    'recompute_method': ('uniform', 'block'),
    'refit_method': ('nccl', 'gloo', 'nvshmem'),
    'rerun_mode': ('disabled', 'validate_results', 'report_stats'),
    'rl_consumption_granularity': ('R', 'G', 'B'),
    'rl_kv_cache_management_mode': ('persist', 'offload', 'recompute'),
    'rl_sequence_packing_algo': ('fifo', 'round-robin'),
    'rl_submission_granularity': ('R', 'G', 'B'),
    'sharp_enabled_group': ('dp', 'dp_replica'),
    'softmax_type': ('vanilla', 'off-by-one', 'learnable'),
    'swin_backbone_type': ('tiny', 'base', 'h3'),
    'symmetric_ar_type': ('two_shot', 'one_shot', 'multimem_all_reduce'),
    'tiktoken_pattern': ('v1', 'v2'),
    'timing_log_option': ('max', 'minmax', 'all'),
    'tokenizer_type': ('BertWordPieceLowerCase', 'BertWordPieceCase', 'GPT2BPETokenizer',
        'SentencePieceTokenizer', 'GPTSentencePieceTokenizer', 'HuggingFaceTokenizer', 'Llama2Tokenizer',
        'TikTokenizer', 'MultimodalTokenizer', 'NullTokenizer', 'NullMultimodalTokenizer', 'SFTTokenizer'),
    'tp_comm_bootstrap_backend': ('nccl', 'mpi', 'gloo'),
    'transformer_impl': ('local', 'transformer_engine', 'inference_optimized'),
    'vision_backbone_type': ('vit', 'mit', 'swin'),
    'vision_pretraining_type': ('classify', 'inpaint', 'dino'),
    'weight_decay_incr_style': ('constant', 'linear', 'cosine'),
}

LIST_CHOICES = {
    'moe_router_load_balancing_type': ('aux_loss', 'seq_aux_loss', 'global_aux_loss', 'sinkhorn',
        'quantile_balancing', 'none'),
}

FLAG_ALIASES = {
    'apply_layernorm_1p': ('layernorm_zero_centered_gamma', True),
    'bert_no_binary_head': ('bert_binary_head', False),
    'ckpt_fully_parallel_load': ('fully_parallel_load', True),
    'disable_bias_linear': ('add_bias_linear', False),
    'disable_gloo_process_groups': ('use_gloo_process_groups', False),
    'disable_mamba_mem_eff_path': ('use_mamba_mem_eff_path', False),
    'fp4_format': ('fp4', None),
    'fp4_param_gather': ('fp4_param', True),
    'fp8_format': ('fp8', None),
    'inference_dynamic_batching_prefix_caching': ('inference_dynamic_batching_enable_prefix_caching', None),
    'microbatch_group_size_per_virtual_pipeline_stage': ('microbatch_group_size_per_vp_stage', None),
    'muon_no_split_qkv': ('muon_split_qkv', False),
    'no_align_param_gather': ('align_param_gather', False),
    'no_barrier_with_level_1_timing': ('barrier_with_L1_time', False),
    'no_bias_dropout_fusion': ('bias_dropout_fusion', False),
    'no_bias_gelu_fusion': ('bias_gelu_fusion', False),
    'no_bias_swiglu_fusion': ('bias_swiglu_fusion', False),
    'no_check_for_nan_in_loss_and_grad': ('check_for_nan_in_loss_and_grad', False),
    'no_ckpt_fully_parallel_save': ('fully_parallel_save', False),
    'no_create_attention_mask_in_dataloader': ('create_attention_mask_in_dataloader', False),
    'no_data_sharding': ('data_sharding', False),
    'no_gradient_accumulation_fusion': ('gradient_accumulation_fusion', False),
    'no_gradient_reduce_div_fusion': ('gradient_reduce_div_fusion', False),
    'no_initialization': ('perform_initialization', False),
    'no_masked_softmax_fusion': ('masked_softmax_fusion', False),
    'no_mmap_bin_files': ('mmap_bin_files', False),
    'no_one_logger': ('enable_one_logger', False),
    'no_overlap_p2p_communication': ('overlap_p2p_comm', False),
    'no_pin_cpu_grads': ('pin_cpu_grads', False),
    'no_pin_cpu_params': ('pin_cpu_params', False),
    'no_position_embedding': ('add_position_embedding', False),
    'no_rope_fusion': ('apply_rope_fusion', False),
    'no_use_layer_wise_param_layout': ('use_layer_wise_param_layout', False),
    'no_yarn_correction_range_round_to_int': ('yarn_correction_range_round_to_int', False),
    'norm_epsilon': ('layernorm_epsilon', None),
    'num_experts': ('num_moe_experts', None),
    'output_logit_dtype': ('logit_dtype', None),
    'overlap_p2p_communication_warmup_flush': ('overlap_p2p_comm_warmup_flush', True),
    'persistent_save_interval': ('save_interval', None),
    'profile': ('use_nsys_profiler', True),
    'te_rng_tracker': ('use_te_rng_tracker', True),
    'tokenizer_metadata': ('metadata_path', None),
    'tokenizer_special_tokens': ('special_tokens', None),
    'torch_fsdp2_no_reshard_after_forward': ('torch_fsdp2_reshard_after_forward', False),
    'use_mcore_models': ('deprecated_use_mcore_models', True),
    'use_nccl_ub': ('nccl_ub', True),
    'use_same_sampling_seed_across_dp_ranks': ('offset_sampling_seed_by_dp_rank', False),
}
