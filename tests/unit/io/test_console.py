"""utils/io/console.py's progress bar off a terminal (a file, Slurm, CI): none of its own, nor transformers'
(an export's, an evaluation's), whether transformers is imported before the bar or after it."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.trainkit import REPO_ROOT

BAR = "from utils.io.console import progress_bar; bar = progress_bar(5, 0, is_main=True)\n"
ASK = ("from transformers.utils import logging\n"
       "print(loaded, bar.disable, logging.is_progress_bar_enabled())\n")


@pytest.mark.parametrize("before, expected", [
    ("", "False True False"),  # transformers is not imported for the bar (half a second of a run's start)
    ("import transformers\n", "True True False"),
])
def test_off_a_terminal_there_is_no_bar_and_transformers_shows_none(before, expected, subprocess_env):
    code = before + BAR + "import sys; loaded = 'transformers' in sys.modules\n" + ASK
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=subprocess_env, capture_output=True,
                          text=True, timeout=120)  # stderr is a pipe: not a terminal
    assert proc.returncode == 0 and proc.stdout.split("\n")[-2] == expected, proc.stderr[-2000:]
