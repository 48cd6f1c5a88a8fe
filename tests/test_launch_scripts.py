"""A launch script is read as the training command it starts: bash runs it restricted, with no
program it could start, and every command it would start is recorded in place of being run
(plan/launch_script.py). Its variables, arrays, conditions and `bash -c` strings come out as
bash makes them; its GPUs as torchrun, srun or the job's #SBATCH lines give them."""
import os

import pytest

from expertrail.errors import ConfigError
from expertrail.plan import launch_script
from expertrail.plan.validate import config_values
from expertrail.tools.cli import main

# Laid out as Megatron-LM's examples/mixtral/train_mixtral_8x7b_distributed.sh lays out its run:
# node count from Slurm with a default, arrays of arguments, paths as the script's arguments.
MIXTRAL = """#!/bin/bash
export CUDA_DEVICE_MAX_CONNECTIONS=1
GPUS_PER_NODE=8
NNODES=${SLURM_NNODES:-"1"}
WORLD_SIZE=$(($GPUS_PER_NODE*$NNODES))
TOKENIZER_MODEL=$1
DISTRIBUTED_ARGS=(--nproc_per_node $GPUS_PER_NODE --nnodes $NNODES --master_addr ${MASTER_ADDR:-localhost})
MODEL_ARGS=(
    --use-mcore-models --seq-length 4096 --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336
    --num-attention-heads 32 --group-query-attention --num-query-groups 8 --swiglu
    --untie-embeddings-and-output-weights --normalization RMSNorm --position-embedding-type rope
)
MOE_ARGS=(
    --num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-grouped-gemm
    --moe-token-dispatcher-type alltoall
)
TRAINING_ARGS=(--micro-batch-size 1 --global-batch-size 256 --bf16 --tokenizer-model ${TOKENIZER_MODEL})
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 4
    --expert-model-parallel-size 8
    --use-distributed-optimizer
    --sequence-parallel
)
if [ -n "${WANDB_API_KEY}" ]; then
    TRAINING_ARGS+=(--wandb-project mixtral)
fi
torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py ${MODEL_ARGS[@]} ${MOE_ARGS[@]} ${TRAINING_ARGS[@]} \\
    ${MODEL_PARALLEL_ARGS[@]} 2>&1 | tee train.log
"""

# A batch script that submits its run as a here-document, in which srun starts a shell on a
# string (as Megatron-LM's examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh does).
SBATCH = """#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
set -euo pipefail
ARGS=(--num-layers 4 --hidden-size 1024 --num-attention-heads 8 --num-experts 16 --moe-router-topk 2
      --moe-ffn-hidden-size 512 --seq-length 2048 --micro-batch-size 1 --global-batch-size 64 --bf16
      --expert-model-parallel-size ${EP:-8})
if [[ ${SLURM_NNODES} -gt 1 ]]; then ARGS+=(--moe-token-dispatcher-type alltoall); fi
CMD="cd /megatron; git rev-parse HEAD; python /megatron/pretrain_gpt.py ${ARGS[*]}"
mkdir -p logs
sbatch <<EOF
#!/bin/bash
srun -l --container-image=image bash -x -c "${CMD}" 2>&1 | tee logs/out.log
EOF
"""


def _script(tmp_path, text, name="train.sh"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_megatron_lm_script_reads_as_the_torchrun_line_it_starts(tmp_path):
    script = _script(tmp_path, MIXTRAL)
    values = config_values(["SLURM_NNODES=4", "bash", script, "mistralai/Mixtral-8x7B-v0.1"])
    assert (values["pipeline_model_parallel_size"], values["expert_model_parallel_size"]) == (4, 8)
    assert (values["gpus_per_node"], values["num_nodes"]) == (8, 4)
    assert values["moe_router_load_balancing_type"] == "aux_loss"
    assert values["tokenizer_model"] == "mistralai/Mixtral-8x7B-v0.1"
    assert "wandb_project" not in values                    # its condition is false: no WANDB_API_KEY given
    # The same as the torchrun line pasted, which is what bash runs.
    commands, _ = launch_script.recorded_commands(tmp_path / "train.sh", ["tok"], {"SLURM_NNODES": "4"})
    torchrun = next(c for c in commands if c[0] == "torchrun")
    read = config_values(["SLURM_NNODES=4", script, "tok"])
    assert config_values(torchrun) == {k: v for k, v in read.items() if k != "launch_script"}
    arguments = len(torchrun) - torchrun.index("pretrain_gpt.py") - 1
    assert read["launch_script"].endswith(f"pretrain_gpt.py with {arguments} arguments")
    assert sorted(c[0] for c in commands) == ["tee", "torchrun"]        # one pipeline: either first


def test_estimate_reads_a_launch_script(tmp_path, capsys):
    script = _script(tmp_path, MIXTRAL)
    assert main(["estimate", "--hardware", "h100", "SLURM_NNODES=4", script, "tok"]) == 0
    out = capsys.readouterr().out
    assert "on 32 x h100: TP 1 PP 4" in out and "EP 8" in out and "dispatcher alltoall" in out
    launch = "torchrun --nproc_per_node 8 --nnodes 4 --master_addr localhost pretrain_gpt.py"
    assert out.startswith(f"read: {script} starts {launch} with 44 arguments\n")
    assert main(["validate", "--json", "SLURM_NNODES=4", script, "tok"]) == 0
    assert f'"launch_script": "{script} starts {launch} with 44 arguments"' in capsys.readouterr().out


def test_sbatch_here_document_srun_and_bash_c_give_the_run_and_its_job(tmp_path):
    values = config_values(["EP=16", _script(tmp_path, SBATCH)])
    assert values["expert_model_parallel_size"] == 16            # the variable given before the script
    assert values["moe_token_dispatcher_type"] == "alltoall"     # SLURM_NNODES=2 from its #SBATCH lines
    assert (values["gpus_per_node"], values["num_nodes"]) == (8, 2)
    # sbatch's own options win over the script's directives, as sbatch reads them.
    assert config_values(["sbatch", "-N", "4", _script(tmp_path, SBATCH)])["num_nodes"] == 4


def test_sbatch_wrap_and_srun_options(tmp_path):
    wrap = 'sbatch -N 4 --ntasks-per-node=4 --wrap "srun python pretrain_gpt.py --num-experts 16"\n'
    values = config_values([_script(tmp_path, wrap)])
    assert (values["num_moe_experts"], values["gpus_per_node"], values["num_nodes"]) == (16, 4, 4)
    values = config_values([_script(tmp_path, "srun --nodes 2 --ntasks-per-node 8 python pretrain_gpt.py --bf16\n")])
    assert (values["gpus_per_node"], values["num_nodes"]) == (8, 2)
    # Python started alone is one process: the GPUs are left to --gpus.
    assert "num_nodes" not in config_values([_script(tmp_path, "python pretrain_gpt.py --bf16\n")])


def test_reading_a_script_starts_nothing_and_writes_nothing(tmp_path):
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "data").write_text("kept")
    script = _script(tmp_path, f"""#!/bin/bash
set -e
cd {keep}
echo written > {tmp_path}/written.txt || true
/bin/touch {tmp_path}/touched.txt || true
rm -rf {keep}
torchrun --nproc_per_node 8 pretrain_gpt.py --num-experts 8 > {tmp_path}/log.txt 2>&1 || true
python pretrain_gpt.py --num-experts 8
""")
    commands, said = launch_script.recorded_commands(tmp_path / "train.sh", [], {})
    assert [c[0] for c in commands] == ["rm", "python"]          # recorded, not run
    assert "restricted" in said
    assert (keep / "data").read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep", "train.sh"]
    assert config_values([script])["num_moe_experts"] == 8


def test_a_script_may_use_env_and_shell_but_never_widen_path(tmp_path):
    """Restricted bash locks ENV, SHELL and HISTFILE, and Pai-Megatron-Patch's scripts all start
    ``ENV=$1`` (dsw or dlc): those names are the script's to set. PATH is not: a script that
    widens it still starts nothing."""
    text = """#!/bin/bash
set -e
ENV=$1
SHELL=/bin/bash
if [ $ENV = dlc ]; then NNODES=${WORLD_SIZE}; fi
ls /
torchrun --nproc_per_node 8 --nnodes $NNODES pretrain_qwen.py --num-experts 8 --tensor-model-parallel-size 2
"""
    script = _script(tmp_path, text)
    commands, _ = launch_script.recorded_commands(tmp_path / "train.sh", ["dlc"], {"WORLD_SIZE": "2"})
    assert [c[0] for c in commands] == ["ls", "torchrun"]                              # recorded, not run
    values = config_values(["WORLD_SIZE=2", "bash", script, "dlc"])
    assert (values["num_nodes"], values["gpus_per_node"], values["tensor_model_parallel_size"]) == (2, 8, 2)
    script = _script(tmp_path, text.replace("ls /", "PATH=/usr/bin:/bin:$PATH\nls /"))
    assert launch_script.recorded_commands(tmp_path / "train.sh", ["dlc"], {"WORLD_SIZE": "2"})[0] == []
    with pytest.raises(ConfigError, match="sets PATH, which stays fixed while expertrail reads a script"):
        config_values(["WORLD_SIZE=2", "bash", script, "dlc"])


def test_a_script_named_without_suffix_by_its_shebang(tmp_path):
    path = tmp_path / "launch"
    path.write_text("#!/usr/bin/env bash\ntorchrun --nproc_per_node 4 pretrain_gpt.py --num-experts 4\n")
    assert launch_script.script_at([str(path)]) == 0
    assert config_values([str(path)])["gpus_per_node"] == 4
    # Only where a script stands: not as a flag's value, nor a config file.
    assert launch_script.script_at(["--tokenizer-model", str(path)]) is None
    assert launch_script.script_at(["config.yaml"]) is None


def test_modelzoo_scripts_are_left_to_their_own_reader():
    assert launch_script.script_at(["MODEL=Qwen3-235B-A22B", "bash", "sbatch_benchmarking.sh"]) is None
    assert launch_script.script_at(["MODEL=Qwen3-235B-A22B", "bash", "run_gb200.sh"]) == 2


@pytest.mark.parametrize("text, message", [
    ("mkdir -p logs\nsbatch job.sh\n", "starts no Python training command (torchrun, python ... .py): it runs mkdir, sbatch"),
    ("/usr/bin/python pretrain_gpt.py --bf16\n", "cannot specify `/' in command names"),
    ("for ep in 8 16; do torchrun --nproc_per_node 8 pretrain_gpt.py --expert-model-parallel-size $ep; done\n",
     "starts 2 training commands (1: ... --expert-model-parallel-size 8 ...; 2: ... --expert-model-parallel-size 16 "
     "...): give launch=N after the script"),
    ("torchrun --nproc_per_node 8 pretrain_gpt.py --tokenizer-model $1 --bf16\n",
     "--tokenizer-model needs a value"),
    ("set -u\ntorchrun --nproc_per_node 8 pretrain_gpt.py --data-path $DATA --bf16\n",
     "stopped at DATA, a variable it reads unset (set -u): set it before the script"),
])
def test_a_script_that_starts_no_single_run_is_refused_by_what_it_does(tmp_path, text, message):
    script = _script(tmp_path, text)
    with pytest.raises(ConfigError) as error:
        config_values([script])
    assert message in str(error.value) and "train.sh" in str(error.value)


def test_launch_picks_one_of_the_runs_a_script_starts(tmp_path):
    """launch=N (an expertrail field after the script) reads the N-th of the training commands a
    script starts, and is refused by name outside 1..N."""
    script = _script(tmp_path, "for ep in 8 16; do torchrun --nproc_per_node 8 pretrain_gpt.py --num-experts 64 "
                               "--expert-model-parallel-size $ep; done\n")
    assert [config_values([script, f"launch={n}"])["expert_model_parallel_size"] for n in (1, 2)] == [8, 16]
    with pytest.raises(ConfigError, match="launch=0: .* give launch=N with N from 1 to 2"):
        config_values([script, "launch=0"])


def test_a_missing_script_and_one_that_never_ends(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="launch script 'nowhere.sh' not found"):
        config_values(["nowhere.sh"])
    monkeypatch.setattr(launch_script, "TIMEOUT_S", 0.5)
    script = _script(tmp_path, "while true; do sleep 1; done &\nwhile true; do :; done\n")
    with pytest.raises(ConfigError, match=r"still ran after 0.5 s"):
        config_values([script])
    assert not [line for line in os.popen("ps -eo args").read().splitlines() if script in line]   # none left running


def test_long_words_and_pipelines_come_back_whole(tmp_path):
    long = "x" * 4999 + "é" * 1500                # pieces of 1,000 bytes split its characters
    text = "".join(f"echo {i} | python pretrain_gpt.py --tokenizer-model {long}{i} --bf16 | tee {i}.log &\n"
                   for i in range(8)) + "wait\n"
    _script(tmp_path, text)
    commands, _ = launch_script.recorded_commands(tmp_path / "train.sh", [], {})
    runs = sorted(c for c in commands if c[0] == "python")
    assert runs == [["python", "pretrain_gpt.py", "--tokenizer-model", f"{long}{i}", "--bf16"] for i in range(8)]
    assert sorted(c for c in commands if c[0] == "tee") == [["tee", f"{i}.log"] for i in range(8)]


def test_the_script_takes_every_word_after_it_and_runs_where_bash_would(tmp_path, monkeypatch):
    """As Megatron-LM's examples/gptoss/02_train.sh: its own options after it, a check that the
    training script is in the directory it is started from."""
    script = _script(tmp_path, """#!/bin/bash
while [[ $# -gt 0 ]]; do
    case $1 in
        --experts) EXPERTS=$2; shift 2 ;;
        *) echo "Unknown option: $1"; exit 1 ;;
    esac
done
if [ ! -f pretrain_gpt.py ]; then echo "Error: run from Megatron-LM's root"; exit 1; fi
torchrun --nproc_per_node 8 pretrain_gpt.py --num-experts ${EXPERTS:-8} "$@"
""")
    with pytest.raises(ConfigError, match="it printed last: Error: run from Megatron-LM's root"):
        config_values(["bash", script, "--experts", "64"])
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pretrain_gpt.py").write_text("")
    values = config_values(["bash", script, "--experts", "64", "hardware=h100"])
    assert (values["num_moe_experts"], values["hardware"]) == (64, "h100")    # key=value stays a field


def test_a_script_finds_and_sources_its_own_files(tmp_path, monkeypatch):
    """`SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd); source "$SCRIPT_DIR/..."`, which
    restricted bash would refuse (cd, source of a path) or could not run (dirname): done on the
    path's text, from wherever the script is started."""
    (tmp_path / "scripts" / "conf").mkdir(parents=True)
    (tmp_path / "scripts" / "conf" / "model.sh").write_text(
        "MODEL_ARGS=(--num-layers 4 --num-experts 16 --moe-router-topk 2)\n")
    script = tmp_path / "scripts" / "train.sh"
    script.write_text("""#!/bin/bash
set -euo pipefail
SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "${SCRIPT_DIR}/conf/model.sh"
. $SCRIPT_DIR/../scripts/conf/model.sh
ROOT=$(realpath "$SCRIPT_DIR/..")
torchrun --nproc_per_node 8 pretrain_gpt.py "${MODEL_ARGS[@]}" --wandb-exp-name $(basename "$0" .sh) --save "$ROOT/ckpt"
""")
    monkeypatch.chdir(tmp_path.parent)
    for path in (script, script.relative_to(tmp_path.parent)):
        commands, printed = launch_script.recorded_commands(path, [], {})
        assert printed == ""
        assert commands == [["torchrun", "--nproc_per_node", "8", "pretrain_gpt.py", "--num-layers", "4",
                             "--num-experts", "16", "--moe-router-topk", "2", "--wandb-exp-name", "train",
                             "--save", f"{tmp_path}/ckpt"]]


def test_an_old_or_missing_bash_is_named(tmp_path, monkeypatch):
    """macOS's /bin/bash is 3.2, which has no command_not_found_handle: refused by name, not read
    as a script that starts nothing."""
    script = _script(tmp_path, "torchrun --nproc_per_node 8 pretrain_gpt.py --num-experts 8\n")
    monkeypatch.setattr(launch_script, "_bash_version", lambda bash: 3)
    with pytest.raises(ConfigError, match=r"needs bash 4 or newer, and .* is 3.x"):
        config_values([script])
    monkeypatch.setattr(launch_script.shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match="needs bash, which is not on PATH"):
        config_values([script])
