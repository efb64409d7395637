"""Samples during training: every `sample_every` optimizer steps, rank 0 continues `sample_prompts` with the
model being trained, and the text goes to logs/samples.jsonl, the log and TensorBoard's text tab. A sharded
model (strategy=fsdp) runs only with every rank: then all ranks generate the same tokens in step (the same
seeded generator, the same logits) and rank 0 alone writes them.

The model is run as it is (no KV cache: a handful of short continuations), one prompt at a time (no
padding to get wrong), sampled at temperature 0.8 from the 50 likeliest tokens with a generator of its own,
seeded from (seed, step): the training's RNG streams are untouched, so a run with samples trains exactly
as one without. The tokenizer is the data's (its `dataset.json` names EOS, where generation stops)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from utils.settings import Settings

TEMPERATURE = 0.8
TOP_K = 50


@dataclass(frozen=True)
class SampleSettings(Settings):
    sample_every: int
    sample_prompts: list[str]
    sample_max_new_tokens: int
    seed: int


class Sampler:
    def __init__(self, settings: SampleSettings, data_dir, seq_len: int, accelerator, log, sharded: bool = False):
        every = settings.sample_every
        self.every, self.prompts, self.max_new_tokens = (every, list(settings.sample_prompts),
                                                         settings.sample_max_new_tokens)
        self.seq_len, self.seed, self.accelerator, self.log = seq_len, settings.seed, accelerator, log
        self.tokenizer = self.eos_id = None
        self.participates = accelerator.is_main_process or sharded
        if every and self.participates:
            from utils.model.hf import ExportTokenizer

            found = ExportTokenizer.find(Path(data_dir).expanduser())
            if found is None:
                if accelerator.is_main_process:
                    log.warning(f"sample_every={every}: no tokenizer.json in {data_dir}; samples are off for this run")
                self.every = 0
            else:
                self.tokenizer = found.tokenizer
                self.eos_id = self.tokenizer.token_to_id(found.eos) if found.eos else None

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def sample(self, model, step: int, tokens: int) -> float:
        """Writes the samples at `step` (rank 0; the others go on unless the model is sharded); returns the
        seconds it took, which the caller keeps out of tokens/s."""
        if not self.participates:
            return 0.0
        started = time.perf_counter()
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        was_training = model.training
        model.eval()
        try:
            texts = [self._continue(model, prompt, generator) for prompt in self.prompts]
        finally:
            model.train(was_training)
        if self.accelerator.is_main_process:
            self.log.write_samples(step, tokens, list(zip(self.prompts, texts)))
        return time.perf_counter() - started

    @torch.no_grad()
    def _continue(self, model, prompt: str, generator: torch.Generator) -> str:
        device = self.accelerator.device
        ids = self.tokenizer.encode(prompt, add_special_tokens=False).ids or [self.eos_id or 0]
        ids = torch.tensor([ids], device=device)
        new: list[int] = []
        for _ in range(self.max_new_tokens):
            with self.accelerator.autocast():
                logits = model.logits(ids[:, -self.seq_len:])[0, -1].float().cpu()
            logits = logits[: self.tokenizer.get_vocab_size()] / TEMPERATURE  # no padding rows
            top = torch.topk(logits, min(TOP_K, logits.numel()))
            token = int(top.indices[torch.multinomial(torch.softmax(top.values, -1), 1, generator=generator)])
            if token == self.eos_id:
                break
            new.append(token)
            ids = torch.cat([ids, torch.tensor([[token]], device=device)], dim=1)
        return self.tokenizer.decode(new)
