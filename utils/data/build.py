"""Building a run's data: its sources, opened by their types, this rank's resumable loader over them and its
eval batches per source (what train.py asks for in one call), and where the data's dataset.json and
tokenizer.json are on this machine (`description_dir`: what sizes the vocabulary, samples and exports).

`SOURCE_TYPES` is the registration of source types (utils/data/source.py): the first whose `handles`
accepts a configured source opens it. A new type is a module defining its SourceType plus its line here.
"""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from utils.data.dataset_info import DatasetInfo, end_of_document_id
from utils.data.loader import EvalBatches, Readers, ResumableLoader, build_eval_batches
from utils.data.mixture import Shuffle, check_sources
from utils.data.shard_source import SHARDS
from utils.data.source import (DEFAULT_SOURCE, CacheBudget, DataSettings, OpenRequest, SequenceSource, Source,
                               SourceType, configured_sources, location)
from utils.data.stream_source import STREAM
from utils.runtime.distributed import main_process_first
from utils.errors import UserError

SOURCE_TYPES: list[SourceType] = [STREAM, SHARDS]


def source_type(source: Source) -> SourceType:
    for kind in SOURCE_TYPES:
        if kind.handles(source):
            return kind
    raise UserError(f"data source {source.name} ({source.path}): no source type reads it "
                    f"(known: {', '.join(t.name for t in SOURCE_TYPES)})")


def open_source(source: Source, request: OpenRequest) -> tuple[SequenceSource, SequenceSource | None]:
    """(training, validation) sequences of `source`, by the first registered type that handles it."""
    return source_type(source).open(source, request)


def description_dir(settings: DataSettings, path: str | None = None) -> Path:
    """The local folder holding the dataset.json and tokenizer.json of `data_dir` (or of `path`, a source's):
    the shard folder itself, or where a gs:// dataset's were fetched (under data_cache_dir)."""
    source = Source(DEFAULT_SOURCE, path=location(path or settings.data_dir))
    return source_type(source).description_dir(source, settings.data_cache_dir)


def build_data(settings: DataSettings, seq_len: int, vocab_size: int, accelerator,
               log) -> tuple[ResumableLoader, EvalBatches]:
    """Every source opened (rank 0 first: it builds the demo data and the shard caches the others reuse),
    this rank's loader over the mixture (`data_dir` alone is the one source `data`) and its eval batches."""
    rank, world = accelerator.process_index, accelerator.num_processes
    batch, cache_dir = settings.per_device_train_batch_size, settings.data_cache_dir
    sources = configured_sources(settings)
    if settings.data_mix:
        infos = {s.name: DatasetInfo.load(source_type(s).description_dir(s, cache_dir)) for s in sources}
        check_sources(sources, infos, log.warning if accelerator.is_main_process else lambda _line: None,
                      demo_data=settings.demo_data)
    shuffle = Shuffle(settings.shuffle, settings.shuffle_block_shards)
    request = OpenRequest(seq_len, vocab_size, settings.max_files,
                          build_demo=settings.demo_data and not settings.data_mix, log=log.info, rank=rank,
                          shuffle=shuffle, cache_dir=cache_dir,
                          step_sequences=batch * settings.gradient_accumulation_steps * world,
                          cache=CacheBudget(settings.data_cache_gb, int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    opened = main_process_first(accelerator, lambda: [open_source(s, request) for s in sources])
    val_batches = {s.name: (build_eval_batches(val, batch, rank, world, settings.eval_batches)
                            if val is not None and len(val) else [])
                   for s, (_, val) in zip(sources, opened)}
    loader = ResumableLoader([replace(s, data=train) for s, (train, _) in zip(sources, opened)],
                             batch, rank=rank, world_size=world, seed=settings.seed,
                             readers=Readers(settings.dataloader_num_workers, settings.prefetch_factor,
                                             pin_memory=accelerator.device.type == "cuda"),
                             log=log.info, shuffle=shuffle)
    return loader, EvalBatches(val_batches, {s.name: s.weight for s in sources})


def end_of_document(settings: DataSettings, vocab_size: int | None = None) -> int:
    """attention=document: the id documents end with, from `eos_id` or the data; within the model's
    vocabulary (`vocab_size`) when given."""
    eos = settings.eos_id if settings.eos_id >= 0 else end_of_document_id(
        description_dir(settings, str(s.path)) for s in configured_sources(settings))
    if eos is None:
        raise UserError(f"attention=document needs the id documents end with, and {settings.data_dir} has no "
                        f"dataset.json (prepare_data.py writes one): set it with --set eos_id=N")
    if type(eos) is not int or vocab_size is not None and not 0 <= eos < vocab_size:
        where = "eos_id" if settings.eos_id >= 0 else f"the end-of-document id {settings.data_dir} records"
        raise UserError(f"{where} is {eos!r}, not a token id of the model's vocabulary (0 to {vocab_size - 1}"
                        f" with vocab_size {vocab_size}); set eos_id to the id your documents end with")
    return eos
