"""Launch lines are read as the runs they start. A Megatron-MoE-ModelZoo line (``PR=mxfp8 TP=1
... bash sbatch_benchmarking.sh --flags``): the model's file with the line's variables substituted,
runtime.conf's defaults for what the line leaves out, the flags the variables stand for, and
NNODES nodes of the system's size. A torchrun line (``torchrun --nproc_per_node 8 --nnodes 4
pretrain_gpt.py --flags``): the script's arguments on nproc_per_node x nnodes GPUs."""
import pytest

from expertrail.errors import ConfigError
from expertrail.plan import calibration
from expertrail.plan.modelzoo import RUNTIME_DEFAULTS, launch_arguments
from expertrail.plan.launch_line import script_arguments
from expertrail.plan.validate import Config, config_values
from expertrail.tools.cli import main

# The ModelZoo's Qwen3-235B model file (model_configs/benchmarking/Qwen3-235B-A22B.yaml at commit
# e8650517), its logging, data and learning-rate lines left out.
QWEN3_235B_FILE = """ENV_VARS:
  CUDA_DEVICE_MAX_CONNECTIONS: 1
  TRITON_CACHE_DIR: /tmp/triton_cache_$SLURM_NODEID
MODEL_ARGS:
  --tensor-model-parallel-size: ${TP}
  --pipeline-model-parallel-size: ${PP}
  --num-layers-per-virtual-pipeline-stage: ${LAYERS_PER_VP}
  --expert-model-parallel-size: ${EP}
  --context-parallel-size: ${CP}
  --expert-tensor-parallel-size: 1
  --use-distributed-optimizer: true
  --overlap-grad-reduce: true
  --overlap-param-gather: true
  --no-create-attention-mask-in-dataloader: true
  --account-for-embedding-in-pipeline-split: true
  --account-for-loss-in-pipeline-split: true
  --sequence-parallel: true
  --disable-bias-linear: true
  --micro-batch-size: ${MBS}
  --global-batch-size: ${GBS}
  --cross-entropy-loss-fusion: true
  --transformer-impl: transformer_engine
  --tokenizer-type: HuggingFaceTokenizer 
  --tokenizer-model: Qwen/Qwen3-235B-A22B
  --data-path: ${DATA_PATH}
  --untie-embeddings-and-output-weights: true
  --position-embedding-type: rope
  --normalization: RMSNorm
  --swiglu: true
  --num-layers: 94
  --hidden-size: 4096
  --ffn-hidden-size: 12288
  --num-attention-heads: 64
  --kv-channels: 128
  --group-query-attention: true
  --num-query-groups: 4
  --qk-layernorm: true
  --seq-length: ${SEQ_LEN}
  --max-position-embeddings: ${SEQ_LEN}
  --make-vocab-size-divisible-by: 1187
  --num-experts: 128
  --moe-ffn-hidden-size: 1536
  --moe-router-load-balancing-type: aux_loss
  --moe-router-topk: 8
  --moe-router-pre-softmax: false # Different from Qwen2-MoE
  --moe-grouped-gemm: ${MOE_GROUPED_GEMM}
  --moe-router-dtype: fp32
  --finetune: true
  --load: ${LOAD_PATH}
  --wandb-exp-name: Qwen3-235B-A22B-TP${TP}PP${PP}EP${EP}CP${CP}VPP${VPP}-MBS${MBS}GBS${GBS}-${COMMENT}
  --bf16: true
"""

# run_gb200_235b.sh's MXFP8 line (919 TFLOPS published), with the script's exports before it.
GB200_MXFP8 = ("GB200_CLUSTER=1 MODEL=Qwen3-235B-A22B PRETRAIN=0 SEQ_LEN=4096 PR=mxfp8 MBS=3 "
               "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True DISPATCHER=hybridep A2A_OVERLAP=1 TP=1 PP=4 VPP=6 "
               "EP=64 SEGMENT=16 NNODES=64 GBS=3072 bash {script} --recompute-granularity selective "
               "--recompute-modules moe_act layernorm --moe-router-force-load-balancing --cuda-graph-impl "
               "transformer_engine --cuda-graph-scope attn moe_router moe_preprocess "
               "--fine-grained-activation-offloading --offload-modules expert_fc1 moe_act")
RECORDED = "modelzoo gb200 qwen3-235b-a22b mxfp8 1/4/6/64 mbs3 gbs3072 ep-overlap offload"


@pytest.fixture
def checkout(tmp_path):
    """A ModelZoo checkout's launch script and Qwen3-235B model file."""
    (tmp_path / "sbatch_benchmarking.sh").write_text("#!/bin/bash\n")
    (tmp_path / "interactive_benchmarking.sh").write_text("#!/bin/bash\n")
    models = tmp_path / "model_configs" / "benchmarking"
    models.mkdir(parents=True)
    (models / "Qwen3-235B-A22B.yaml").write_text(QWEN3_235B_FILE)
    return tmp_path


def _values(line: str) -> dict:
    return config_values(line.split())


def test_a_launch_line_is_the_run_its_scripts_start(checkout):
    """The line's variables fill the model file's ${...}, runtime.conf's row for the model what the
    line leaves out (LAYERS_PER_VP = 96 / PP / VPP: the row counts the embedding and the loss), and
    sbatch_benchmarking.sh's variables become its flags: MXFP8 with the precision-aware optimizer,
    HybridEP, EP overlap with delayed weight gradients; 64 nodes of 4 GPUs."""
    v = _values(GB200_MXFP8.format(script=checkout / "sbatch_benchmarking.sh"))
    assert (v["tensor_model_parallel_size"], v["pipeline_model_parallel_size"], v["expert_model_parallel_size"],
            v["context_parallel_size"]) == (1, 4, 64, 1)
    assert v["num_layers_per_virtual_pipeline_stage"] == 4 and "num_virtual_stages_per_pipeline_rank" not in v
    assert (v["micro_batch_size"], v["global_batch_size"], v["seq_length"]) == (3, 3072, 4096)
    assert v["fp8_recipe"] == "mxfp8" and v["use_precision_aware_optimizer"] and v["exp_avg_dtype"] == "bf16"
    assert v["moe_token_dispatcher_type"] == "flex" and v["moe_flex_dispatcher_backend"] == "hybridep"
    assert v["overlap_moe_expert_parallel_comm"] and v["delay_wgrad_compute"]
    assert "moe_router_pre_softmax" not in v and "tp_comm_overlap" not in v      # a false flag is not passed
    assert v["account_for_embedding_in_pipeline_split"] and v["finetune"] and v["load"] == "checkpoint"
    assert Config(v).world == 256 and "modelzoo_model" not in v


def test_the_launch_line_estimates_as_its_published_row(checkout, capsys):
    """run_gb200_235b.sh's MXFP8 line, given to estimate as the script has it, costs as the row the
    calibration records for that run (which was entered from the same line by hand); outside a
    checkout, the catalog model with what every model file sets does the same, and says so."""
    expected = calibration.predicted(RECORDED)["tflops_per_gpu"]
    for script, said in ((checkout / "sbatch_benchmarking.sh", False),
                         (checkout / "elsewhere" / "sbatch_benchmarking.sh", True)):
        assert main(["estimate", "--hardware", "gb200", *GB200_MXFP8.format(script=script).split()]) == 0
        out = capsys.readouterr().out
        tflops = float(out.split("throughput: ")[1].split()[0])
        assert tflops == pytest.approx(expected, rel=0.005)
        assert ("its ModelZoo model file (model_configs/benchmarking/<MODEL>.yaml) is not beside" in out) == said


# A best_practice/ run script as the ModelZoo writes them: exports, then a menu of launches, run
# from the checkout's root ("bash best_practice/qwen3/run_gb200_235b.sh").
RUN_SCRIPT = """# cluster setup
export MODEL=Qwen3-235B-A22B
export GB200_CLUSTER=1
export VPP=
export SEQ_LEN=4096
PR=bf16 TP=1 PP=8 EP=32 NNODES=64 GBS=8192 bash sbatch_benchmarking.sh --moe-router-force-load-balancing
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
PRETRAIN=0 PR=mxfp8 MBS=3 DISPATCHER=hybridep A2A_OVERLAP=1 TP=1 PP=4 VPP=6 EP=64 SEGMENT=16 NNODES=64 GBS=3072 \\
    bash sbatch_benchmarking.sh --recompute-granularity selective --recompute-modules moe_act layernorm \\
    --moe-router-force-load-balancing --cuda-graph-impl transformer_engine --cuda-graph-scope attn moe_router \\
    moe_preprocess --fine-grained-activation-offloading --offload-modules expert_fc1 moe_act
"""


def test_a_run_script_hands_its_launch_to_the_modelzoo_reader(checkout, monkeypatch, capsys):
    """A ModelZoo run script is read with bash up to its `bash sbatch_benchmarking.sh`, which is
    not followed (it writes files as it builds the command) but handed on with the variables set
    for it: its second launch (launch=2) reads as the pasted line does and estimates as the row
    recorded from it; with no launch= the script's two launches are listed, and none is run."""
    (checkout / "sbatch_benchmarking.sh").write_text("#!/bin/bash\necho ran > ran.txt\n")
    (checkout / "best_practice" / "qwen3").mkdir(parents=True)
    (checkout / "best_practice" / "qwen3" / "run_gb200_235b.sh").write_text(RUN_SCRIPT)
    monkeypatch.chdir(checkout)
    script = "best_practice/qwen3/run_gb200_235b.sh"
    v = config_values([script, "launch=2"])
    assert v.pop("launch_script") == f"{script} starts sbatch_benchmarking.sh (the ModelZoo's) with 16 arguments"
    assert v == _values(GB200_MXFP8.format(script=checkout / "sbatch_benchmarking.sh"))
    assert main(["estimate", "--hardware", "gb200", script, "launch=2"]) == 0
    tflops = float(capsys.readouterr().out.split("throughput: ")[1].split()[0])
    assert tflops == pytest.approx(calibration.predicted(RECORDED)["tflops_per_gpu"], rel=0.005)
    first = config_values([script, "launch=1"])
    assert (first["pipeline_model_parallel_size"], first["expert_model_parallel_size"]) == (8, 32)
    assert "num_virtual_stages_per_pipeline_rank" not in first          # VPP= empty: runtime.conf's 4 is not
    with pytest.raises(ConfigError, match=r"starts 2 training commands \(1: .*; 2: .*\): give launch=N"):
        config_values([script])
    with pytest.raises(ConfigError, match="launch=3: .* give launch=N with N from 1 to 2"):
        config_values([script, "launch=3"])
    assert not (checkout / "ran.txt").exists()


def test_runtime_conf_fills_what_a_line_leaves_out(checkout):
    """MODEL alone: Qwen3-235B's runtime.conf row (TP 2, PP 8, EP 32, VPP 4, GBS 256, 32 nodes: of
    8 GPUs on an H100 system, of 4 on a GB200 rack, where GB200_CLUSTER does not say), BF16 with TP
    communication overlap, and DeepEP (sbatch_benchmarking.sh's DISPATCHER default, after the
    model file's own dispatcher)."""
    v = _values(f"MODEL=Qwen3-235B-A22B bash {checkout / 'sbatch_benchmarking.sh'}")
    row = RUNTIME_DEFAULTS["Qwen3-235B-A22B"]
    assert (v["tensor_model_parallel_size"], v["pipeline_model_parallel_size"], v["expert_model_parallel_size"]) \
        == (int(row["TP"]), int(row["PP"]), int(row["EP"])) == (2, 8, 32)
    assert v["num_layers_per_virtual_pipeline_stage"] == 3 and v["global_batch_size"] == 256
    assert Config(dict(v, hardware="h100")).world == 256 and Config(dict(v, hardware="gb200")).world == 128
    assert v["tp_comm_overlap"] and v["bf16"] and "fp8_recipe" not in v
    assert v["moe_flex_dispatcher_backend"] == "deepep"


def test_each_variable_is_the_flags_the_script_appends(checkout):
    """PR=fp8 is blockwise FP8 with FP8 parameter gathers, but not beside the optimizer's CPU
    offload; DISPATCHER=alltoall Megatron's all-to-all; VPP without a per-stage count in the model
    file is stages per rank (layers per stage for interactive_benchmarking.sh) and nothing where
    the line gives a pipeline layout; the line's own flags win over the model file's, whose win
    over TRAINING_PARAMS (the arguments the script starts from)."""
    script = checkout / "sbatch_benchmarking.sh"
    fp8 = _values(f"MODEL=Qwen3-235B-A22B PR=fp8 DISPATCHER=alltoall bash {script} --moe-router-topk 4")
    assert fp8["fp8_recipe"] == "blockwise" and fp8["fp8_param_gather"] and fp8["moe_router_padding_for_fp8"]
    assert fp8["moe_token_dispatcher_type"] == "alltoall" and fp8["moe_router_topk"] == 4
    before = config_values(["MODEL=Qwen3-235B-A22B", "TRAINING_PARAMS=--mtp-num-layers 1 --moe-router-topk 2", "bash",
                            str(script)])
    assert before["mtp_num_layers"] == 1 and before["moe_router_topk"] == 8      # the model file's come after
    offload = _values(f"MODEL=Qwen3-235B-A22B PR=fp8 OPTIMIZER_OFFLOAD=1 bash {script}")
    assert offload["optimizer_cpu_offload"] and "fp8_param_gather" not in offload
    (checkout / "model_configs" / "benchmarking" / "Qwen3-235B-A22B.yaml").write_text(
        QWEN3_235B_FILE.replace("  --num-layers-per-virtual-pipeline-stage: ${LAYERS_PER_VP}\n", ""))
    assert _values(f"MODEL=Qwen3-235B-A22B VPP=4 bash {script}")["num_virtual_stages_per_pipeline_rank"] == 4
    interactive = _values(f"MODEL=Qwen3-235B-A22B VPP=4 bash {checkout / 'interactive_benchmarking.sh'}")
    assert interactive["num_layers_per_virtual_pipeline_stage"] == 3
    laid = _values(f"MODEL=Qwen3-235B-A22B VPP=4 bash {script} --pipeline-model-parallel-layout Et*3|(t*3|)*30tL")
    assert "num_virtual_stages_per_pipeline_rank" not in laid and "num_layers_per_virtual_pipeline_stage" not in laid


def test_an_uneven_split_takes_runtime_confs_first_and_last_stages(tmp_path):
    """DeepSeek-V3's 61 layers over PP 16 without a layout: runtime.conf's 4 and 1 layers for the
    first and last stages, as the script passes them (its model file not at hand here: the catalog
    model)."""
    v = _values(f"MODEL=DeepSeek-V3 bash {tmp_path / 'sbatch_benchmarking.sh'}")
    assert (v["decoder_first_pipeline_num_layers"], v["decoder_last_pipeline_num_layers"]) == (4, 1)
    assert v["modelzoo_model"] == "DeepSeek-V3" and Config(dict(v, hardware="h100")).world == 1024
    laid = _values(f"MODEL=DeepSeek-V3 bash {tmp_path / 'sbatch_benchmarking.sh'} --pipeline-model-parallel-layout "
                   "Et*4|(t*4|)*14tmL")
    assert "decoder_first_pipeline_num_layers" not in laid


@pytest.mark.parametrize("line, names", [
    ("bash {script}", "the line sets no MODEL"),
    ("MODEL=Qwen3-236B bash {script}", "MODEL=Qwen3-236B is not one of the ModelZoo's models"),
    ("MODEL=Qwen3-30B-A3B PR=fp4 bash {script}", "PR=fp4"),
    ("MODEL=Qwen3-30B-A3B DISPATCHER=nccl bash {script}", "DISPATCHER=nccl"),
    ("MODEL=Qwen3-30B-A3B TP=0 bash {script}", "TP=0: a whole number >= 1"),
    ("MODEL=Qwen3-30B-A3B NNODES=two bash {script}", "NNODES=two"),
    ("MODEL=Qwen3-30B-A3B TRAINING_PARAMS_PATH=/nonexistent.yaml bash {script}", "TRAINING_PARAMS_PATH"),
    ("MODEL=DeepSeek-V3-Proxy bash {script}", "MODEL=DeepSeek-V3-Proxy: its ModelZoo model file is not beside"),
])
def test_a_launch_the_scripts_would_refuse_is_refused_by_name(tmp_path, capsys, line, names):
    """Every way a launch line is unusable names the variable and the fix; a ModelZoo model of no
    catalog model asks for its file or --model rather than costing another model."""
    tokens = line.format(script=tmp_path / "sbatch_benchmarking.sh").split()
    assert main(["estimate", "--hardware", "h100", *tokens]) != 0
    assert names in capsys.readouterr().err
    if "Proxy" not in line:
        with pytest.raises(ConfigError, match=names.split(":")[0].replace("(", r"\(")):
            launch_arguments(tokens)


def test_tokens_without_a_launch_pass_as_they_are():
    tokens = ["--expert-model-parallel-size", "8", "TP=2", "hardware=h100"]
    assert launch_arguments(tokens) == tokens


def test_nodes_are_the_systems_own_size_where_the_configuration_gives_none():
    """num_nodes without gpus_per_node: 4 GPUs a node on a Grace-Blackwell rack's compute tray,
    8 on DGX and HGX nodes."""
    assert Config({"num_nodes": 64, "hardware": "gb200"}).world == 256
    assert Config({"num_nodes": 64, "hardware": "b200"}).world == 512
    assert Config({"num_nodes": 64, "gpus_per_node": 8, "hardware": "gb200"}).world == 512
    assert Config({"num_nodes": 64}).world is None


@pytest.mark.parametrize("line, recorded", [
    ("--moe-router-force-load-balancing", "modelzoo h100 mixtral-8x22b bf16 2/8/7/8 mbs1 gbs256"),
    ("", "modelzoo h100 mixtral-8x22b bf16 2/8/7/8 mbs1 gbs256 dropless"),
    ("--moe-router-force-load-balancing PR=fp8", "modelzoo h100 mixtral-8x22b blockwise 2/8/7/8 mbs1 gbs256"),
])
def test_run_mixtral_8x22b_lines_estimate_as_their_rows(tmp_path, capsys, line, recorded):
    """run_mixtral_8x22B.sh's dropless, forced-balance and blockwise FP8 lines (445, 465 and 560
    TFLOPS published), outside a checkout: as the rows entered from them by hand."""
    flags, _, pr = line.partition(" PR=")
    tokens = [*([f"PR={pr}"] if pr else []), "MODEL=Mixtral-8x22B", "MBS=1", "GBS=256", "SEQ_LEN=4096", "NNODES=16",
              "DISPATCHER=alltoall", "bash", str(tmp_path / "sbatch_benchmarking.sh"), *flags.split()]
    assert main(["estimate", "--hardware", "h100", *tokens]) == 0
    tflops = float(capsys.readouterr().out.split("throughput: ")[1].split()[0])
    assert tflops == pytest.approx(calibration.predicted(recorded)["tflops_per_gpu"], rel=0.005)


def test_a_torchrun_line_is_its_scripts_arguments_on_the_gpus_it_starts(capsys):
    """Megatron-LM's examples' launch (train_mixtral_8x7b_distributed.sh's form, with the shell's
    variable before it): torchrun's options are not fields, the script is not a config file, and
    8 processes a node on 4 nodes are the run's 32 GPUs; python -m torch.distributed.run alike,
    an elastic node range at its upper bound."""
    line = ("CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun --nproc_per_node 8 --nnodes 4 --node_rank 0 --master_addr host "
            "--master_port 6000 pretrain_gpt.py --expert-model-parallel-size 8 --pipeline-model-parallel-size 4 "
            "--global-batch-size 256 --bf16").split()
    v = config_values(line)
    assert Config(v).world == 32 and v["expert_model_parallel_size"] == 8
    assert not {"nproc_per_node", "master_port", "cuda_device_max_connections"} & set(v)
    assert main(["estimate", "--hardware", "h100", "--model", "mixtral-8x7b", *line]) == 0
    captured = capsys.readouterr()
    assert "on 32 x h100" in captured.out and "warning" not in captured.err
    module = "python3 -m torch.distributed.run --nproc-per-node=4 --nnodes=1:2 --standalone pretrain_gpt.py --bf16"
    assert Config(config_values(module.split())).world == 8
    # The interpreter's own options before the module or the script.
    module = "python -X faulthandler -u -m torch.distributed.run --nproc_per_node 8 pretrain_gpt.py --bf16"
    assert Config(config_values(module.split())).world == 8
    assert script_arguments("python -u -W ignore pretrain_gpt.py --bf16".split()) == ["--bf16"]
    assert script_arguments("python -c print(1) --bf16".split()) == "python -c print(1) --bf16".split()


def test_an_srun_line_is_its_scripts_arguments_one_gpu_a_task():
    """Slurm starting Python itself, one process a task: srun's options are not fields, and its
    nodes x tasks a node are the GPUs; torchrun under srun counts its own."""
    line = "srun -N4 --ntasks-per-node=8 --container-image=img python -u pretrain_gpt.py --bf16".split()
    assert script_arguments(line) == ["--bf16", "gpus_per_node=8", "num_nodes=4"]
    assert Config(config_values(line)).world == 32
    line = "srun --nodes 2 --ntasks-per-node 1 torchrun --nproc_per_node 4 --nnodes 2 pretrain_gpt.py".split()
    assert script_arguments(line) == ["gpus_per_node=4", "num_nodes=2"]
    assert script_arguments("srun --mpi=pmix python pretrain_gpt.py --bf16".split()) == ["--bf16"]


def test_a_torchrun_line_states_gpus_only_where_it_counts_them():
    """No --nproc_per_node (torchrun's default of one process), or a device word (gpu, auto):
    the GPUs are not stated, and --gpus gives them; a line without a script is refused."""
    assert script_arguments(["torchrun", "--nnodes", "4", "pretrain_gpt.py", "--bf16"]) == ["--bf16"]
    assert script_arguments(["torchrun", "--nproc_per_node=gpu", "train.py"]) == []
    with pytest.raises(ConfigError, match="names no training script"):
        script_arguments(["torchrun", "--nproc_per_node", "8"])
    with pytest.raises(ConfigError, match="--nnodes many"):
        script_arguments(["torchrun", "--nproc_per_node", "8", "--nnodes", "many", "pretrain_gpt.py"])


def test_a_python_script_line_is_its_scripts_arguments(capsys):
    """``python pretrain_gpt.py --flags`` and Megatron-Bridge's ``python scripts/performance/
    setup_experiment.py`` with its short flags: the interpreter and the script are not a config
    file; the script's -m (Bridge's model family) is its own, not Python's."""
    assert config_values("python3 /opt/Megatron-LM/pretrain_gpt.py --expert-model-parallel-size 8".split()) \
        == {"expert_model_parallel_size": 8}
    bridge = ("python scripts/performance/setup_experiment.py -m qwen3 -mr qwen3_30b_a3b -g gb200 -c bf16 -ng 8 -ep 8 "
              "-mb 4 -gb 512").split()
    assert main(["estimate", *bridge]) == 0
    assert "qwen3-30b-a3b on 8 x gb200-nvl72" in capsys.readouterr().out


def test_the_environment_the_run_reads_is_passed_on(tmp_path):
    """HybridEP's NVLink domain set before a launch is the run's (validate reads it as a field);
    the launch's other variables are the shell's."""
    line = "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN=32 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    zoo = config_values(f"{line} MODEL=Qwen3-30B-A3B bash {tmp_path / 'sbatch_benchmarking.sh'}".split())
    run = config_values(f"{line} torchrun --nproc_per_node 4 pretrain_gpt.py --bf16".split())
    for values in (zoo, run):
        assert values["num_of_hybrid_ep_ranks_per_nvlink_domain"] == 32
        assert "pytorch_cuda_alloc_conf" not in values


def test_a_model_file_without_its_launch_names_the_variables_to_fill(tmp_path, capsys):
    """The ModelZoo's model file given alone holds ${TP} and the like, which its launch script
    fills: each is reported as a variable the launch fills, with the launch line as the fix."""
    path = tmp_path / "Qwen3-235B-A22B.yaml"
    path.write_text(QWEN3_235B_FILE)
    assert main(["validate", str(path)]) == 1
    out = capsys.readouterr().out
    assert "tensor_model_parallel_size is ${TP}, a shell variable its launch script fills" in out
    assert "bash sbatch_benchmarking.sh" in out
