"""The default source type, "shards": a folder of `.npz` token shards (prepare_data.py's output, a download
of it, or the demo's build) read as a TokenSequenceDataset. Opening it indexes the folder (validated once,
cached), builds the demo's data into an empty `data_dir` under the demo preset, and splits off validation:
the dataset.json's own split by documents where there is one, else the last `val_files` files."""
from __future__ import annotations

from pathlib import Path

from utils.data.dataset import TokenSequenceDataset
from utils.data.dataset_info import DatasetInfo
from utils.data.demo import build_demo_data
from utils.data.demo import is_built as is_demo_build
from utils.data.index import DataDirError, ShardIndex
from utils.data.source import DEFAULT_SOURCE, OpenRequest, Source, SourceType


def open_shards(source: Source, request: OpenRequest) -> tuple[TokenSequenceDataset, TokenSequenceDataset]:
    """(training, validation) sequences of a shard folder."""
    info = DatasetInfo.load(source.path)
    val_paths = info.val_paths if info is not None else []
    # a demo build is re-checked (it refuses another vocab or seq_len); a folder of the user's shards is used as is
    if request.build_demo and (is_demo_build(source.path) or not any(source.path.rglob("*.npz"))):
        build_demo_data(source.path, vocab_size=request.vocab_size, seq_len=request.seq_len, log=request.log)
    index = ShardIndex.build(source.path, seq_len=request.seq_len, vocab_size=request.vocab_size,
                             max_files=-1 if val_paths else request.max_files, log=request.log)
    if val_paths:  # prepare_data.py's validation split by documents (val_files then does not apply)
        train, val = index.split_paths(val_paths, request.max_files)
        request.log(f"data: validation{'' if source.name == DEFAULT_SOURCE else ' of ' + source.name} on the "
                    f"{len(val_paths)} shard(s) of {info.path.name}'s split "
                    f"({info.raw['validation']['documents']:,} documents); val_files does not apply")
    else:
        train, val = index.split(source.val_files)
    _check_learnable(source, train, info)
    return TokenSequenceDataset(train), TokenSequenceDataset(val)


def _check_learnable(source: Source, train: ShardIndex, info: DatasetInfo | None) -> None:
    """Training shards whose every token is one id (the index's min and max ids, from its cached scan: no read)
    hold nothing to learn: only end-of-document tokens, say (documents with no text between them). Refused
    before step 1, where it trained to a zero loss and exported without a word."""
    ids = {i for layout in train.layouts.values() for i in (layout.min_id, layout.max_id)}
    if len(ids) != 1:
        return
    (token,) = ids
    what = " (the end-of-document token)" if info is not None and token == info.eos_id else ""
    raise DataDirError(f"{source.path}: every token of its {len(train)} training shard(s) is id {token}{what}: there "
                       f"is nothing to learn; prepare the data again from a corpus with text")


SHARDS = SourceType("shards", handles=lambda source: isinstance(source.path, Path), open=open_shards)
