"""The data-source seam (utils/data/source.py): a source type defined here, in memory, trains through the
engine's loader and mixes with the `.npz` shard source; its cursor resumes exactly; a registered type is
the one that opens the sources it handles."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from configs import get_model_spec
from tests.trainkit import make_shards
from utils.data import build
from utils.data.dataset import TokenSequenceDataset
from utils.data.index import ShardIndex
from utils.data.loader import ResumableLoader
from utils.data.source import OpenRequest, SequenceSource, Source, SourceType
from utils.model import build_model

SEQ, VOCAB = 32, 512


class InMemorySource:
    """Sequences held in one numpy array, `per_file` of them counting as a file."""

    def __init__(self, tokens: np.ndarray, per_file: int = 8):
        self.tokens, self.seq_len, self.per_file = tokens, tokens.shape[1], per_file

    def __len__(self) -> int:
        return len(self.tokens)

    def get_batch(self, indices, dtype=np.int64) -> np.ndarray:
        return self.tokens[np.asarray(indices, dtype=np.int64)].astype(dtype)

    @property
    def wire_dtype(self) -> np.dtype:
        return np.dtype(np.uint16)

    def fingerprint(self) -> dict:
        return {"sha256": hashlib.sha256(self.tokens.tobytes()).hexdigest()}

    def files_consumed(self, sequences: int) -> int:
        return sequences // self.per_file

    def file_sequences(self) -> np.ndarray:
        return np.diff(np.r_[0:len(self.tokens):self.per_file, len(self.tokens)])

    def describe(self) -> str:
        return "memory"


def counting_runs(n: int, seed: int) -> np.ndarray:
    """Learnable sequences: runs t, t+1, ... mod VOCAB from random starts."""
    starts = np.random.default_rng(seed).integers(0, VOCAB, size=(n, 1))
    return ((starts + np.arange(SEQ)) % VOCAB).astype(np.uint16)


def test_an_in_memory_source_trains_through_the_loader_and_resumes_exactly():
    source = InMemorySource(counting_runs(64, seed=0))
    assert isinstance(source, SequenceSource)
    loader = ResumableLoader(source, 4, rank=0, world_size=1, seed=5)
    model = build_model(get_model_spec("tiny"), seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = model(next(loader))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.75 * sum(losses[:5]) / 5  # it learns the runs
    assert loader.files_consumed() == 30 * 4 // 8 and loader.epoch == 1
    state = loader.state_dict()
    ahead = [next(loader) for _ in range(3)]
    resumed = ResumableLoader(InMemorySource(counting_runs(64, seed=0)), 4, rank=0, world_size=1, seed=5)
    resumed.load_state_dict(state)
    assert all(torch.equal(a, next(resumed)) for a in ahead)
    # other sequences: the run record's fingerprint differs (the Checkpointer refuses that resume) ...
    changed = ResumableLoader(InMemorySource(counting_runs(64, seed=1)), 4, rank=0, world_size=1, seed=5)
    assert changed.fingerprint() != loader.fingerprint() == resumed.fingerprint()
    # ... and another count of them is refused by the cursor itself
    with pytest.raises(ValueError, match="the data changed since the checkpoint"):
        ResumableLoader(InMemorySource(counting_runs(65, seed=0)), 4, rank=0, world_size=1,
                        seed=5).load_state_dict(state)


def test_an_in_memory_source_mixes_with_npz_shards_and_two_ranks_split_the_stream(tmp_path):
    shards = TokenSequenceDataset(ShardIndex.build(make_shards(tmp_path / "data", seq_len=SEQ), SEQ, VOCAB,
                                                   log=lambda *_: None))
    memory = InMemorySource(counting_runs(40, seed=2))
    mix = [Source("shards", 0.75, data=shards), Source("memory", 0.25, data=memory)]
    one = ResumableLoader(mix, 4, 0, 1, seed=3)
    ranks = [ResumableLoader(mix, 2, r, 2, seed=3) for r in (0, 1)]
    for _ in range(5):
        assert torch.equal(next(one), torch.cat([next(r) for r in ranks]))
    assert one.consumed == {"shards": 15, "memory": 5}
    assert any("in memory, weight 0.25" in line for line in one.describe(10, 4))


def test_a_registered_source_type_opens_the_sources_it_handles(monkeypatch, tmp_path):
    opened = []

    def open_memory(source: Source, request: OpenRequest):
        opened.append((source.name, request.seq_len))
        return InMemorySource(counting_runs(16, seed=0)), None

    memory = SourceType("memory", handles=lambda s: s.name.startswith("mem"), open=open_memory)
    monkeypatch.setattr(build, "SOURCE_TYPES", [memory, *build.SOURCE_TYPES])
    request = OpenRequest(SEQ, VOCAB, log=lambda *_: None)
    train, val = build.open_source(Source("mem-a", path=tmp_path), request)
    assert isinstance(train, InMemorySource) and val is None and opened == [("mem-a", SEQ)]
    train, val = build.open_source(Source("web", path=make_shards(tmp_path / "web", seq_len=SEQ), val_files=1),
                                   request)
    assert isinstance(train, TokenSequenceDataset) and len(val) > 0  # the shard type, as before
