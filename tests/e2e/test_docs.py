"""Documentation that cannot drift: every command, option, config field and preset that README.md and docs/
show exists in the real entry points (their `--help`) and the config's field definitions; every relative link
resolves; nothing points outside the repository; the configuration reference is the generated one.

The README's quick start and own-data blocks are also run as written (tests/e2e/test_demo.py,
tests/e2e/test_first_day.py); and every page's commands are run in reading order after the quick start, at toy
size, in a fresh copy of the repository (tests/docs_walk.py, a slow test)."""
from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from configs.training_config import PRESETS, ConfigError, is_config_file, parse_overrides
from tests.conftest import REPO_ROOT, Emulator, make_subprocess_env

DOC_FILES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("**/*.md"))]
SHELL_BLOCK = re.compile(r"```(?:bash|sh|shell|console)\n(.*?)```", re.S)
YAML_BLOCK = re.compile(r"```ya?ml\n(.*?)```", re.S)
PYTHONS = {"python", "python3", ".venv/bin/python", "sys.executable"}
SEPARATORS = {"&&", "||", "|", ";", "&"}
OPTION = re.compile(r"(?<![\w-])(--[A-Za-z0-9][A-Za-z0-9-]*)")


def shell_commands(text: str) -> list[str]:
    """The commands of a page's shell blocks: continuation lines joined, one command per line."""
    commands = []
    for block in SHELL_BLOCK.findall(text):
        commands += [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    return commands


def split_words(command: str) -> list[list[str]]:
    """A shell line -> the word lists of its simple commands (comments dropped, split at && || | ; &)."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    out, current = [], []
    for word in lexer:
        if word in SEPARATORS:
            out.append(current)
            current = []
        else:
            current.append(word)
    return [words for words in out + [current] if words]


def entry_point(words: list[str], root: Path) -> tuple[list[str], list[str]] | None:
    """(how to ask it for --help, its arguments) when `words` runs one of the repository's programs, else
    None (nvidia-smi, tail, pip: not ours). A script the repository does not have is an error."""
    i = 0
    while i < len(words) and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[i]):  # VAR=value before the command
        i += 1
    if i == len(words):
        return None
    program = words[i]
    if program in PYTHONS:
        i += 1
        if i < len(words) and words[i] == "-m":
            module = words[i + 1]
            path = root / (module.replace(".", "/") + ".py")
            if not path.exists():
                return None if module.split(".")[0] not in {"configs", "utils", "scripts", "benchmarks"} else (
                    [f"missing module {module}"], [])
            return [sys.executable, "-m", module, "--help"], words[i + 2:]
        program = words[i] if i < len(words) else ""
        runner = [sys.executable]
    else:
        runner = ["bash"] if program.endswith(".sh") else None
    if not program.endswith((".py", ".sh")) or "/" in program.lstrip("./") and program.split("/")[0] in (
            "runs", "data", "tmp"):
        return None
    path = root / program.removeprefix("./")
    if not path.is_file():
        return [f"missing {program}"], []
    return (runner or [sys.executable]) + [str(path), "--help"], words[i + 1:]


@functools.lru_cache(maxsize=None)
def options_of(help_command: tuple[str, ...], cwd: str) -> frozenset[str]:
    """The --options a program's --help names."""
    proc = subprocess.run(list(help_command), cwd=cwd, capture_output=True, text=True, timeout=120,
                          env=make_subprocess_env())
    assert proc.returncode == 0, f"{' '.join(help_command)} failed: {proc.stderr[-2000:]}"
    return frozenset(OPTION.findall(proc.stdout))


def check_set(pair: str, where: str) -> list[str]:
    try:
        parse_overrides([pair])
    except ConfigError as exc:
        return [f"{where}: {exc}"]
    return []


def check_config_name(name: str, where: str) -> list[str]:
    if is_config_file(name) or name in PRESETS:
        return []
    return [f"{where}: --config {name}: no such preset (presets: {', '.join(PRESETS)})"]


def check_arguments(help_command: list[str], args: list[str], where: str, root: Path) -> list[str]:
    """Every --option in `args` is one `help_command` prints; --set pairs name real fields with values of
    their type; --config names a preset or a file. After a lone `--`, start_training.sh's arguments are
    train.py's."""
    known = options_of(tuple(help_command), str(root))
    problems = []
    for k, word in enumerate(args):
        if word == "--":
            if help_command[-2].endswith("start_training.sh"):
                train = [sys.executable, str(root / "train.py"), "--help"]
                return problems + check_arguments(train, args[k + 1:], where, root)
            return problems
        if not word.startswith("--"):
            continue
        option, _, inline = word.partition("=")
        value = inline or (args[k + 1] if k + 1 < len(args) else "")
        if option not in known:
            problems.append(f"{where}: {Path(help_command[-2]).name} has no option {option}")
        elif option == "--set":
            problems += check_set(value, where)
        elif option == "--config":
            problems += check_config_name(value, where)
    return problems


def check_page(text: str, name: str, root: Path = REPO_ROOT) -> list[str]:
    problems = []
    for line in shell_commands(text):
        for words in split_words(line):
            found = entry_point(words, root)
            if found is None:
                continue
            help_command, args = found
            if len(help_command) == 1:  # a script or module the repository lacks
                problems.append(f"{name}: `{line.strip()}`: {help_command[0]}")
                continue
            problems += check_arguments(help_command, args, f"{name}: `{line.strip()}`", root)
    for block in YAML_BLOCK.findall(text):
        problems += check_config_block(block, name)
    return problems


def check_config_block(block: str, name: str) -> list[str]:
    """A YAML block with a training-config field (or `base:`) at its top is a config file: every key a field
    (with a value of its type), `base` a preset. Other YAML (a SkyPilot task) is not checked here."""
    from configs.training_config import _SETTABLE, _coerce

    try:
        data = yaml.safe_load(block)
    except yaml.YAMLError as exc:
        return [f"{name}: a YAML block does not parse ({exc})"]
    if not isinstance(data, dict) or not ({"base", *_SETTABLE} & set(data)):
        return []
    problems = []
    for key, value in data.items():
        if key == "base":
            problems += check_config_name(str(value), f"{name}: yaml block")
        elif key != "preset" and key not in _SETTABLE:
            problems.append(f"{name}: yaml block: {key!r} is not a training-config field")
        elif key != "preset":
            try:
                _coerce(key, value, f"{name}: yaml block")
            except ConfigError as exc:
                problems.append(str(exc))
    return problems


def test_every_command_and_option_the_docs_show_exists():
    problems = [p for page in DOC_FILES for p in check_page(page.read_text(), str(page.relative_to(REPO_ROOT)))]
    assert not problems, "\n".join(problems)


def test_the_check_fails_on_an_option_renamed_or_a_field_unknown(tmp_path):
    """A stand-in entry point whose option is renamed: a page still naming the old option fails the check;
    so do an unknown --set field, a misspelt preset, a config block with an unknown key, a missing script."""
    standin = tmp_path / "tool.py"
    standin.write_text("import argparse\np = argparse.ArgumentParser()\np.add_argument('--new-name')\n"
                       "p.add_argument('--set')\np.parse_args()\n")
    page = ("```bash\n.venv/bin/python tool.py --old-name 3 --set learning_rate=1e-3   # a comment --not-checked\n"
            ".venv/bin/python tool.py --new-name 3 \\\n  --set learnin_rate=1e-3 && ./gone.sh --x\n```\n"
            "```yaml\nbase: demo\nlearning_rat: 0.1\n```\n")
    problems = check_page(page, "PAGE.md", root=tmp_path)
    assert any("has no option --old-name" in p for p in problems), problems
    assert not any("no option --new-name" in p or "no option --not-checked" in p for p in problems), problems
    assert any("unknown training-config field 'learnin_rate'" in p and "did you mean 'learning_rate'" in p
               for p in problems), problems
    assert any("missing ./gone.sh" in p for p in problems), problems
    assert any("'learning_rat' is not a training-config field" in p for p in problems), problems
    assert not check_page("```bash\n.venv/bin/python tool.py --new-name 3 --set seed=1\n```\n", "OK.md",
                          root=tmp_path)
    assert check_page("```bash\n./start_training.sh --config demoo\n```\n", "P.md") == [
        "P.md: `./start_training.sh --config demoo`: --config demoo: no such preset (presets: "
        + ", ".join(PRESETS) + ")"]
    # after `--`, start_training.sh's arguments are train.py's
    assert check_page("```bash\n./start_training.sh --config demo -- --output-dir x --max-stepz 3\n```\n", "P.md")


@pytest.mark.slow
def test_every_page_s_commands_run_as_written_after_the_quick_start(tmp_path):
    """README.md and docs/ walked in reading order in a fresh copy of the repository (tests/docs_walk.py):
    every command a CPU can run exits 0 at toy size (the paths it names exist by then, no run is refused
    over another's folder), and nothing is left in the repository outside the folders git ignores."""
    from tests.docs_walk import (
        DEFAULT_MAX_STEPS,
        MAX_STEPS_ENV,
        fresh_clone,
        left_in_the_repository,
        reader_files,
        walk,
    )

    (tmp_path / "clone").mkdir()
    clone = fresh_clone(tmp_path / "clone")
    reader_files(clone)
    bucket = Emulator(bucket="my-bucket")  # the pages' bucket
    try:
        ran, skipped = walk(clone, int(os.environ.get(MAX_STEPS_ENV, DEFAULT_MAX_STEPS)), bucket.bucket, bucket.url)
    finally:
        bucket.stop()
    for command in ran:
        print(f"ran     {command.seconds:6.1f} s  {command.page}: {command.shown}")
    for command in skipped:
        print(f"skipped ({command.skipped})  {command.page}: {command.shown}")
    shown = [command.shown for command in ran]
    for expected in ("./start_training.sh --config demo", "prepare_data.py --input corpus/ --tokenizer my-tokenizer/",
                     "generate.py runs/cpu/final_model", "--set model=llama-demo", "--tokenizer models/llama-3.2-1b",
                     "--config demo --cpu --gpus 2", "scripts/evaluate.py", "spike_guard=rollback",
                     "scripts/plot_run.py", "--upload gs://my-bucket/datasets/mine",
                     "download_training_data.py --source gs://my-bucket/datasets/mine",
                     "--tokenizer my-tokenizer/ --output gs://my-bucket/datasets/mine"):
        assert any(expected in line for line in shown), f"no command with {expected!r} ran: {shown}"
    assert left_in_the_repository(clone) == []


def relative_links(text: str) -> list[str]:
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    return [link for link in links if not re.match(r"[a-z]+:", link) and not link.startswith("#")]


def test_every_relative_link_in_the_docs_resolves():
    missing = []
    for page in DOC_FILES:
        for link in relative_links(page.read_text()):
            target = (page.parent / link.split("#")[0]).resolve()
            if not target.exists():
                missing.append(f"{page.relative_to(REPO_ROOT)}: {link}")
            elif REPO_ROOT.resolve() not in target.parents and target != REPO_ROOT.resolve():
                missing.append(f"{page.relative_to(REPO_ROOT)}: {link} is outside the repository")
    assert not missing, "\n".join(missing)


def tracked_text_files() -> list[Path]:
    proc = subprocess.run(["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip("not a git checkout")
    files = [REPO_ROOT / name for name in proc.stdout.splitlines()]
    return [f for f in files if f.suffix in {".md", ".py", ".sh", ".yaml", ".yml", ".txt", ".sbatch", ""}
            and f.is_file()]


def test_nothing_in_the_repository_points_to_a_file_outside_it():
    outside = re.compile(r"\.\./shared/|shared/DESIGN\.md|(?<![\w/])DESIGN\.md")
    hits = [f"{path.relative_to(REPO_ROOT)}:{n}: {line.strip()}" for path in tracked_text_files()
            if path.name != Path(__file__).name
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1) if outside.search(line)]
    assert not hits, "\n".join(hits)


def test_the_configuration_reference_is_current():
    from configs.reference import PAGE, markdown

    assert PAGE.read_text() == markdown(), "docs/configuration.md is out of date: run python -m configs.reference"
