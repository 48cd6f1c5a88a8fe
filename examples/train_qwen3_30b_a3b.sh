#!/bin/bash
# Pre-trains Qwen3-30B-A3B with Megatron-LM on Slurm nodes of 8 GPUs, laid out as Megatron-LM's
# example scripts lay out a run. `expertrail validate` and `expertrail estimate` read it as the
# torchrun line it starts (docs/planner.md, section 5):
#
#   expertrail estimate --hardware h100 SLURM_NNODES=2 bash examples/train_qwen3_30b_a3b.sh Qwen/Qwen3-30B-A3B
#
# Usage on the cluster: SLURM_NNODES=2 bash train_qwen3_30b_a3b.sh TOKENIZER [DATA_PATH]

GPUS_PER_NODE=8
NNODES=${SLURM_NNODES:-1}
TOKENIZER=${1:?give the tokenizer, e.g. Qwen/Qwen3-30B-A3B}
DATA_PATH=$2
EP=${EP:-$((GPUS_PER_NODE * NNODES))}      # every GPU holds its own experts

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NNODES
    --node_rank ${SLURM_NODEID:-0}
    --master_addr ${MASTER_ADDR:-localhost}
    --master_port ${MASTER_PORT:-6000}
)

MODEL_ARGS=(
    --num-layers 48
    --hidden-size 2048
    --ffn-hidden-size 6144
    --num-attention-heads 32
    --group-query-attention
    --num-query-groups 4
    --kv-channels 128
    --qk-layernorm
    --normalization RMSNorm
    --swiglu
    --position-embedding-type rope
    --rotary-base 1000000
    --untie-embeddings-and-output-weights
    --disable-bias-linear
    --seq-length 4096
    --max-position-embeddings 40960
)

MOE_ARGS=(
    --num-experts 128
    --moe-ffn-hidden-size 768
    --moe-router-topk 8
    --moe-router-load-balancing-type global_aux_loss
    --moe-aux-loss-coeff 1e-3
    --moe-grouped-gemm
    --moe-permute-fusion
    --moe-token-dispatcher-type alltoall
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 512
    --bf16
    --lr 3e-4
    --min-lr 3e-5
    --lr-decay-style cosine
    --train-iters 10000
    --tokenizer-type HuggingFaceTokenizer
    --tokenizer-model $TOKENIZER
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
)

PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 1
    --expert-model-parallel-size $EP
)

if [ -n "$DATA_PATH" ]; then
    TRAINING_ARGS+=(--data-path $DATA_PATH)
else
    TRAINING_ARGS+=(--mock-data)
fi

# Across nodes, DeepEP's kernels move the tokens (its flex dispatcher); inside one, NCCL's all-to-all.
if [ "$NNODES" -gt 1 ]; then
    MOE_ARGS+=(--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend deepep)
fi

torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py \
    ${MODEL_ARGS[@]} ${MOE_ARGS[@]} ${TRAINING_ARGS[@]} ${PARALLEL_ARGS[@]} 2>&1 | tee train_${SLURM_JOB_ID:-local}.log
