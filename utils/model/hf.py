"""HF weights in and out, in one place, for every model family (utils/model/families.py; each family's
hf.py holds its config and key adapter both ways).

In: `load_hf_pretrained(DIR)` reads an HF directory of a registered family (utils/model/families.py) on disk
(config.json + model.safetensors, or a sharded model.safetensors.index.json; older models' pytorch_model.bin, single or
sharded, loaded with `torch.load(weights_only=True)`), e.g. a Pythia or Llama checkpoint, into a ModelSpec and a state
dict with the engine's names (the family's adapter). Out: `export_hf(state, spec, DIR)` writes through transformers'
own class of the family (`save_pretrained`), so `AutoModelForCausalLM.from_pretrained(DIR)` loads it;
`scripts/export_hf.py` does it for any engine checkpoint.
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from utils.data.tokenizer import TokenizerError
from utils.errors import ConfigError
from utils.io import files
from utils.model.architecture import ModelSpec

EXPORT_SHARD_SIZE = "5GB"  # larger exports are sharded safetensors with an index json, as transformers writes them
# What an export's tokenizer_config.json names: the tokenizer that reads tokenizer.json as it is, in transformers 4
# and 5 (transformers 5 writes its own "TokenizersBackend", which transformers 4 cannot load).
EXPORT_TOKENIZER_CLASS = "PreTrainedTokenizerFast"
# Other tokenizers' files, which transformers would read beside tokenizer.json: an export that writes a tokenizer
# removes them, so none of another tokenizer's (an earlier export's, an init_from model's) stays beside it.
FOREIGN_TOKENIZER_FILES = ("vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "added_tokens.json",
                           "special_tokens_map.json")
# Where an export also puts the tokenizer alone when transformers' AutoTokenizer would load the model directory
# with a class of its own (it picks one by config.json's model_type: Qwen2Tokenizer for qwen2, whatever
# tokenizer_config.json names), which encodes differently from the tokenizer the model was trained with.
TOKENIZER_ALONE = "tokenizer"
# Text that tells tokenizers apart: digits (Qwen2's splits numbers digit by digit), spaces, newlines, accents, CJK.
PROBE_TEXT = ("In 2024, 12,345.67 units cost $1,999 (x=1e-5; don't)\n\tcafé naïve 東京 -- done!  ok\n"
              "def f(a, b):\n    return a**2 + b//3  # 100%")


class HFLoadError(ConfigError):
    """An HF directory (init_from, generate.py's PATH) that is not a usable model; the message names
    the file."""


def load_hf_pretrained(directory, option: str = "init_from", say=None) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """(architecture, weights with the engine's names) from an HF model directory, as transformers loads it:
    the architecture from what its config class makes of config.json, the tensors as `from_pretrained` ties or
    unties them (`tied_as_transformers_loads`; `say`, default stderr, gets the line where that differs from the
    file's config). Errors name `option` (what the user gave the directory as: init_from, or nothing for
    generate.py's PATH) and the file."""
    import pickle

    from safetensors.torch import load_file

    where = f"{option} " if option else ""
    directory = Path(directory).expanduser()
    config_path = directory / "config.json"
    if config_path.is_symlink() or config_path.exists():
        _check_inside(directory, "config.json", f"{where}{directory}: its config is")
    try:
        config = files.parse_json(config_path.read_text())
    except FileNotFoundError:
        raise HFLoadError(f"{where}{directory}: no config.json there; give an HF model directory "
                          f"(config.json + model.safetensors)") from None
    except (OSError, ValueError) as exc:
        raise HFLoadError(f"{where}{config_path}: cannot read it ({exc})") from None
    spec = spec_from_hf_config(config, name=directory.name, source=str(config_path))
    state = {}
    shards = _weight_files(directory, where)
    check_weights_hold(spec, shards, where, config_path)
    for shard in shards:
        try:
            if shard.name.endswith(".safetensors"):
                state |= load_file(str(shard))
            else:  # older checkpoints (e.g. early Pythia revisions) ship only pickled torch files
                state |= torch.load(shard, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            raise HFLoadError(f"{where}{shard}: cannot read it (it holds more than tensors, and unpickling that could "
                              f"run code; convert it to model.safetensors where you trust it)") from None
        except Exception as exc:  # noqa: BLE001 - any reader failure on a bad file is one line
            # safetensors / torch raise their own error types for truncated or foreign files
            raise HFLoadError(f"{where}{shard}: cannot read it "
                              f"({str(exc).splitlines()[0] if str(exc) else exc!r})") from None
    return tied_as_transformers_loads(spec, family_of(spec).hf().from_hf_state(state), f"{where}{directory}",
                                      say or _warn_on_stderr)


HEAD = "lm_head.weight"  # the LM head's weight in the engine's names, every family's


def tied_as_transformers_loads(spec: ModelSpec, state: dict[str, torch.Tensor], source: str,
                               say) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """A tied config's weights as transformers' `from_pretrained` ties them: a head without its embedding is
    both (the embedding taken from it), a head equal to the embedding is the embedding, and a head that differs
    is kept apart: the model is untied, as the one transformers loads (and exported so, with
    `tie_word_embeddings` false), said in one `say` line."""
    if not spec.tie_word_embeddings or HEAD not in state:
        return spec, state
    from utils.model import build_model

    with torch.device("meta"):
        model = build_model(spec, seed=0)
    embedding = next(name for name, p in model.named_parameters() if p is model.input_embedding().weight)
    state = dict(state)
    if embedding not in state:
        state[embedding] = state.pop(HEAD)
    elif state[embedding].shape == state[HEAD].shape and torch.equal(state[embedding], state[HEAD]):
        del state[HEAD]
    else:
        spec = replace(spec, tie_word_embeddings=False)
        say(f"warning: {source}: config.json ties the head to the embedding (tie_word_embeddings) but the weights "
            f"hold an {HEAD} of its own; as transformers loads it, the two stay apart: this model is untied "
            f"(and exports with tie_word_embeddings false)")
    return spec, state


def spec_from_hf_config(config: dict, name: str, source: str = "config.json") -> ModelSpec:
    """The architecture of an HF config.json, read by the family that claims its `model_type`."""
    from utils.model.families import family_for_hf_config

    if not isinstance(config, dict):
        raise ConfigError(f"{source}: not a JSON object")
    check_hf_config(config, source)
    fam = family_for_hf_config(config, source)
    if config.get("auto_map"):
        raise ConfigError(f"{source}: names code of its own (auto_map); only transformers' own model classes are "
                          f"loaded, and no code from a model directory is run")
    return fam.hf().spec_from_hf_config(config, name, source)


_HF_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
             "max_position_embeddings")
_HF_MAX_SIZE = 2**31  # beyond any model's vocabulary, width, depth or context
_HF_POSITIVE_NUMBERS = ("layer_norm_eps", "rms_norm_eps", "rope_theta", "rotary_emb_base", "initializer_range",
                        "rope_local_base_freq", "query_pre_attn_scalar", "final_logit_softcapping",
                        "attn_logit_softcapping")
_HF_ROPE_NUMBERS = ("rope_theta", "factor", "low_freq_factor", "high_freq_factor")  # of each rope object
_HF_FLAGS = ("use_parallel_residual", "attention_bias", "tie_word_embeddings", "mlp_bias", "use_sliding_window",
             "use_bidirectional_attention")
_HF_LAYER_TYPES = ("full_attention", "sliding_attention")


def check_hf_config(config: dict, source: str) -> None:
    """An HF config.json's values (the directory may come from a bucket, or be crafted) before a family reads
    them: the sizes positive integers (a JSON number, not a string or 1.5) below 2**31, hidden_size divisible
    by num_attention_heads where no head_dim is given, num_attention_heads by num_key_value_heads, head_dim,
    sliding_window and sliding_window_pattern positive integers, max_window_layers a non-negative one,
    layer_types one known kind per layer, at least 2 positions, norms' eps,
    rotary bases, rope scaling factors, scalars and initializer_range positive finite numbers, the rotary share
    in (0, 1], flags true/false, activations strings, BOS and EOS ids inside the vocabulary. ConfigError naming
    the file and field."""
    import math

    _check_hf_sizes(config, source)
    rope = _check_hf_rope(config, source)
    numbers = [(f, config[f]) for f in _HF_POSITIVE_NUMBERS if config.get(f) is not None]
    for field, value in numbers:
        if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
            _bad_hf(source, field, value, "a positive finite number")
    for field, value in (("rotary_pct", config.get("rotary_pct")),
                         ("partial_rotary_factor",
                          rope.get("partial_rotary_factor", config.get("partial_rotary_factor")))):
        if value is not None and (type(value) not in (int, float) or not 0 < value <= 1):
            _bad_hf(source, field, value, "a number in (0, 1]")
    for field in _HF_FLAGS:
        if config.get(field) is not None and not isinstance(config[field], bool):
            _bad_hf(source, field, config[field], "true or false")
    for field in ("hidden_act", "hidden_activation"):
        if config.get(field) is not None and not isinstance(config[field], str):
            _bad_hf(source, field, config[field], "a string")
    for field in ("bos_token_id", "eos_token_id"):  # (pad_token_id: some published configs say -1 or null)
        value = config.get(field)
        for token in value if isinstance(value, list) else [value]:
            if token is not None and (type(token) is not int or not 0 <= token < config["vocab_size"]):
                _bad_hf(source, field, value, f"a token id below vocab_size ({config['vocab_size']:,})")


def _bad_hf(source: str, field: str, value, want: str):
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    raise ConfigError(f"{source}: {field} is {shown}, not {want}; the model directory is corrupt or not an "
                      f"HF model's: download it again")


def _hf_size(source: str, field: str, value) -> None:
    if type(value) is not int or not 1 <= value < _HF_MAX_SIZE:
        _bad_hf(source, field, value, f"a positive integer below {_HF_MAX_SIZE:,}")


def _check_hf_sizes(config: dict, source: str) -> None:
    """The sizes, the heads against the width and each other, the layer kinds."""
    for field in _HF_SIZES:
        if field not in config:
            raise ConfigError(f"{source}: {field} is missing; an HF model's config.json names it")
        _hf_size(source, field, config[field])
    for field in ("num_key_value_heads", "head_dim", "sliding_window", "sliding_window_pattern"):
        if config.get(field) is not None:
            _hf_size(source, field, config[field])
    layers = config.get("max_window_layers")  # the layers below it attend fully: 0 makes every layer slide
    if layers is not None and (type(layers) is not int or not 0 <= layers < _HF_MAX_SIZE):
        _bad_hf(source, "max_window_layers", layers, f"an integer of at least 0, below {_HF_MAX_SIZE:,}")
    if config["max_position_embeddings"] < 2:  # one position has no next token to predict
        _bad_hf(source, "max_position_embeddings", config["max_position_embeddings"], "at least 2")
    heads = config["num_attention_heads"]
    if config.get("head_dim") is None and config["hidden_size"] % heads:
        _bad_hf(source, "hidden_size", config["hidden_size"], f"a multiple of num_attention_heads ({heads})")
    kinds = config.get("layer_types")
    if kinds is not None and (not isinstance(kinds, list) or len(kinds) != config["num_hidden_layers"]
                              or any(kind not in _HF_LAYER_TYPES for kind in kinds)):
        _bad_hf(source, "layer_types", kinds,
                f"a list of {config['num_hidden_layers']} of {', '.join(_HF_LAYER_TYPES)}")
    if config.get("num_key_value_heads") and heads % config["num_key_value_heads"]:
        _bad_hf(source, "num_attention_heads", heads,
                f"a multiple of num_key_value_heads ({config['num_key_value_heads']})")


def _check_hf_rope(config: dict, source: str) -> dict:
    """The rope objects, `rope_parameters` and `rope_scaling` (transformers reads the second over the first where
    both are given): each one, or one per layer kind (transformers 5 writes one per kind for models with
    several, Gemma 3); their factors and bases positive finite numbers, their original positions a size.
    Returns the one transformers reads."""
    import math

    for rope_field in ("rope_parameters", "rope_scaling"):
        rope = config.get(rope_field) or {}
        if not isinstance(rope, dict):
            _bad_hf(source, rope_field, rope, "an object")
        ropes = {"": rope}
        for kind in _HF_LAYER_TYPES:
            if kind in rope:
                if not isinstance(rope[kind], dict):
                    _bad_hf(source, f"{rope_field}.{kind}", rope[kind], "an object")
                ropes = ropes | {f"{kind}.": rope[kind]}
        for kind, r in ropes.items():
            if r.get("original_max_position_embeddings") is not None:
                _hf_size(source, f"{rope_field}.{kind}original_max_position_embeddings",
                         r["original_max_position_embeddings"])
            for f in _HF_ROPE_NUMBERS:
                value = r.get(f)
                if value is not None and (type(value) not in (int, float) or not math.isfinite(value) or value <= 0):
                    _bad_hf(source, f"{rope_field}.{kind}{f}", value, "a positive finite number")
    return config.get("rope_scaling") or config.get("rope_parameters") or {}


def check_weights_hold(spec: ModelSpec, shards: list[Path], where: str, config_path: Path) -> None:
    """The config's shape has no more parameters than its weight files have bytes (a byte a parameter is
    the least any saved precision takes): a crafted shape would have generate.py or the export allocate it."""
    parameters = spec.vocab_size * spec.hidden_size + spec.num_hidden_layers * family_of(spec).block_parameters(spec)
    held = sum(p.stat().st_size for p in shards)
    if parameters > held + 2**20:
        raise HFLoadError(f"{where}{config_path}: its shape (hidden_size {spec.hidden_size:,}, "
                          f"{spec.num_hidden_layers:,} layers, vocab_size {spec.vocab_size:,}) has {parameters:,} "
                          f"parameters, more than its weight files' {held:,} bytes hold; the model directory is "
                          f"corrupt or crafted")


def family_of(spec: ModelSpec):
    from utils.model.families import family_of as _family_of

    return _family_of(spec)


def _weight_files(directory: Path, where: str) -> list[Path]:
    """The weight files of an HF directory: model.safetensors, its sharded index, or (older models)
    pytorch_model.bin or its sharded index, in that order of preference."""
    for single, index_name in (("model.safetensors", "model.safetensors.index.json"),
                               ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        if (directory / single).is_file():
            _check_inside(directory, single, f"{where}{directory}: its weight file is")
            return [directory / single]
        index = directory / index_name
        if index.is_file():
            try:
                named = sorted(set(files.parse_json(index.read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise HFLoadError(f"{where}{index}: unreadable shard index ({exc})") from None
            for rel in named:
                _check_inside(directory, rel, f"{where}{index}: weight_map names")
            shards = [directory / rel for rel in named]
            missing = [p.name for p in shards if not p.is_file()]
            if missing:
                raise HFLoadError(f"{where}{index}: lists {missing[0]}, which is not there; download every shard")
            return shards
    other = sorted(p.name for p in directory.iterdir() if p.is_file() and p.name != "config.json") or ["nothing else"]
    raise HFLoadError(f"{where}{directory}: no weights (model.safetensors, pytorch_model.bin or their sharded "
                      f"index .json; found {', '.join(other[:5])}); give a complete HF model directory")


def _check_inside(directory: Path, rel, what: str) -> None:
    """A file of an HF directory (its config.json, a weight file its index names) stays in the directory: a
    file name (a string without NUL), relative without '..', and no symlink out of it, except into the hub
    cache's blobs/ beside snapshots/ (how the hub stores files)."""
    if not isinstance(rel, str) or not rel or "\0" in rel:
        raise HFLoadError(f"{what} {rel!r}, not a file name; an index names the weight files beside it")
    if Path(rel).is_absolute() or ".." in Path(rel).parts:
        raise HFLoadError(f"{what} {rel!r}, a path out of {directory} (absolute or '..'); an index names only "
                          f"the weight files beside it")
    if files.inside(directory, rel):
        return
    real = (directory / rel).resolve()
    blobs = directory.resolve().parent.parent / "blobs" if directory.resolve().parent.name == "snapshots" else None
    if blobs is None or not real.is_relative_to(blobs.resolve()):
        raise HFLoadError(f"{what} {rel!r}, a symlink out of {directory} (to {real}); a model directory's files "
                          f"are its own (or the hub cache's blobs/): copy them in (cp -L)")


def check_weights(spec: ModelSpec, state: dict[str, torch.Tensor], source, option: str = "init_from",
                  impl: str = "native", described: str = "its config.json") -> None:
    """One line naming what is missing, of the wrong shape (against `impl`'s model of `spec`), not floating point
    or not finite, before a model tries to load it."""
    from utils.model import build_model

    where = f"{option + ' ' if option else ''}{source}"
    for name, tensor in state.items():
        if not tensor.is_floating_point():
            raise HFLoadError(f"{where}: its weight {name} is {tensor.dtype}, not floating point; the weights are "
                              f"corrupt or not a model's")
        if not bool(torch.isfinite(tensor).all()):
            raise HFLoadError(f"{where}: its weight {name} holds NaN or infinite values; the weights are corrupt "
                              f"(a diverged run's, or damaged): use another checkpoint or download them again")
    with torch.device("meta"):
        expected = build_model(spec, seed=0, impl=impl).state_dict()
    if spec.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = sorted(k for k in set(expected) & set(state) if tuple(expected[k].shape) != tuple(state[k].shape))
    if missing or unexpected or wrong:
        parts = [f"missing {missing[:3]}" if missing else "", f"unexpected {unexpected[:3]}" if unexpected else "",
                 f"wrong shape {wrong[:3]}" if wrong else ""]
        raise HFLoadError(f"{where}: its weights do not match {described} (" + "; ".join(p for p in parts if p) + ")")


def to_transformers(state: dict[str, torch.Tensor], spec: ModelSpec, special_ids: dict | None = None):
    """transformers' own model class of `spec`'s family holding `state` (loaded strictly)."""
    family_of(spec).validate(spec)
    adapter = family_of(spec).hf()
    config = adapter.hf_config(spec, special_ids=special_ids)
    with torch.device("meta"):  # no time spent initialising weights that are replaced at once
        model = adapter.causal_lm_class(spec)(config)
    hf_state = adapter.to_hf_state(adapter.from_hf_state(state))
    model.load_state_dict(hf_state, strict=not spec.tie_word_embeddings, assign=True)
    adapter.finish_transformers(model, config)  # rotary buffers are not in any state dict
    if spec.tie_word_embeddings:
        model.tie_weights()
    return model


def load_checkpoint_model(checkpoint) -> tuple[ModelSpec, dict[str, torch.Tensor], dict]:
    """(architecture, weights, trainer_state) of an engine checkpoint, verified against its manifest: what
    scripts/export_hf.py and generate.py read. A sharded (FSDP) checkpoint's shards are reassembled."""
    from utils.checkpoint.format import read_checkpoint

    payload = read_checkpoint(checkpoint, objects=False)
    record = dict(payload.trainer_state.get("model") or {})
    record.pop("padded_vocab_size", None)
    try:
        spec = ModelSpec(**record)  # its fields' types and ranges: read_checkpoint checked them
    except TypeError as exc:
        raise ConfigError(f"{checkpoint}: its trainer_state.json has no usable model record ({exc})") from None
    from transformers.activations import ACT2FN

    if spec.hidden_act not in ACT2FN:
        raise ConfigError(f"checkpoint {checkpoint}: trainer_state.json: model.hidden_act is {spec.hidden_act[:80]!r}, "
                          f"not an activation transformers knows; the checkpoint is corrupt or crafted")
    weights = payload.model_state
    if weights is None:  # sharded (strategy=fsdp): every rank's shards, reassembled in this process
        from utils.checkpoint.sharded import read_full_model_state

        weights = read_full_model_state(checkpoint)
    from configs.training_config import recorded_settings

    config = payload.trainer_state.get("config") or {}  # checked by read_checkpoint
    impl = recorded_settings(config, "config")["model_impl"] if config else "native"  # the model it was trained as
    check_weights(spec, weights, checkpoint, option="", impl=impl, described="its trainer_state.json's model record")
    return spec, weights, payload.trainer_state


@dataclass(frozen=True)
class ExportTokenizer:
    """The tokenizer a model was trained with and its special tokens, as the export writes them."""

    tokenizer: object  # tokenizers.Tokenizer (utils/data/tokenizer.py read it)
    source: Path  # where it was read: named in messages
    eos: str | None  # None: the tokenizer has no end-of-document token anyone named
    bos: str | None
    pad: str | None

    @classmethod
    def find(cls, source) -> "ExportTokenizer | None":
        """`source`: a prepared data directory (its dataset.json names the tokenizer and EOS), an HF tokenizer
        directory (tokenizer.json, or GPT-2's vocab.json + merges.txt), a directory holding tokenizer.json (a
        checkpoint), or a tokenizer.json; None when there is no tokenizer there, a TokenizerError when the one
        there cannot be read. EOS: dataset.json's, else the tokenizer's own (prepare_data.py's rule); BOS:
        tokenizer_config.json's, else EOS (GPT-2/GPT-NeoX use one token for both); padding: the tokenizer's
        own pad token, else EOS."""
        from utils.data.dataset_info import DatasetInfo
        from utils.data.tokenizer import read_tokenizer

        source = Path(source).expanduser()
        eos = None
        if source.is_dir():
            info = DatasetInfo.load(source)
            if info is not None:
                eos = info.eos_token
                source = info.tokenizer_file
        loaded = read_tokenizer(source, option="")
        if loaded is None:
            return None
        if eos is None or loaded.tokenizer.token_to_id(eos) is None:
            eos = loaded.end_of_document()
        return cls(loaded.tokenizer, source, eos, loaded.configured("bos_token") or eos,
                   loaded.configured("pad_token") or eos)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def check_fits(self, embedding_rows: int, model) -> None:
        """A tokenizer with more ids than the model has embedding rows is refused, naming both sizes."""
        if self.vocab_size > embedding_rows:
            raise TokenizerError(f"the tokenizer {self.source} has {self.vocab_size:,} ids but the model {model} has "
                                 f"{embedding_rows:,} embedding rows; use the tokenizer it was trained with")

    def hf_tokenizer(self, model_max_length: int):
        """transformers' PreTrainedTokenizerFast over it (a copy), with the special tokens set; it pads on the
        left, as batched generation with a decoder-only model needs."""
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast(tokenizer_object=self.tokenizer, bos_token=self.bos, eos_token=self.eos,
                                       pad_token=self.pad, unk_token=None, padding_side="left",
                                       model_max_length=model_max_length)

    def special_ids(self, hf_tokenizer) -> dict:
        return {"bos_token_id": hf_tokenizer.bos_token_id, "eos_token_id": hf_tokenizer.eos_token_id,
                "pad_token_id": hf_tokenizer.pad_token_id}

    def save(self, hf_tokenizer, out_dir: Path) -> None:
        """tokenizer.json and tokenizer_config.json (naming EXPORT_TOKENIZER_CLASS) into `out_dir`, and no
        other tokenizer's files there."""
        for name in FOREIGN_TOKENIZER_FILES:
            (out_dir / name).unlink(missing_ok=True)
        hf_tokenizer.save_pretrained(out_dir)
        config_file = out_dir / "tokenizer_config.json"
        config = json.loads(config_file.read_text())
        config["tokenizer_class"] = EXPORT_TOKENIZER_CLASS
        config.pop("backend", None)  # transformers 5's marker for its own class name
        files.write_text(config_file, json.dumps(config, indent=2, ensure_ascii=False) + "\n")

    def auto_tokenizer_class_if_other(self, directory: Path) -> str | None:
        """The class transformers' AutoTokenizer loads `directory` with when it does not encode PROBE_TEXT as
        this tokenizer does (the ids a model trained on this tokenizer's data expects); None when it does."""
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # no advice about the class it picked, nor about the probe's length
        try:
            loaded = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
            theirs = loaded(PROBE_TEXT, add_special_tokens=False)["input_ids"]
        finally:
            hf_logging.set_verbosity(verbosity)
        ours = self.tokenizer.encode(PROBE_TEXT, add_special_tokens=False).ids
        return None if theirs == ours else type(loaded).__name__


def export_hf(state: dict[str, torch.Tensor], spec: ModelSpec, out_dir, tokenizer=None, warn=None,
              shown_as=None) -> Path:
    """Writes `state` as an HF model directory (through transformers' class), files readable by others.

    With a tokenizer (`tokenizer`: an ExportTokenizer, or where `ExportTokenizer.find` looks), its files are
    written through transformers' PreTrainedTokenizerFast (tokenizer.json, tokenizer_config.json naming that class
    and the special tokens), so `AutoTokenizer.from_pretrained(DIR)` loads that tokenizer, and config.json /
    generation_config.json carry its BOS, EOS and padding ids. Where the installed transformers' AutoTokenizer
    would still load DIR with a class of its own that encodes otherwise (a qwen2 model_type: Qwen2Tokenizer),
    DIR/tokenizer/ holds the tokenizer alone and `warn` (default: stderr) gets one line saying so, naming
    `shown_as` (where DIR will be renamed to, if it is a temporary folder) rather than DIR."""
    out_dir = Path(out_dir)
    found = (tokenizer if isinstance(tokenizer, ExportTokenizer) or tokenizer is None
             else ExportTokenizer.find(tokenizer))
    if found is not None:
        found.check_fits(spec.padded_vocab_size, f"'{spec.name}'")
    hf_tokenizer = found.hf_tokenizer(spec.max_position_embeddings) if found else None
    special_ids = found.special_ids(hf_tokenizer) if found else None
    from transformers import GenerationConfig

    model = to_transformers({k: v.detach().cpu() for k, v in state.items()}, spec, special_ids)
    model.config.use_cache = True  # trained without the KV cache; generation wants it
    model.generation_config = GenerationConfig.from_model_config(model.config)
    with quiet_progress():
        model.save_pretrained(out_dir, safe_serialization=True, max_shard_size=EXPORT_SHARD_SIZE)
    if found is not None:
        write_tokenizer(found, hf_tokenizer, out_dir, model.config.model_type, warn or _warn_on_stderr,
                        Path(shown_as or out_dir))
    for path in [*out_dir.iterdir(), *(out_dir / TOKENIZER_ALONE).glob("*")]:
        if path.is_file():
            files.set_default_mode(path)
    return out_dir


def write_tokenizer(found: ExportTokenizer, hf_tokenizer, out_dir: Path, model_type: str, warn,
                    shown_as: Path) -> None:
    """The tokenizer's files into the model directory; where AutoTokenizer would load them there with a class
    of transformers' own that encodes otherwise, also into DIR/tokenizer/ alone, said in one `warn` line that
    names the directory as `shown_as`."""
    found.save(hf_tokenizer, out_dir)
    other = found.auto_tokenizer_class_if_other(out_dir)
    alone = out_dir / TOKENIZER_ALONE
    if other is None:
        if alone.is_dir():
            files.remove_tree(alone)  # an earlier export's, needed no longer
        return
    found.save(hf_tokenizer, alone)
    shown_alone = shown_as / TOKENIZER_ALONE
    warn(f"warning: transformers' AutoTokenizer loads {shown_as} as its {other} (chosen by config.json's model_type "
         f"'{model_type}', whatever tokenizer_config.json names), which does not encode text as the tokenizer this "
         f"model was trained with; {shown_alone} holds that tokenizer alone: AutoTokenizer.from_pretrained there, "
         f"or lm-evaluation-harness --model_args pretrained={shown_as},tokenizer={shown_alone} (generate.py and "
         f"scripts/evaluate.py read it themselves)")


def _warn_on_stderr(line: str) -> None:
    import sys

    print(line, file=sys.stderr)


@contextmanager
def quiet_progress():
    """No transformers/huggingface_hub progress bars (e.g. `Writing model shards`) inside the block: the
    engine's own output stays whole."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
