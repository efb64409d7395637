"""The documentation walked as a reader walks it: README.md, then the docs/ pages in the order README.md first
links them (the rest after, by name), every command of every shell block in order, in a fresh copy of the
repository, the quick start first, with the reader's own files beside it (a corpus, a tokenizer, a downloaded
Llama-family model: `reader_files`).

A command runs as the page shows it; a training command also gets `--set` overrides appended by this harness
that keep it toy-sized (`toy_overrides`; the page is unchanged; DOCS_WALK_MAX_STEPS=0 runs each at its full
size). The reader's bucket (gs://my-bucket) is a GCS emulator's. A command that needs what a CPU test machine
has not (GPUs, another bucket, a cluster, a network install), a file the reader writes from the page's own
YAML, or the output of a skipped command, is skipped with its reason. A command that fails (a path that does
not exist, a run refused over another run's folder) fails the walk, and so does a file left in the repository
outside the folders git ignores."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from configs.training_config import PRESETS
from tests.conftest import REPO_ROOT
from tests.e2e.test_docs import shell_commands, split_words

MAX_STEPS_ENV = "DOCS_WALK_MAX_STEPS"
DEFAULT_MAX_STEPS = 6
GPU_PRESETS = ("production", "test")  # the 1.2B model in bf16 with compile: presets for GPUs
READER_FILES = ("corpus", "my-tokenizer", "models")  # what the reader brings, beside the repository's files
ENV_ASSIGNMENT = re.compile(r"([A-Z_][A-Z0-9_]*)=(.*)")
TRAINING = ("./start_training.sh", "train.py")


@dataclass
class Command:
    """One simple command of a page's shell line: its words, the VAR=value before it, and why it is not run."""

    page: str
    line: str
    words: list[str]
    env: dict[str, str] = field(default_factory=dict)
    skipped: str | None = None
    seconds: float = 0.0

    @property
    def shown(self) -> str:
        """The command as the page shows it, alone (a line may hold several)."""
        return " ".join(shlex.quote(word) for word in [*(f"{k}={v}" for k, v in self.env.items()), *self.words])

    @property
    def program(self) -> str:
        """The script a python command runs, else the program itself."""
        words = self.words
        if words[0] in ("python", "python3", ".venv/bin/python") and len(words) > 1:
            return words[2] if words[1] == "-m" and len(words) > 2 else words[1]
        return words[0]

    def option(self, name: str) -> str | None:
        """The value of `--name VALUE` or `--name=VALUE`, the last one given."""
        value = None
        for k, word in enumerate(self.words):
            if word == name and k + 1 < len(self.words):
                value = self.words[k + 1]
            elif word.startswith(name + "="):
                value = word.split("=", 1)[1]
        return value

    def setting(self, key: str) -> str | None:
        """The value of `--set KEY=VALUE`, the last one given."""
        values = [w.split("=", 1)[1] for k, w in enumerate(self.words)
                  if k and self.words[k - 1] == "--set" and w.startswith(key + "=")]
        return values[-1] if values else None


def pages_in_reading_order(root: Path) -> list[Path]:
    """README.md, the docs/ pages in the order README.md first links them, then the others by name."""
    readme = root / "README.md"
    linked = [root / link for link in re.findall(r"\]\((docs/[^)#\s]+\.md)", readme.read_text())]
    pages = list(dict.fromkeys([readme, *(p for p in linked if p.is_file())]))
    return pages + [p for p in sorted((root / "docs").glob("**/*.md")) if p not in pages]


def page_commands(page: Path, root: Path) -> list[Command]:
    commands = []
    for line in shell_commands(page.read_text()):
        for words in split_words(line):
            env = {}
            while words and ENV_ASSIGNMENT.fullmatch(words[0]):
                name, value = ENV_ASSIGNMENT.fullmatch(words[0]).groups()
                env[name], words = value, words[1:]
            if words:
                commands.append(Command(str(page.relative_to(root)), line.strip(), words, env))
    return commands


def training_output(command: Command) -> str:
    """The folder a training command writes: --output-dir, else runs/RUN_NAME (run_name, else the config's
    name)."""
    config = command.option("--config") or ""
    name = command.setting("run_name") or (Path(config).stem if config.endswith((".yaml", ".yml", ".json"))
                                           else config)
    return command.option("--output-dir") or f"runs/{name}"


def written_by(command: Command) -> str | None:
    """The folder a command writes that later commands read: a run's, prepare's --output, download's --dest."""
    if command.program.endswith(TRAINING):
        return training_output(command)
    return command.option("--output") or command.option("--dest")


def why_not_run(command: Command, skipped_outputs: list[str], clone: Path, bucket: str | None) -> str | None:
    """Why `command` is not run here, or None. `bucket`: the one GCS bucket an emulator serves (None: none)."""
    words, program, text = command.words, command.program, " ".join(command.words)
    config = command.option("--config")
    gpus = command.option("--gpus")
    buckets = set(re.findall(r"gs://([^/\s,:]+)", text))
    reasons = [
        (program == "./setup.sh", "setup: the test's virtual environment stands in for it"),
        (program == "pytest", "the test suite itself"),
        (program in ("pip", "pip3"), "installs from the network"),
        (program == "nvidia-smi", "needs GPUs"),
        (program in ("tail", "tensorboard"), "follows runs until stopped"),
        ("ray://" in text, "needs a Ray cluster"),
        (bool(buckets - {bucket}), f"needs the GCS bucket {', '.join(sorted(buckets - {bucket}))}"),
        (program.endswith(TRAINING) and (config in GPU_PRESETS or "--nodes" in words
                                         or (gpus is not None and "--cpu" not in words)), "needs GPUs"),
        (program.endswith(TRAINING) and config is not None and config not in PRESETS
         and not (clone / config).is_file(), f"{config}: a config file the reader writes from the page's YAML"),
    ]
    for applies, reason in reasons:
        if applies:
            return reason
    own = written_by(command)
    read = [part for word in words if word != own for part in re.split("[=,]", word)]
    for output in skipped_outputs:
        if any(part == output or part.startswith(output + "/") for part in read):
            return f"reads {output}, which a skipped command writes"
    return None


def toy_overrides(command: Command, max_steps: int) -> list[str]:
    """What the harness appends to a training command to keep it toy-sized: a few steps, each part (eval,
    checkpoint, samples, downstream evals) still acting at least once."""
    if not command.program.endswith(TRAINING) or max_steps <= 0:
        return []
    sets = [f"max_steps={max_steps}", f"save_steps={max_steps}", f"eval_interval={max_steps}",
            f"sample_every={max_steps}", "logging_steps=2", "eval_batches=2"]
    return [word for pair in sets for word in ("--set", pair)]


def walk(clone: Path, max_steps: int, bucket: str | None = None, emulator_url: str | None = None,
         timeout_s: float = 600) -> tuple[list[Command], list[Command]]:
    """Every page's commands in reading order, in `clone`; those naming `bucket` go to the GCS emulator at
    `emulator_url`. Returns (run, skipped); an AssertionError names the first command that failed, with its
    output."""
    ran, skipped, skipped_outputs = [], [], []
    env = walk_environment(clone) | ({"STORAGE_EMULATOR_HOST": emulator_url} if emulator_url else {})
    for page in pages_in_reading_order(clone):
        for command in page_commands(page, clone):
            command.skipped = why_not_run(command, skipped_outputs, clone, bucket)
            if command.skipped:
                skipped.append(command)
                output = written_by(command)
                # a folder an earlier command made stays readable; a bucket's is not known here
                if output and "://" not in output and not (clone / output).exists():
                    skipped_outputs.append(output)
                continue
            argv = command.words + toy_overrides(command, max_steps)
            started = time.monotonic()
            proc = subprocess.run(argv, cwd=clone, env=env | command.env, capture_output=True, text=True,
                                  timeout=timeout_s)
            command.seconds = time.monotonic() - started
            if proc.returncode != 0:
                raise AssertionError(f"{command.page}: `{command.line}` exited {proc.returncode} (run as "
                                     f"{' '.join(argv)})\nstdout:\n{proc.stdout[-3000:]}\n"
                                     f"stderr:\n{proc.stderr[-3000:]}")
            ran.append(command)
    return ran, skipped


def walk_environment(clone: Path) -> dict[str, str]:
    """The clone's code first on the path, one thread a process, nothing from the network."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NEOX_", "ACCELERATE_", "PYTEST"))
           and k not in ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS")}
    return env | {"PYTHONPATH": str(clone), "PATH": str(Path(sys.executable).parent) + os.pathsep + env["PATH"],
                  "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
                  "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def fresh_clone(dest: Path) -> Path:
    """The repository's files as a fresh clone would have them (tracked and new, nothing git ignores) with
    this test's virtual environment as its .venv, committed so that `git status` shows what a walk leaves."""
    listing = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO_ROOT,
                             capture_output=True, text=True)
    if listing.returncode != 0:
        pytest.skip("needs a git checkout (git ls-files names the repository's files)")
    listed = listing.stdout.split("\0")
    for name in filter(None, listed):
        source = REPO_ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    (dest / ".venv").symlink_to(Path(sys.prefix))
    git = ["git", "-c", "user.name=walk", "-c", "user.email=walk@localhost", "-c", "commit.gpgsign=false"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "fresh clone"]):
        subprocess.run(git + args, cwd=dest, check=True, capture_output=True)
    return dest


def left_in_the_repository(clone: Path) -> list[str]:
    """Files a walk wrote outside the folders git ignores, the reader's own files aside."""
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=clone,
                            capture_output=True, text=True, check=True).stdout.splitlines()
    return [line for line in status if line[3:].split("/")[0] not in READER_FILES]


def reader_files(clone: Path) -> None:
    """What the pages expect the reader to bring: corpus/ (text files), my-tokenizer/ (a tokenizer.json) and
    models/llama-3.2-1b/ (a downloaded Llama 3.2-shaped model at toy width: 131,072 positions, Llama 3's rope
    scaling, its tokenizer with <|end_of_text|>)."""
    from dataclasses import replace

    from configs import get_model_spec
    from utils.data.demo import read_stdlib_corpus, train_tokenizer
    from utils.model.families import family
    from utils.model.hf import quiet_progress

    _, texts = read_stdlib_corpus(400_000)
    (clone / "corpus").mkdir()
    for k, text in enumerate(texts):
        (clone / "corpus" / f"doc-{k:03d}.txt").write_text(text)
    tokenizer = train_tokenizer(texts, 1024)
    (clone / "my-tokenizer").mkdir()
    tokenizer.save(str(clone / "my-tokenizer" / "tokenizer.json"))
    tokenizer.add_special_tokens(["<|end_of_text|>"])
    model = clone / "models" / "llama-3.2-1b"
    spec = replace(get_model_spec("llama-tiny"), vocab_size=tokenizer.get_vocab_size(),
                   max_position_embeddings=131072, rope_scaling=(32.0, 1.0, 4.0, 8192))
    fam = family("llama")
    with quiet_progress():
        fam.hf().causal_lm_class(spec)(fam.hf().hf_config(spec)).save_pretrained(model)
    tokenizer.save(str(model / "tokenizer.json"))
