"""What a run carries from one step to the next, besides the model and optimizer: `TrainState` (step,
tokens, best loss) and `RngState` (this process's random generators). Both have `state_dict` /
`load_state_dict`, so a checkpoint is "save every stateful thing" and resume is its mirror."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done
    tokens: int = 0  # tokens trained on, all ranks together
    best_loss: float = math.inf  # lowest logged training loss (a window mean over ranks)

    def advance(self, tokens: int) -> None:
        self.step += 1
        self.tokens += tokens

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens": self.tokens, "best_loss": self.best_loss}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.tokens = int(state["step"]), int(state["tokens"])
        self.best_loss = float(state.get("best_loss", math.inf))


class RngState:
    """Python's, numpy's, torch's and (where present) CUDA's generators of this process."""

    @staticmethod
    def seed(seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)

    @staticmethod
    def state_dict() -> dict:
        state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    @staticmethod
    def load_state_dict(state: dict) -> None:
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
