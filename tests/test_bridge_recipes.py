"""Megatron-Bridge's performance recipes as data: tools/bridge_recipes.py reads a checkout's recipe
functions without Bridge installed, and a perf-script line (-mr ... -g ... -ng ... -c ...) is read
as the recipe Bridge would run (plan/bridge_recipes.py)."""
import re
import textwrap

import pytest

from expertrail.errors import ConfigError
from expertrail.plan import bridge_recipes
from expertrail.plan.layout import layout_text
from expertrail.plan.validate import config_values
from expertrail.tools import bridge_recipes as tool
from expertrail.tools.cli import main


# A checkout laid out as Bridge's: a model recipe reached through an alias module, perf recipes
# that start from it, helpers of each kind the recipes use.
FILES = {
    "recipes/common.py": """
        def _pretrain_common():
            cfg = ConfigContainer(train=TrainingConfig(global_batch_size=32, micro_batch_size=2),
                                  ddp=DistributedDataParallelConfig(overlap_grad_reduce=True,
                                                                    use_distributed_optimizer=True))
            return cfg
    """,
    "recipes/qwen/qwen3_moe.py": """
        from megatron.bridge.recipes.qwen.h100.qwen3_moe import (
            qwen3_235b_a22b_pretrain_256gpu_h100_bf16_config as qwen3_235b_a22b_pretrain_config,
        )
    """,
    "recipes/qwen/h100/qwen3_moe.py": """
        import torch
        from megatron.bridge.recipes.common import _pretrain_common
        from megatron.bridge.training.flex_dispatcher_backend import apply_flex_dispatcher_backend

        def _layout(pp, vp):
            return [["embedding"] + ["decoder"] * 2] + [["decoder"] * 2] * (pp * vp - 2) + [["decoder", "loss"]]

        def qwen3_235b_a22b_pretrain_256gpu_h100_bf16_config():
            cfg = _pretrain_common()
            opt_cfg, scheduler_cfg = distributed_muon_with_cosine_annealing(max_lr=1e-4)
            cfg.optimizer = opt_cfg
            cfg.model.moe_token_dispatcher_type = "alltoall"
            cfg.model.moe_flex_dispatcher_backend = "deepep"
            cfg.optimizer.main_grads_dtype = torch.float32
            apply_flex_dispatcher_backend(cfg.model, cfg.model.moe_flex_dispatcher_backend)
            return cfg
    """,
    "perf_recipes/_common.py": """
        def _perf_precision(compute_dtype):
            return bf16_mixed()

        def _benchmark_common(cfg):
            cfg.train.train_iters = 50
            if getattr(cfg.model, "moe_flex_dispatcher_backend", None) == "hybridep":
                cfg.model.moe_hybridep_num_sms = 32
    """,
    "perf_recipes/qwen/common.py": """
        from megatron.bridge.perf_recipes._common import _benchmark_common, _perf_precision
        from megatron.bridge.recipes.qwen.qwen3_moe import qwen3_235b_a22b_pretrain_config

        def _with_global_batch_size(cfg, global_batch_size):
            cfg.train.global_batch_size = global_batch_size
            return cfg

        def _set_layout(model_cfg):
            pp = model_cfg.pipeline_model_parallel_size or 1
            vp = model_cfg.virtual_pipeline_model_parallel_size or 1
            try:
                model_cfg.pipeline_model_parallel_layout = _layout_of(pp, vp)
            except ValueError:
                pass

        def _layout_of(pp, vp):
            return [["embedding"] + ["decoder"] * 4] + [["decoder"] * 4] * (pp * vp - 2) + [["decoder", "loss"]]
    """,
    "perf_recipes/qwen/gb200/qwen3_moe.py": """
        from megatron.bridge.perf_recipes.qwen.common import (
            CommOverlapConfig, _benchmark_common, _perf_precision, _set_layout, _with_global_batch_size,
            qwen3_235b_a22b_pretrain_config,
        )

        def qwen3_235b_a22b_pretrain_256gpu_gb200_fp8mx_config():
            cfg = qwen3_235b_a22b_pretrain_config()
            cfg.mixed_precision = _perf_precision("fp8_mx")
            cfg.model.pipeline_model_parallel_size = 4
            cfg.model.virtual_pipeline_model_parallel_size = 2
            cfg.model.expert_model_parallel_size = 64
            cfg.model.moe_flex_dispatcher_backend = "hybridep"
            cfg.comm_overlap = CommOverlapConfig(overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True)
            _set_layout(cfg.model)
            _benchmark_common(cfg)
            return cfg

        def qwen3_235b_a22b_pretrain_512gpu_gb200_fp8mx_config():
            cfg = _with_global_batch_size(qwen3_235b_a22b_pretrain_256gpu_gb200_fp8mx_config(), 8192)
            return cfg
    """,
}


@pytest.fixture
def checkout(tmp_path):
    for name, text in FILES.items():
        path = tmp_path / "src" / "megatron" / "bridge" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path


def test_the_tool_reads_recipes_as_bridge_builds_them(checkout):
    """Fields set directly, by the model recipe an alias names, by helpers given the config or a
    section, by a layout builder run on the fields so far, by a helper wrapping another recipe;
    the precision, the overlap keywords, the optimizer a builder configures, and the dispatcher
    apply_flex_dispatcher_backend sets; a branch on a field taken as the fields say."""
    recipes = tool.read(checkout, commit="abc")["recipes"]
    first = recipes["qwen3_235b_a22b_pretrain_256gpu_gb200_fp8mx_config"]
    assert first["compute_dtype"] == "fp8_mx" and first["optimizer"] == "dist_muon"
    assert first["moe_token_dispatcher_type"] == "flex" and first["moe_flex_dispatcher_backend"] == "hybridep"
    assert first["overlap_moe_expert_parallel_comm"] and first["delay_wgrad_compute"]
    assert first["use_distributed_optimizer"] and first["global_batch_size"] == 32 and first["train_iters"] == 50
    assert first["pipeline_model_parallel_layout"] == layout_text([["embedding"] + ["decoder"] * 4]
                                                                  + [["decoder"] * 4] * 6 + [["decoder", "loss"]])
    assert first["moe_hybridep_num_sms"] == 32 and first["main_grads_dtype"] == "fp32"
    second = recipes["qwen3_235b_a22b_pretrain_512gpu_gb200_fp8mx_config"]
    assert second == {**first, "global_batch_size": 8192}


def test_a_perf_script_line_is_the_recipe_it_picks():
    """-ng picks the recipe of that GPU count, none the largest (Qwen3-30B's smaller defaults as
    Bridge's), and the line's own flags win; the recipe read is said in bridge_recipe."""
    v = config_values("-m qwen3 -mr qwen3_235b_a22b -g gb200 -ng 256 -c fp8_mx -ep 16".split())
    assert v["bridge_recipe"] == "qwen3_235b_a22b_pretrain_256gpu_gb200_fp8mx_config"
    assert (v["pipeline_model_parallel_size"], v["expert_model_parallel_size"]) == (8, 16)
    assert v["moe_flex_dispatcher_backend"] == "hybridep" and v["fp8_recipe"] == "mxfp8"
    largest = max(bridge_recipes.matching("deepseek_v3", "b200", "fp8_mx"))
    assert config_values("-mr deepseek_v3 -g b200 -c fp8_mx".split())["world_size"] == largest
    assert config_values("-mr qwen3_30b_a3b -g h100".split())["bridge_recipe"].startswith("qwen3_30b_a3b_pretrain_16gpu")
    odd = config_values("-mr deepseek_v3 -g gb200 -ng 128 -c fp8_mx".split())
    assert "(no 128-GPU recipe: its settings on 128 GPUs)" in odd["bridge_recipe"] and odd["world_size"] == 128
    assert "bridge_recipe" not in config_values("-mr qwen3_235b_a22b -g a100 -c bf16".split())
    variant = config_values("-mr deepseek_v3 -g gb300 -c fp8_mx -cv large_scale".split())
    assert variant["bridge_recipe"] == "deepseek_v3_pretrain_256gpu_gb300_fp8mx_large_scale_config"
    with pytest.raises(ConfigError, match="-cv bogus: no deepseek_v3 recipe on gb300 in fp8_mx has that variant: "
                                          "choose among fsdp, hsdp, large_scale, partial_cg_dev"):
        config_values("-mr deepseek_v3 -g gb300 -c fp8_mx -cv bogus".split())


def test_estimate_says_the_recipe_it_read_or_that_none_was(capsys):
    assert main(["estimate", "-mr", "qwen3_235b_a22b", "-g", "gb200", "-ng", "256", "-c", "fp8_mx"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("read: qwen3_235b_a22b_pretrain_256gpu_gb200_fp8mx_config\n")
    assert "TP 1 PP 8 VPP 3" in out and "EP 32" in out and "flex + hybridep" in out
    assert main(["estimate", "--hardware", "gb200-nvl72", "-mr", "qwen3_235b_a22b", "-c", "fp8_mx"]) == 0  # no -g
    assert capsys.readouterr().out.startswith("read: qwen3_235b_a22b_pretrain_256gpu_gb200_fp8mx_config\n")
    assert main(["estimate", "-mr", "qwen3_235b_a22b", "-g", "h100", "-ng", "256", "-c", "nvfp4", "-tp", "2",
                 "-pp", "8", "-ep", "16"]) == 0
    assert "names no Megatron-Bridge performance recipe of this system and precision" in capsys.readouterr().out


def test_a_run_recipe_line_reads_the_recipe_it_names(tmp_path, capsys):
    """Megatron-Bridge's scripts/training/run_recipe.py (its examples' launcher) names a recipe
    function: a performance recipe is read whole, as -mr -g -ng -c pick it, with the line's own
    overrides over it; a library recipe, or --model's stem, gives the model (its settings unread,
    said so); its -etp / -ms spellings and --dataset mock are read."""
    name = "qwen3_30b_a3b_pretrain_16gpu_h100_bf16_config"
    named = config_values(f"python run_recipe.py --recipe {name} --mode pretrain -ep 8".split())
    picked = config_values("-mr qwen3_30b_a3b -g h100 -ng 16 -c bf16 -ep 8".split())
    assert (named["bridge_recipe"], named["world_size"], named["hardware"]) == (name, 16, "h100")
    assert {k: v for k, v in named.items() if k in picked and k not in ("hardware",)} == \
        {k: v for k, v in picked.items() if k in named and k not in ("hardware",)}
    assert config_values(f"torchrun --nproc-per-node 8 run_recipe.py --recipe {name}".split()).get("world_size") is None
    library = config_values("python run_recipe.py --recipe gpt_oss_20b_pretrain_config --dataset mock -etp 1 "
                            "-ms 10".split())
    assert "bridge_recipe" not in library and library["mock"] is True
    assert (library["expert_tensor_parallel_size"], library["train_iters"]) == (1, 10)
    assert main(["estimate", "--hardware", "h100", "--gpus", "8", "python", "run_recipe.py", "--recipe",
                 "gpt_oss_20b_pretrain_config", "-ep", "8", "-etp", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("estimate: gpt-oss-20b on 8 x h100") and "--recipe gpt_oss_20b_pretrain_config is a" in out
    assert main(["estimate", "--hardware", "h100", "--gpus", "8", "--model", "gpt_oss_20b", "-ep", "8"]) == 0
    assert capsys.readouterr().out.startswith("estimate: gpt-oss-20b on 8 x h100")
    with pytest.raises(ConfigError, match="--recipe llama3_8b_pretrain_config: not a Megatron-Bridge recipe of a "
                                          "catalog model"):
        from expertrail.plan.architecture import recipe_model
        recipe_model({"recipe": "llama3_8b_pretrain_config"})


def test_every_recipe_estimates_or_is_refused_by_name(capsys):
    """Each recipe the data holds, given as a perf-script line, estimates without a validate
    violation and fits, or is refused naming why: a recipe whose layout does not divide its own
    GPU count (Bridge's 64-GPU Qwen3-235B and DeepSeek-V3 recipes keep their 256-GPU EP), or a
    model outside the catalog."""
    name = re.compile(r"^(.*)_pretrain_(\d+)gpu_([a-z0-9]+)_([a-z0-9]+?)(?:_(.+))?_config$")
    dtypes = {p: d for d, p in bridge_recipes.PRECISION_NAMES.items()}
    refused = set()
    for recipe in bridge_recipes.recipes():
        model, gpus, gpu, precision, variant = name.match(recipe).groups()
        line = ["-mr", model, "-g", gpu, "-ng", gpus, "-c", dtypes[precision]] + (["-cv", variant] if variant else [])
        code = main(["estimate", *line])
        out, err = capsys.readouterr()
        if code:
            assert "does not divide" in err or "a Megatron-Bridge recipe of no catalog model" in err, (recipe, err)
            refused.add(recipe)
        else:
            assert f"read: {recipe}" in out and "DOES NOT FIT" not in out and "validate:" not in err, (recipe, err)
    assert len(refused) < len(bridge_recipes.recipes()) / 10


def test_the_data_file_is_as_the_tool_writes_it(checkout):
    """The committed recipes are in the tool's own layout (one recipe a line), and that layout is
    the JSON it stands for."""
    import json
    text = bridge_recipes.RECIPES_FILE.read_text()
    assert text == tool.recipes_text(json.loads(text))
    data = tool.read(checkout, commit="abc")
    assert json.loads(tool.recipes_text(data)) == data
