"""The seams hold (docs/ARCHITECTURE.md): each layer imports only from the layers below it, the training loop
never tests the parallelism strategy, the Checkpointer stays small and knows nothing of metrics, train.py
stays the loop and its assembly, and each registry is where the config's choices come from."""
from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from tests.trainkit import REPO_ROOT

PACKAGE_ROOTS = ("utils", "configs")


def packages(root=REPO_ROOT) -> dict[str, Path]:
    """Every layer folder: `utils` (its loose modules), each folder under utils/ and configs/."""
    found = {"utils": root / "utils", "configs": root / "configs"}
    for init in sorted((root / "utils").glob("*/__init__.py")):
        found[f"utils.{init.parent.name}"] = init.parent
    return found


def package_of(module: str, known, root=REPO_ROOT) -> str:
    """The layer a module belongs to: the one its own docstring names on a line "Layer: NAME" (a module that
    sits in a folder for what it describes but is read by a lower layer: a model family's bundle), else the
    longest known package folder it starts with."""
    override = declared_layer(module, root)
    if override is not None:
        return override
    best = max((p for p in known if module == p or module.startswith(p + ".")), key=len, default=None)
    assert best is not None, f"{module} is in no layer folder"
    return best


def declared_layer(module: str, root=REPO_ROOT) -> str | None:
    parts = module.split(".")
    for path in (root.joinpath(*parts).with_suffix(".py"), root.joinpath(*parts, "__init__.py")):
        if path.is_file():
            match = re.search(r"^Layer: ([\w.]+)", ast.get_docstring(ast.parse(path.read_text())) or "", re.M)
            return match[1] if match else None
    return None


def may_import(folder: Path) -> set[str]:
    """The layers a folder's package docstring allows after "May import:" (its own is always allowed)."""
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
    match = re.search(r"^May import:(.*?)(?:\.\s*$|\n\n)", doc, re.S | re.M)
    assert match, f"{folder}/__init__.py: its docstring has no 'May import:' line"
    text = re.sub(r"\([^)]*\)", "", match[1]).strip()  # a reason in parentheses is prose
    if text.startswith("nothing"):
        return set()
    return {name.strip() for name in re.split(r"[,\s]+", text) if name.strip()}


def project_imports(path, root=REPO_ROOT) -> set[str]:
    """Every module of the project `path` imports, at its top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] in PACKAGE_ROOTS and _is_module(name, root):
                found.add(name)
    return found


def _is_module(name: str, root=REPO_ROOT) -> bool:
    parts = name.split(".")
    return (root.joinpath(*parts).with_suffix(".py").is_file()
            or root.joinpath(*parts, "__init__.py").is_file())


def module_name(path, root=REPO_ROOT) -> str:
    name = ".".join(path.relative_to(root).with_suffix("").parts)
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def layer_violations(root=REPO_ROOT) -> list[str]:
    """'module (layer) imports other (layer)' for every import its folder's docstring does not allow, and
    'circle: ...' when the allowed imports of the folders form a circle."""
    known = packages(root)
    allowed = {name: may_import(folder) for name, folder in known.items()}
    wrong = [f"{name}'s 'May import:' names {sorted(deps - set(known))}, not layer folders"
             for name, deps in allowed.items() if deps - set(known)]
    for path in sorted([*root.glob("utils/**/*.py"), *root.glob("configs/*.py")]):
        me = module_name(path, root)
        mine = package_of(me, known, root)
        for other in project_imports(path, root):
            theirs = package_of(other, known, root)
            if theirs != mine and theirs not in allowed[mine]:
                wrong.append(f"{me} ({mine}) imports {other} ({theirs}): not in {mine}'s 'May import:'")
    order = layer_order(allowed)
    if order is None:
        wrong.append(f"circle: the folders' 'May import:' lines form a circle: {allowed}")
    return wrong


def layer_order(allowed: dict[str, set[str]]) -> list[str] | None:
    """The layers lowest first (each after everything it may import), or None when they form a circle."""
    order, left = [], dict(allowed)
    while left:
        ready = sorted(name for name, deps in left.items() if deps <= set(order))
        if not ready:
            return None
        order += ready
        for name in ready:
            del left[name]
    return order


def import_circles(root=REPO_ROOT) -> list[list[str]]:
    """Every circle of imports among the engine's modules (utils/, configs/), counting an import inside a function
    as one at the top: a deferred import only moves a circle from import time to call time. Each circle is its
    modules in a cycle (the first repeated at the end), found as the strongly connected components of the graph
    (Tarjan's algorithm). A package's implicit import of its parent, and its `__init__`'s `from PACKAGE import
module`, are not counted."""
    paths = sorted([*root.glob("utils/**/*.py"), *root.glob("configs/*.py")])
    graph = {module_name(p, root): sorted(project_imports(p, root) - {module_name(p, root)}) for p in paths}
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in graph.get(module, ()):
            if other not in graph:
                continue
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == module:
                    break
            if len(component) > 1:
                found.append(_cycle_through(sorted(component), graph))

    for module in graph:
        if module not in index:
            visit(module)
    return found


def _cycle_through(component: list[str], graph: dict) -> list[str]:
    """One cycle inside a strongly connected `component`, from its first module back to it (breadth first)."""
    start, members = component[0], set(component)
    came_from, queue = {start: None}, [start]
    while queue:
        module = queue.pop(0)
        for other in graph[module]:
            if other == start:
                path = [module]
                while came_from[path[-1]] is not None:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if other in members and other not in came_from:
                came_from[other] = module
                queue.append(other)
    return component


def test_no_import_circle_among_the_engines_modules_counting_imports_inside_functions(tmp_path):
    """No module imports, at its top or inside a function, one that imports it back (through any others). On a
    copy in a temporary folder, a deferred import that closes a circle inside one layer (as configs/model_config.py
    and the family registry once did, which the layers' check cannot see) is caught."""
    import shutil

    assert import_circles() == []
    for name in PACKAGE_ROOTS:
        shutil.copytree(REPO_ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    assert import_circles(tmp_path) == []
    spec = tmp_path / "utils" / "model" / "architecture.py"
    spec.write_text(spec.read_text() + "\n\ndef preset(name):\n    from configs.model_config import get_model_spec\n\n"
                    "    return get_model_spec(name)\n")
    circles = import_circles(tmp_path)
    assert len(circles) == 1 and circles[0][0] == circles[0][-1], circles
    assert {"configs.model_config", "utils.model.architecture"} <= set(circles[0]), circles
    assert layer_violations(tmp_path) == []  # within one layer: only the circle check sees it


def test_no_module_imports_from_a_layer_its_folder_does_not_allow():
    assert layer_violations() == []


def test_the_layers_come_from_the_folders_and_a_new_violation_is_caught(tmp_path):
    """On a copy of the package in a temporary folder: the layers read from the folders' docstrings are in
    order, a module importing from a layer above it is caught, and a circle is caught."""
    import shutil

    for name in PACKAGE_ROOTS:
        shutil.copytree(REPO_ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    allowed = {name: may_import(folder) for name, folder in packages(tmp_path).items()}
    order = layer_order(allowed)
    assert order is not None and order[0] == "utils" and order[-1] == "utils.run", order
    assert order.index("configs") < order.index("utils.model") < order.index("utils.parallel"), order
    assert layer_violations(tmp_path) == []
    (tmp_path / "utils" / "io" / "intruder.py").write_text("from utils.run.export import export_final_model\n")
    found = layer_violations(tmp_path)
    assert len(found) == 1 and "utils.io.intruder (utils.io) imports utils.run.export" in found[0], found
    init = tmp_path / "utils" / "runtime" / "__init__.py"  # runtime allowed to import run: a circle with run's
    init.write_text(init.read_text().replace("May import: utils, utils.io.", "May import: utils, utils.io, utils.run."))
    assert any(line.startswith("circle:") for line in layer_violations(tmp_path))


def test_each_layer_folder_names_its_modules_and_utils_keeps_few_loose_ones():
    for name, folder in packages().items():
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
        files = [p.stem for p in folder.glob("*.py") if p.stem != "__init__"]
        unnamed = [stem for stem in files if not re.search(rf"\b{stem}\b", doc)]
        assert not unnamed, f"{name}'s package docstring does not name {unnamed}"
    loose = [p.stem for p in (REPO_ROOT / "utils").glob("*.py") if p.stem != "__init__"]
    assert len(loose) <= 6, loose


def test_the_loop_passes_the_strategy_on_and_never_tests_it():
    text = (REPO_ROOT / "train.py").read_text()
    assert not re.search(r"strategy\s*[!=]=|[!=]=\s*[\"'](ddp|fsdp)[\"']|\.strategy\b", text)
    assert len(text.splitlines()) < 450


def test_the_checkpointer_takes_at_most_8_parameters_and_nothing_from_metrics():
    from utils.checkpoint.checkpointer import Checkpointer

    assert len(inspect.signature(Checkpointer.__init__).parameters) - 1 <= 8  # self aside
    imported = project_imports(REPO_ROOT / "utils" / "checkpoint" / "checkpointer.py")
    assert not any(m.startswith(("utils.observe.metrics", "utils.model", "utils.parallel.strategies"))
                   for m in imported), imported


@pytest.mark.parametrize("field, registry", [
    ("lr_schedule", "utils.training.schedules:SCHEDULES"),
    ("decay_shape", "utils.training.schedules:DECAY_SHAPES"),
    ("strategy", "utils.parallel.strategies:STRATEGIES"),
    ("report_to", "utils.observe.trackers:TRACKERS"),
])
def test_a_config_choice_is_accepted_exactly_when_its_registry_implements_it(field, registry):
    """The config accepts every name its registry implements, names them all when it refuses one, and
    refuses a name the registry lacks: a choice added on one side only fails here."""
    import importlib

    from configs import ConfigError, get_training_config

    module, name = registry.split(":")
    implemented = getattr(importlib.import_module(module), name)
    names = list(implemented)
    assert names, registry
    for choice in names:
        assert getattr(get_training_config("demo", {field: choice}), field) == choice
    with pytest.raises(ConfigError) as refused:
        get_training_config("demo", {field: "not-a-choice"})
    assert all(f"{choice}" in str(refused.value) for choice in names), str(refused.value)


def test_every_model_impl_and_shuffle_the_config_accepts_is_implemented():
    """model_impl and shuffle have no registry dict: each name the config accepts builds a model / an order."""
    from configs import get_model_spec, get_training_config
    from configs.training_config import MODEL_IMPLS, SHUFFLES
    from utils.data.mixture import Shuffle
    from utils.model import build_model

    spec = get_model_spec(get_training_config("demo").model)
    for impl in MODEL_IMPLS:
        model = build_model(spec, seed=0, impl=impl)
        assert sum(p.numel() for p in model.parameters()) > 0, impl
    for kind in SHUFFLES:
        assert Shuffle(kind).kind == kind
    with pytest.raises(ValueError):
        Shuffle("not-a-choice")


# Module attributes and who may name them: a family's own (GPT-NeoX's fused names) in its folder only; the shared
# blocks' (utils/model/common/: transformers' common names) in the families that compose them and their counting
# helpers (utils/model/family.py). The rest of the engine goes through the model's interface
# (utils/model/layers.py CausalLM) and the family's bundle.
def family_folders() -> list[str]:
    return sorted(f"utils/model/{p.parent.name}/" for p in REPO_ROOT.glob("utils/model/*/__init__.py")
                  if p.parent.name != "common")


ATTRIBUTE_OWNERS = {
    "gpt_neox": (("utils/model/gpt_neox/",),
                 r"(?<!utils\.model)\.gpt_neox\b|\bembed_in\b|\bembed_out\b|\bfinal_layer_norm\b|\bquery_key_value\b"
                 r"|\bdense_h_to_4h\b|\bdense_4h_to_h\b"),
    "the shared blocks": (("utils/model/common/", "utils/model/family.py", *family_folders()),
                          r"\bembed_tokens\b|(?<!utils)\.model\.(layers|norm|embed_tokens)\b|\b[qkvo]_proj\b"
                          r"|\b(gate|up|down)_proj\b|\bself_attn\b|\b[qk]_norm\b"),
}


def family_attribute_uses(paths) -> list[str]:
    """'file:line: owner' for every line outside the places allowed to that names an owner's attributes."""
    found = []
    for path in paths:
        rel = path.relative_to(REPO_ROOT).as_posix() if path.is_relative_to(REPO_ROOT) else path.name
        for owner, (allowed, pattern) in ATTRIBUTE_OWNERS.items():
            if rel.startswith(allowed):
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if re.search(pattern, code):
                    found.append(f"{rel}:{number}: names {owner}' attributes: {line.strip()}")
    return found


def engine_sources():
    skip = ("tests", ".venv", "benchmarks")
    return [p for p in REPO_ROOT.rglob("*.py") if p.relative_to(REPO_ROOT).parts[0] not in skip
            and not any(part.startswith(".") for part in p.relative_to(REPO_ROOT).parts)]


def test_no_code_outside_a_family_folder_names_its_attributes(tmp_path):
    assert family_attribute_uses(engine_sources()) == []
    # the check catches one: a stand-in file (outside the source tree) reaching into a family and a shared block
    stand_in = tmp_path / "intruder.py"
    stand_in.write_text("def f(model):\n    return model.gpt_neox.embed_in, model.model.layers[0].self_attn\n")
    found = family_attribute_uses([stand_in])
    assert len(found) == 2 and "gpt_neox" in found[0] and "shared blocks" in found[1], found


def family_name_branches(paths) -> list[str]:
    """'file:line: ...' for every comparison with, or dict keyed by, a registered family's name or one of the
    config.json model_types it reads, outside the families' folders: such a branch is family knowledge living
    outside its folder (what the family's bundle, utils/model/family.py, is for)."""
    from utils.model.families import FAMILIES

    names = set(FAMILIES) | {t for f in FAMILIES.values() for t in f.hf_model_types}
    found = []
    for path in paths:
        rel = path.relative_to(REPO_ROOT).as_posix() if path.is_relative_to(REPO_ROOT) else path.name
        if rel.startswith(tuple(family_folders())):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                values = [node.left, *node.comparators]
            elif isinstance(node, ast.Dict):
                values = [k for k in node.keys if k is not None]
            else:
                continue
            values += [e for v in values if isinstance(v, (ast.Tuple, ast.List, ast.Set)) for e in v.elts]
            hit = [v.value for v in values if isinstance(v, ast.Constant) and v.value in names]
            if hit:
                found.append(f"{rel}:{node.lineno}: branches on the family name {hit[0]!r}")
    return found


def test_no_file_outside_a_family_folder_branches_on_a_family_name(tmp_path):
    """Family knowledge (parameter counts, Muon's matrices, what a record carries, HF class choice) lives in
    the family's folder: nothing else compares with or keys by a family's name."""
    from utils.model.families import FAMILIES

    assert family_name_branches(engine_sources()) == []
    stand_in = tmp_path / "profiles_of_old.py"  # how configs/profiles.py and model_config.py used to do it
    stand_in.write_text("def block(spec):\n    if spec.family == 'gpt_neox':\n        return 1\n"
                        "    return {'llama': 2}.get(spec.family, 3)\n\n"
                        "def kind(config):\n    return config['model_type'] in ('qwen2', 'x')\n")
    found = family_name_branches([stand_in])
    assert sorted(line.split(": ")[0] for line in found) == ["profiles_of_old.py:2", "profiles_of_old.py:4",
                                                      "profiles_of_old.py:7"], found
    assert set(FAMILIES) >= {"gpt_neox", "llama"}


def test_the_config_family_choices_and_presets_come_from_the_registry():
    """A spec's family, the presets by name and the config's `model` choices are the registry's, and each
    preset is valid for its family (its fields, its checks)."""
    from configs import ConfigError, get_model_spec, get_training_config
    from configs.model_config import MODELS
    from utils.model.families import FAMILIES, family

    assert MODELS == {spec.name: spec for f in FAMILIES.values() for spec in f.presets}
    for name, spec in MODELS.items():
        family(spec.family).validate(spec)
        assert get_model_spec(name) is spec
    with pytest.raises(ConfigError, match="valid: " + ", ".join(FAMILIES)):
        family("not-a-family")
    with pytest.raises(ConfigError) as refused:
        get_training_config("demo", {"model": "not-a-model"})
    assert all(name in str(refused.value) for name in MODELS)


ENGINE_FILES = ("train.py", "prepare_data.py", "generate.py", "download_training_data.py")


def oversized_functions(paths, root=REPO_ROOT) -> list[str]:
    """'file:line name: N lines, M parameters' for each function over 60 lines or 8 parameters (self aside)."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            a = node.args
            params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *([a.vararg] if a.vararg else []),
                      *([a.kwarg] if a.kwarg else [])]
            if params and params[0].arg in ("self", "cls"):
                params = params[1:]
            lines = node.end_lineno - node.lineno + 1
            if lines > 60 or len(params) > 8:
                found.append(f"{path.relative_to(root)}:{node.lineno} {node.name}: {lines} lines, "
                             f"{len(params)} parameters")
    return found


def test_no_engine_function_runs_over_60_lines_or_takes_over_8_parameters(tmp_path):
    paths = [*REPO_ROOT.glob("utils/**/*.py"), *REPO_ROOT.glob("configs/*.py"),
             *(REPO_ROOT / name for name in ENGINE_FILES)]
    assert oversized_functions(paths) == []
    stand_in = tmp_path / "long.py"  # the check catches each kind
    stand_in.write_text("def wide(a, b, c, d, e, f, g, h, i):\n    pass\n\n\ndef long():\n" + "    x = 1\n" * 60)
    assert [line.split(":")[-2].split()[-1] for line in oversized_functions([stand_in], tmp_path)] == ["wide", "long"]


def whole_config_readers(paths, root=REPO_ROOT) -> list[str]:
    """Modules of utils/ that take the run's whole config: a parameter named `cfg`, or an import of the
    TrainingConfig or of what makes one. Only the Trainer's construction (utils/run/trainer.py) may."""
    found = []
    for path in paths:
        rel = path.relative_to(root).as_posix()
        if rel == "utils/run/trainer.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if any(a.arg == "cfg" for a in [*node.args.args, *node.args.kwonlyargs, *node.args.posonlyargs]):
                    found.append(f"{rel}:{node.lineno} {node.name} takes cfg")
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("configs"):
                names = {a.name for a in node.names} & {"TrainingConfig", "get_training_config", "settle_config",
                                                        "PRESETS"}
                if names:
                    found.append(f"{rel}:{node.lineno} imports {', '.join(sorted(names))}")
    return found


def settings_classes() -> list[type]:
    """Every component's typed settings: the subclasses of utils.settings.Settings in the engine."""
    import importlib
    import pkgutil

    import utils
    from utils.settings import Settings

    for info in pkgutil.walk_packages(utils.__path__, "utils."):
        importlib.import_module(info.name)
    found, todo = [], [Settings]
    while todo:
        for sub in todo.pop().__subclasses__():
            found.append(sub)
            todo.append(sub)
    return found


def test_only_configs_and_the_trainer_hold_the_whole_config_and_every_settings_field_is_a_config_field(tmp_path):
    import dataclasses
    import typing

    from configs.training_config import TrainingConfig

    assert whole_config_readers(REPO_ROOT.glob("utils/**/*.py")) == []
    stand_in = tmp_path / "utils" / "reader.py"
    stand_in.parent.mkdir()
    stand_in.write_text("from configs.training_config import TrainingConfig\n\ndef f(cfg):\n    return cfg.seed\n")
    assert len(whole_config_readers([stand_in], tmp_path)) == 2
    config_types = {f.name: f.type for f in dataclasses.fields(TrainingConfig)}
    classes = settings_classes()
    assert len(classes) >= 10, classes
    for cls in classes:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in config_types:  # the same field, the same type
                assert f.type == config_types[f.name], (cls.__name__, f.name, f.type, config_types[f.name])
            else:  # or one of the config's derived properties
                assert isinstance(getattr(TrainingConfig, f.name, None), property), (cls.__name__, f.name)
        assert hints and cls.of(TrainingConfig()) is not None


def test_paths_a_module_derives_from_its_own_file_point_into_the_repository():
    """A module that moved into a layer folder finds the repository where it is: credentials/, the stack
    dumps' repository-relative names, the Ray workers' package."""
    from utils.data import executors
    from utils.io import storage
    from utils.observe import watchdog

    assert storage.CREDENTIALS_DIR == REPO_ROOT / "credentials"
    assert watchdog.REPO_ROOT == REPO_ROOT
    assert executors.UTILS_PACKAGE == REPO_ROOT / "utils"
