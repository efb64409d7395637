"""The architecture a run builds: the `model` preset, or with `init_from` the HF directory's own, with the
vocabulary a prepared dataset's tokenizer sets (its dataset.json), and the length it trains at (`seq_len`, or
`configs.training_config.default_seq_len`: said in one line where it is shorter than the model's positions)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from configs import get_model_spec
from configs.training_config import check_seq_len, default_seq_len
from utils.data.dataset_info import DatasetInfo
from utils.errors import UserError
from utils.model.families import family_of
from utils.model.hf import check_weights, load_hf_pretrained
from utils.settings import Settings


@dataclass(frozen=True)
class ModelSettings(Settings):
    """Which architecture a run builds: a preset by name, or init_from's; and the sequence length."""

    model: str
    init_from: str
    seq_len: int


def resolve_model_spec(settings: ModelSettings, described: Path, log):
    """(architecture, seq_len, weights to start from or None). The architecture is the `model` preset, or
    with `init_from` the HF model directory's own; a dataset.json in the data directory (prepare_data.py)
    sets the vocabulary to its tokenizer's. `described`: the folder holding the data's dataset.json
    (`utils.data.build.description_dir`)."""
    weights = None
    if settings.init_from:
        spec, weights = load_hf_pretrained(settings.init_from, say=log.warning if log.is_main else lambda line: None)
        check_weights(spec, weights, settings.init_from)
        log.info(f"init_from {settings.init_from}: architecture from its config.json (hidden {spec.hidden_size}, "
                 f"{spec.num_hidden_layers} layers, vocab {spec.vocab_size}); the model field ('{settings.model}') is "
                 f"ignored; a fresh run starts from these weights with a new optimizer and schedule (with "
                 f"--resume, the checkpoint's weights, optimizer and schedule are restored instead)")
    else:
        spec = get_model_spec(settings.model)
    info = DatasetInfo.load(described)
    if info is not None and settings.init_from:
        if info.vocab_size > spec.padded_vocab_size:
            raise UserError(f"{info.path}: its tokenizer has {info.vocab_size:,} ids but the init_from model "
                            f"{settings.init_from} has {spec.padded_vocab_size:,} embedding rows; prepare the data "
                            f"with that model's tokenizer")
        # ids are checked against the tokenizer's size; the embedding keeps the model's own rows
        spec = replace(spec, vocab_size=info.vocab_size, pad_vocab_multiple=spec.padded_vocab_size)
    elif info is not None and info.vocab_size != spec.vocab_size:
        log.info(f"vocabulary from {info.path}: {info.vocab_size:,} token ids (model '{spec.name}' had "
                 f"{spec.vocab_size:,}); {replace(spec, vocab_size=info.vocab_size).padded_vocab_size:,} "
                 f"embedding rows")
        spec = replace(spec, vocab_size=info.vocab_size)
    check_seq_len(settings.seq_len, spec)
    family_of(spec).validate(spec)
    refusal = family_of(spec).hf().export_refusal(spec)
    if refusal:
        raise UserError(refusal)
    length, why = (settings.seq_len, "") if settings.seq_len else default_seq_len(spec)
    if length < spec.max_position_embeddings and not settings.seq_len:
        scaling = " and the rope scaling" if spec.rope_scaling else ""
        log.info(f"seq_len not set: training at {length:,} tokens a sequence ({why}); final_model/ keeps all "
                 f"{spec.max_position_embeddings:,} positions{scaling}; --set seq_len=N trains at another length")
    return spec, length, weights
