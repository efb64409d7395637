"""The seams hold (docs/ARCHITECTURE.md): each layer imports only from the layers below it, the training loop
never tests the parallelism strategy, the Checkpointer stays small and knows nothing of metrics, train.py
stays the loop and its assembly, and each registry is where the config's choices come from."""
from __future__ import annotations

import ast
import os
import inspect
import re

import pytest

from tests.trainkit import REPO_ROOT

# Lowest first: a module may import from its own layer and the ones before it, never from a later one.
LAYERS = [
    ("base", ["utils", "utils.errors", "utils.files", "utils.layout", "utils.debug", "utils.distributed",
              "utils.storage", "utils.lock", "utils.console", "utils.signals", "utils.state", "utils.run_status",
              "utils.schedules", "utils.trackers", "utils.quiet_imports", "utils.host_memory", "utils.launch",
              "utils.accelerator"]),
    ("configs", ["configs"]),
    ("data", ["utils.data"]),
    ("checkpoint", ["utils.checkpoint"]),
    ("model", ["utils.model"]),
    ("engine", ["utils.parallel", "utils.optim", "utils.muon", "utils.metrics", "utils.sampling", "utils.evals", "utils.spike_guard"]),
    ("run", ["utils.export", "utils.run_dir", "utils.run_report"]),
]


def family_descriptions() -> set[str]:
    """The modules that describe the model families without building them: the registry, the Family type and
    each family folder's bundle (its __init__). The config layer reads them (presets, the memory plan), so they
    sit in that layer: they import only configs and each other; a family's model and adapter stay above."""
    bundles = {f"utils.model.{p.parent.name}" for p in REPO_ROOT.glob("utils/model/*/__init__.py")
               if p.parent.name != "common"}
    return {"utils.model.families", "utils.model.family"} | bundles


def layer_of(module: str) -> int:
    if module in family_descriptions():
        return [name for name, _ in LAYERS].index("configs")
    best = None
    for number, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (number, len(prefix))
    assert best is not None, f"{module} is in no layer of tests/test_architecture.py: add it"
    return best[0]


def project_imports(path) -> set[str]:
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
            if name.split(".")[0] in ("utils", "configs") and _is_module(name):
                found.add(name)
    return found


def _is_module(name: str) -> bool:
    parts = name.split(".")
    return (REPO_ROOT.joinpath(*parts).with_suffix(".py").is_file()
            or REPO_ROOT.joinpath(*parts, "__init__.py").is_file())


def module_name(path) -> str:
    name = ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts)
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def test_no_layer_imports_from_a_layer_above_it():
    wrong = []
    for path in sorted([*REPO_ROOT.glob("utils/**/*.py"), *REPO_ROOT.glob("configs/*.py")]):
        me = module_name(path)
        for other in project_imports(path):
            if layer_of(other) > layer_of(me):
                wrong.append(f"{me} ({LAYERS[layer_of(me)][0]}) imports {other} ({LAYERS[layer_of(other)][0]})")
    assert not wrong, "\n".join(wrong)


def test_the_loop_passes_the_strategy_on_and_never_tests_it():
    text = (REPO_ROOT / "train.py").read_text()
    assert not re.search(r"strategy\s*[!=]=|[!=]=\s*[\"'](ddp|fsdp)[\"']|\.strategy\b", text)
    assert len(text.splitlines()) < 450


def test_the_checkpointer_takes_at_most_8_parameters_and_nothing_from_metrics():
    from utils.checkpoint.checkpointer import Checkpointer

    assert len(inspect.signature(Checkpointer.__init__).parameters) - 1 <= 8  # self aside
    imported = project_imports(REPO_ROOT / "utils" / "checkpoint" / "checkpointer.py")
    assert not any(m.startswith(("utils.metrics", "utils.model", "utils.parallel")) for m in imported), imported


@pytest.mark.parametrize("field, registry", [
    ("lr_schedule", "utils.schedules:SCHEDULES"),
    ("decay_shape", "utils.schedules:DECAY_SHAPES"),
    ("strategy", "utils.parallel:STRATEGIES"),
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


def test_trackers_and_the_report_to_choices_are_one_registry():
    from configs.training_config import REPORT_TO
    from utils.trackers import TRACKERS

    assert REPORT_TO == (*TRACKERS, "none")


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
