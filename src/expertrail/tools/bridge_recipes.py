"""Megatron-Bridge's performance recipes as data: `python -m expertrail.tools.bridge_recipes
--write CHECKOUT [--commit SHA]` reads the flat recipes of the catalog's MoE models
(src/megatron/bridge/perf_recipes/<family>/<gpu>/*.py: one function a model, task, GPU count,
GPU and precision, ``qwen3_235b_a22b_pretrain_256gpu_gb200_fp8mx_config``) and writes the fields
each sets to plan/bridge_perf_recipes.json, which `plan.bridge_recipes` reads when a command line
names a recipe as Bridge's performance scripts do (``-mr qwen3_235b_a22b -g gb200 -ng 256 -c
fp8_mx``).

The recipes are Python that builds a ConfigContainer; Bridge itself (and its torch, Megatron-Core
and Transformer Engine) is not needed to read them: each function's statements are walked in
order, each module's names resolved through its imports, with the fields set so far as the
state. ``cfg.<section>.<field> = value`` sets a field; ``cfg = model_recipe()`` starts from the
fields the model recipe (recipes/<family>/...) sets, ``ConfigContainer(train=TrainingConfig(...))``
from its sections' keywords; ``_perf_precision("fp8_mx")`` is the precision (``compute_dtype``);
``CommOverlapConfig(...)`` its keywords; the optimizer builder a recipe calls its ``optimizer``;
``apply_flex_dispatcher_backend`` its effect on the GPUs the recipes target (the flex dispatcher
with that backend); a helper given the config or a section runs its statements on them; a helper
that only computes (a pipeline layout's builder) is run, with a few builtins, on the values it is
given; an ``if`` whose condition reads only literals and fields set so far runs its branch. What
only Bridge's model providers set (their class defaults) is not read, and the estimate fills it
as it does for any configuration.
"""
from __future__ import annotations

import argparse
import ast
import builtins
import json
import subprocess
import sys
from pathlib import Path

FAMILIES = ("deepseek", "kimi", "qwen", "gpt_oss")
GPUS = ("h100", "b200", "b300", "gb200", "gb300")
SECTIONS = ("model", "train", "ddp", "optimizer", "dataset", "comm_overlap", "mixed_precision")
TORCH_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
FLEX_BACKENDS = ("deepep", "hybridep")
CONFIG_NAMES = ("cfg", "config", "recipe")          # what the recipes call the config they build
# Bridge's optimizer builders (training/optim.py; each returns an optimizer and a scheduler config)
# by the Megatron optimizer each configures.
OPTIMIZER_BUILDERS = {"distributed_fused_adam_with_cosine_annealing": "adam",
                      "distributed_muon_with_cosine_annealing": "dist_muon"}
# What a pure helper (a pipeline layout's builder) may use when run.
SAFE_BUILTINS = {name: getattr(builtins, name) for name in ("range", "len", "int", "bool", "str", "list", "dict",
                                                            "tuple", "min", "max", "sum", "isinstance", "getattr",
                                                            "enumerate", "zip", "ValueError", "TypeError")}
OUT = Path(__file__).resolve().parents[1] / "plan" / "bridge_perf_recipes.json"
_UNKNOWN = object()


def modules(src: Path) -> dict:
    """{dotted module name: parsed module} of the recipe packages the catalog's families use: the
    flat performance recipes and their helpers, and the model recipes they start from
    (``src`` is a checkout's src/)."""
    bridge = src / "megatron" / "bridge"
    paths = [bridge / "perf_recipes" / "_common.py", bridge / "recipes" / "common.py"]
    for package in ("perf_recipes", "recipes"):
        for family in FAMILIES:
            paths += sorted((bridge / package / family).glob("*.py"))
            paths += sorted(p for gpu in GPUS for p in (bridge / package / family / gpu).glob("*.py"))
    return {".".join(p.relative_to(src).with_suffix("").parts): ast.parse(p.read_text())
            for p in paths if p.is_file() and p.name != "__init__.py"}


class Reader:
    """Walks recipe functions' statements (module docstring): each module's names are its own
    functions and what it imports from the others."""

    def __init__(self, parsed: dict):
        self.defs, self.names = {}, {}
        for module, tree in parsed.items():
            names = self.names.setdefault(module, {})
            for node in tree.body:
                if isinstance(node, ast.FunctionDef):
                    self.defs[(module, node.name)] = node
                    names[node.name] = (module, node.name)
                elif isinstance(node, ast.ImportFrom) and node.module:
                    for alias in node.names:
                        names[alias.asname or alias.name] = (node.module, alias.name)
        self.cache, self.compiled = {}, {}

    def resolve(self, module: str, name: str):
        """The (module, name) of a function ``name`` means in ``module``, following imports; None
        for a name defined outside the modules read."""
        seen = set()
        key = self.names.get(module, {}).get(name)
        while key is not None and key not in self.defs and key not in seen:
            seen.add(key)
            key = self.names.get(key[0], {}).get(key[1])
        return key if key in self.defs else None

    def recipes(self) -> list:
        """The flat performance recipes' (module, name)."""
        return [(m, n) for (m, n) in self.defs if ".perf_recipes." in m and m.split(".")[-2] in GPUS
                and n.endswith("_config") and "_pretrain_" in n]

    def builder(self, key) -> dict:
        """The fields a function that builds and returns a config sets."""
        if key not in self.cache:
            fields: dict = {}
            self.cache[key] = fields                    # a recursion reads what is set so far
            self.run(self.defs[key].body, fields, {}, {}, key[0])
        return dict(self.cache[key])

    def run(self, body: list, fields: dict, aliases: dict, bound: dict, module: str) -> None:
        """Run ``body`` (of a function of ``module``) on ``fields``: ``aliases`` maps a name to the
        config it stands for (None: the ConfigContainer, or a section's name), ``bound`` names to
        the values bound to them."""
        for node in body:
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    self.assign(target, node.value, fields, aliases, bound, module)
            elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
                self.call(node.value, fields, aliases, bound, module)
            elif isinstance(node, ast.If):
                test = self.value(node.test, fields, aliases, bound, module)
                if test is not _UNKNOWN:
                    self.run(node.body if test else node.orelse, fields, aliases, bound, module)
            elif isinstance(node, ast.Try):
                self.run(node.body, fields, aliases, bound, module)
            elif isinstance(node, ast.Return):
                return

    def assign(self, target, value, fields: dict, aliases: dict, bound: dict, module: str) -> None:
        if isinstance(target, ast.Tuple) and isinstance(value, ast.Call) \
                and getattr(value.func, "id", None) in OPTIMIZER_BUILDERS and isinstance(target.elts[0], ast.Name):
            bound[target.elts[0].id] = OPTIMIZER_BUILDERS[value.func.id]    # opt_cfg, scheduler_cfg = ...
            return
        if isinstance(target, ast.Name):
            if isinstance(value, ast.Call) and self.starts_config(value, module):
                fields.clear()
                fields.update(self.config_of(value, fields, aliases, bound, module))
                aliases[target.id] = None
            elif isinstance(value, ast.Call) and target.id in CONFIG_NAMES:
                fields.clear()                          # cfg = _pretrain_common(): Bridge's own defaults, unread
                aliases[target.id] = None
            else:                                       # a local: pp_size = model_cfg.pipeline_... or 1
                bound[target.id] = self.value(value, fields, aliases, bound, module)
            return
        where = self.section_field(target, aliases)
        if where is None:
            return
        section, field = where
        if section is None and field == "mixed_precision" and isinstance(value, ast.Call) \
                and getattr(value.func, "id", "") == "_perf_precision" and value.args:
            fields["compute_dtype"] = ast.literal_eval(value.args[0])
        elif section is None and field == "optimizer" and self.optimizer(value, bound):
            fields["optimizer"] = self.optimizer(value, bound)             # cfg.optimizer = opt_cfg
        elif section is None and field in SECTIONS and isinstance(value, ast.Call):
            self.keywords(value, fields, aliases, bound, module)      # cfg.comm_overlap = CommOverlapConfig(...)
        elif section in SECTIONS:
            v = self.value(value, fields, aliases, bound, module)
            if v is not _UNKNOWN:
                fields[field] = v

    @staticmethod
    def optimizer(node, bound: dict) -> str | None:
        """The Megatron optimizer a name holds that an optimizer builder set (`OPTIMIZER_BUILDERS`)."""
        found = bound.get(node.id) if isinstance(node, ast.Name) else None
        return found if found in OPTIMIZER_BUILDERS.values() else None

    def keywords(self, call: ast.Call, fields: dict, aliases: dict, bound: dict, module: str) -> None:
        """A section built by a call (``CommOverlapConfig(tp_comm_overlap=True)``): its keywords."""
        for kw in call.keywords:
            v = self.value(kw.value, fields, aliases, bound, module)
            if kw.arg and v is not _UNKNOWN:
                fields[kw.arg] = v

    def starts_config(self, call: ast.Call, module: str) -> bool:
        """Whether ``call`` makes a whole config: ConfigContainer(...), or a function that returns one."""
        name = getattr(call.func, "id", None)
        if name == "ConfigContainer":
            return True
        key = self.resolve(module, name) if name else None
        if key is None:
            return False
        return self.returns_config(key) or any(isinstance(a, ast.Call) and self.starts_config(a, module)
                                               for a in call.args)    # helper(recipe(), ...)

    def returns_config(self, key) -> bool:
        fn = self.defs[key]
        return any(isinstance(n, ast.Return) and isinstance(n.value, (ast.Name, ast.Call)) for n in ast.walk(fn)) \
            and (key[1].endswith("_config") or any(isinstance(n, ast.Call) and getattr(n.func, "id", "")
                                                   == "ConfigContainer" for n in ast.walk(fn)))

    def config_of(self, call: ast.Call, fields: dict, aliases: dict, bound: dict, module: str) -> dict:
        """The fields of a config ``call`` makes: ConfigContainer's sections' keywords, or a
        function's (`builder`; a helper that changes the config it is given, from that config)."""
        if getattr(call.func, "id", None) == "ConfigContainer":
            out: dict = {}
            for kw in call.keywords:
                if kw.arg in SECTIONS and isinstance(kw.value, ast.Call):
                    self.keywords(kw.value, out, aliases, bound, module)
                elif kw.arg == "optimizer" and self.optimizer(kw.value, bound):
                    out["optimizer"] = self.optimizer(kw.value, bound)
            return out
        key = self.resolve(module, call.func.id)
        fn = self.defs[key]
        if not fn.args.args and not fn.args.kwonlyargs:
            return self.builder(key)
        inner_aliases = self.parameter_aliases(fn, call, aliases)
        out = dict(fields) if inner_aliases else {}
        for param, arg in self.arguments(fn, call):
            if isinstance(arg, ast.Call) and self.starts_config(arg, module):
                out = self.config_of(arg, fields, aliases, bound, module)      # helper(recipe(), ...)
                inner_aliases[param] = None
        self.run(fn.body, out, inner_aliases, self.locals_of(fn, call, inner_aliases, fields, aliases, bound, module),
                 key[0])
        return out

    @staticmethod
    def arguments(fn: ast.FunctionDef, call: ast.Call) -> list:
        params = [a.arg for a in fn.args.args]
        return list(zip(params, call.args)) + [(kw.arg, kw.value) for kw in call.keywords if kw.arg]

    def parameter_aliases(self, fn: ast.FunctionDef, call: ast.Call, aliases: dict) -> dict:
        """{parameter: the config (None) or section it stands for} of a call given the caller's
        config (``cfg``) or one of its sections (``cfg.model``)."""
        out = {}
        for param, arg in self.arguments(fn, call):
            if isinstance(arg, ast.Name) and arg.id in aliases:
                out[param] = aliases[arg.id]
            else:
                where = self.section_field(arg, aliases)
                if where is not None and where[0] is None and where[1] in SECTIONS:
                    out[param] = where[1]
        return out

    def locals_of(self, fn: ast.FunctionDef, call: ast.Call, inner_aliases: dict, fields: dict, aliases: dict,
                  bound: dict, module: str) -> dict:
        """A call's other parameters: defaults, then the arguments that evaluate."""
        out = {}
        for param, default in zip(fn.args.args[len(fn.args.args) - len(fn.args.defaults):], fn.args.defaults):
            out[param.arg] = self.value(default, fields, aliases, bound, module)
        for param, default in zip(fn.args.kwonlyargs, fn.args.kw_defaults):
            if default is not None:
                out[param.arg] = self.value(default, fields, aliases, bound, module)
        for param, arg in self.arguments(fn, call):
            out[param] = self.value(arg, fields, aliases, bound, module)
        return {k: v for k, v in out.items() if k not in inner_aliases}

    def call(self, node: ast.Call, fields: dict, aliases: dict, bound: dict, module: str) -> None:
        """A helper's statements on ``fields`` (its config and section parameters bound to the
        caller's); Bridge's apply_flex_dispatcher_backend as its effect on the GPUs it names."""
        name = getattr(node.func, "id", None)
        if name == "apply_flex_dispatcher_backend" and len(node.args) >= 2:
            backend = self.value(node.args[1], fields, aliases, bound, module)
            if backend in FLEX_BACKENDS:
                fields.update(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend=backend,
                              moe_shared_expert_overlap=False)
            return
        key = self.resolve(module, name) if name else None
        if key is None:
            return
        fn = self.defs[key]
        inner_aliases = self.parameter_aliases(fn, node, aliases)
        self.run(fn.body, fields, inner_aliases, self.locals_of(fn, node, inner_aliases, fields, aliases, bound, module),
                 key[0])

    def section_field(self, node, aliases: dict):
        """(section, field) of ``cfg.section.field`` or ``model_cfg.field`` (a section's alias);
        (None, name) of ``cfg.name``; None for anything else."""
        if not isinstance(node, ast.Attribute):
            return None
        base = node.value
        if isinstance(base, ast.Name) and base.id in aliases:
            return (aliases[base.id], node.attr) if aliases[base.id] else (None, node.attr)
        if isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name) \
                and base.value.id in aliases and aliases[base.value.id] is None:
            return base.attr, node.attr
        return None

    def pure(self, key, args: list):
        """Run a helper that only computes (a pipeline layout's builder) on ``args``."""
        if key not in self.compiled:
            namespace = {"__builtins__": SAFE_BUILTINS}
            for local, target in self.names.get(key[0], {}).items():
                if target in self.defs and target != key and not self.returns_config(target):
                    namespace[local] = lambda *a, _t=target: self.pure(_t, list(a))
            code = compile(ast.Module(body=[self.defs[key]], type_ignores=[]), f"<{key[0]}>", "exec")
            exec(code, namespace)                       # noqa: S102 - a recipe helper, builtins limited
            self.compiled[key] = namespace[key[1]]
        return self.compiled[key](*args)

    def value(self, node, fields: dict, aliases: dict, bound: dict, module: str):
        """A literal, a bound name, a field set so far, torch's dtypes, a pure helper's result,
        and the comparisons, boolean operations, ``getattr`` / ``hasattr`` of fields the recipes
        test; else _UNKNOWN."""
        try:
            return ast.literal_eval(node)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            pass
        if isinstance(node, ast.Name):
            return bound.get(node.id, _UNKNOWN)
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "torch" and node.attr in TORCH_DTYPES:
                return TORCH_DTYPES[node.attr]
            where = self.section_field(node, aliases)
            return fields.get(where[1]) if where is not None and where[0] is not None else _UNKNOWN
        if isinstance(node, ast.Call):
            name = getattr(node.func, "id", None)
            if name in ("getattr", "hasattr") and len(node.args) >= 2:
                where = self.section_field(ast.Attribute(value=node.args[0], attr=ast.literal_eval(node.args[1])),
                                           aliases)
                if where is None or where[0] is None:
                    return _UNKNOWN
                if name == "hasattr":
                    return True                         # every section has every field
                default = self.value(node.args[2], fields, aliases, bound, module) if len(node.args) > 2 else None
                return fields.get(where[1], default)
            key = self.resolve(module, name) if name else None
            if key is None or self.returns_config(key):
                return _UNKNOWN
            args = [self.value(a, fields, aliases, bound, module) for a in node.args]
            if _UNKNOWN in args or node.keywords:
                return _UNKNOWN
            try:
                return self.pure(key, args)
            except Exception:                           # a helper that needs more than it is given
                return _UNKNOWN
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            v = self.value(node.operand, fields, aliases, bound, module)
            return _UNKNOWN if v is _UNKNOWN else not v
        if isinstance(node, ast.BoolOp):                # Python's: the deciding operand
            v = _UNKNOWN
            for operand in node.values:
                v = self.value(operand, fields, aliases, bound, module)
                if v is _UNKNOWN or (bool(v) if isinstance(node.op, ast.Or) else not v):
                    return v
            return v
        if isinstance(node, ast.Compare) and len(node.ops) == 1:
            left = self.value(node.left, fields, aliases, bound, module)
            right = self.value(node.comparators[0], fields, aliases, bound, module)
            if _UNKNOWN in (left, right):
                return _UNKNOWN
            try:
                return {ast.Eq: lambda: left == right, ast.NotEq: lambda: left != right,
                        ast.Gt: lambda: left > right, ast.GtE: lambda: left >= right,
                        ast.Lt: lambda: left < right, ast.LtE: lambda: left <= right,
                        ast.In: lambda: left in right, ast.NotIn: lambda: left not in right,
                        ast.Is: lambda: left is right, ast.IsNot: lambda: left is not right}[type(node.ops[0])]()
            except (KeyError, TypeError):
                return _UNKNOWN
        return _UNKNOWN


def read(checkout: Path, commit: str | None = None) -> dict:
    """{recipe function name: {field: value}} of the catalog's MoE models in a Megatron-Bridge
    ``checkout``, with the commit it was read at (``commit``, else the checkout's HEAD)."""
    from ..plan.layout import layout_text
    from ..plan.validate import KINDS, _value_problem
    src = checkout / "src"
    if not (src / "megatron" / "bridge" / "perf_recipes").is_dir():
        raise SystemExit(f"{checkout}: not a Megatron-Bridge checkout (no src/megatron/bridge/perf_recipes)")
    reader = Reader(modules(src))
    recipes = {}
    for key in sorted(reader.recipes(), key=lambda k: k[1]):
        fields = reader.builder(key)
        if isinstance(fields.get("pipeline_model_parallel_layout"), list):      # as Megatron's flag writes it
            fields["pipeline_model_parallel_layout"] = layout_text(fields["pipeline_model_parallel_layout"])
        # Megatron's fields as Megatron reads them: a Bridge field of another kind under a
        # Megatron name (its manual_gc_eval interval) is Bridge's own, left out.
        recipes[key[1]] = {k: v for k, v in sorted(fields.items())
                           if k in KINDS and v is not None and _value_problem(k, v) is None}
    if commit is None:
        try:
            commit = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True,
                                    text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            raise SystemExit(f"{checkout}: not a git checkout; give the commit its files are from (--commit SHA)")
    return {"about": "Megatron-Bridge's flat performance recipes (src/megatron/bridge/perf_recipes) of the catalog's "
                     "MoE models, the fields each function sets as expertrail.tools.bridge_recipes reads them "
                     f"(https://github.com/NVIDIA-NeMo/Megatron-Bridge at commit {commit})",
            "commit": commit, "recipes": recipes}


def recipes_text(data: dict) -> str:
    """``data`` as JSON with one recipe a line (a release's changes read as a diff of lines)."""
    lines = [f"  {json.dumps(name)}: {json.dumps(fields)}" for name, fields in data["recipes"].items()]
    head = {k: v for k, v in data.items() if k != "recipes"}
    return ("{\n" + "".join(f"  {json.dumps(k)}: {json.dumps(v)},\n" for k, v in head.items())
            + '  "recipes": {\n' + ",\n".join("  " + line for line in lines) + "\n  }\n}\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m expertrail.tools.bridge_recipes", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=Path, help="a Megatron-Bridge checkout")
    parser.add_argument("--commit", help="the commit the checkout's files are from (default: its git HEAD)")
    parser.add_argument("--write", action="store_true", help=f"write {OUT.name} (default: print it)")
    args = parser.parse_args(argv)
    text = recipes_text(read(args.checkout, args.commit))
    if args.write:
        OUT.write_text(text)
        print(f"wrote {OUT}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
