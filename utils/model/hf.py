"""HF GPT-NeoX weights in and out, in one place.

In: `load_hf_pretrained(DIR)` reads an HF GPT-NeoX directory on disk (config.json + model.safetensors, or
a sharded model.safetensors.index.json; older models' pytorch_model.bin, single or sharded, loaded with
`torch.load(weights_only=True)`), e.g. a Pythia checkpoint, into a ModelSpec and a state dict with
the engine's names. Out: `export_hf(state, spec, DIR)` writes through transformers' own GPTNeoXForCausalLM
(`save_pretrained`), so `AutoModelForCausalLM.from_pretrained(DIR)` loads it; `scripts/export_hf.py`
does it for any engine checkpoint.

Names: the engine's parameters are transformers' in-memory names (`gpt_neox.*`, `lm_head.weight`). GPT-NeoX
files on disk have called the head `embed_out` (transformers writes that name) and `lm_head`: both are read.
Buffers older files carry (`attention.bias`, `attention.masked_bias`, `rotary_emb.inv_freq`) are not weights
and are dropped.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from configs.model_config import ConfigError, ModelSpec
from utils import files

EXPORT_SHARD_SIZE = "5GB"  # larger exports are sharded safetensors with an index json, as transformers writes them
_NOT_WEIGHTS = re.compile(r"(attention\.(bias|masked_bias)|rotary_emb\.inv_freq)$")


class HFLoadError(ConfigError):
    """An init_from directory that is not a usable HF GPT-NeoX model; the message names the file."""


def load_hf_pretrained(directory) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """(architecture, weights with the engine's names) from an HF GPT-NeoX directory."""
    from safetensors.torch import load_file

    directory = Path(directory).expanduser()
    config_path = directory / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise HFLoadError(f"init_from {directory}: no config.json there; point init_from at an HF model directory "
                          f"(config.json + model.safetensors)") from None
    except (OSError, ValueError) as exc:
        raise HFLoadError(f"init_from {config_path}: cannot read it ({exc})") from None
    spec = ModelSpec.from_hf_config(config, name=directory.name, source=str(config_path))
    state = {}
    for shard in _weight_files(directory):
        try:
            if shard.name.endswith(".safetensors"):
                state |= load_file(str(shard))
            else:  # older checkpoints (e.g. early Pythia revisions) ship only pickled torch files
                state |= torch.load(shard, map_location="cpu", weights_only=True)
        except Exception as exc:  # safetensors / torch raise their own error types for truncated or foreign files
            raise HFLoadError(f"init_from {shard}: cannot read it ({str(exc).splitlines()[0] if str(exc) else exc!r})") from None
    return spec, engine_names(state)


def _weight_files(directory: Path) -> list[Path]:
    """The weight files of an HF directory: model.safetensors, its sharded index, or (older models)
    pytorch_model.bin or its sharded index, in that order of preference."""
    for single, index_name in (("model.safetensors", "model.safetensors.index.json"),
                               ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        if (directory / single).is_file():
            return [directory / single]
        index = directory / index_name
        if index.is_file():
            try:
                shards = sorted({directory / f for f in json.loads(index.read_text())["weight_map"].values()})
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise HFLoadError(f"init_from {index}: unreadable shard index ({exc})") from None
            missing = [p.name for p in shards if not p.is_file()]
            if missing:
                raise HFLoadError(f"init_from {index}: lists {missing[0]}, which is not there; download every shard")
            return shards
    other = sorted(p.name for p in directory.iterdir() if p.is_file() and p.name != "config.json") or ["nothing else"]
    raise HFLoadError(f"init_from {directory}: no weights (model.safetensors, pytorch_model.bin or their sharded "
                      f"index .json; found {', '.join(other[:5])}); point init_from at a complete HF model directory")


def engine_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An HF GPT-NeoX state dict (either head name, buffers or not) -> the engine's parameter names."""
    out = {k: v for k, v in state.items() if not _NOT_WEIGHTS.search(k)}
    if "embed_out.weight" in out:
        out["lm_head.weight"] = out.pop("embed_out.weight")
    return out


def check_weights(spec: ModelSpec, state: dict[str, torch.Tensor], source) -> None:
    """One line naming what is missing or of the wrong shape, before a model tries to load it."""
    from utils.model import build_model

    with torch.device("meta"):
        expected = build_model(spec, seed=0).state_dict()
    if spec.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = sorted(k for k in set(expected) & set(state) if tuple(expected[k].shape) != tuple(state[k].shape))
    if missing or unexpected or wrong:
        parts = [f"missing {missing[:3]}" if missing else "", f"unexpected {unexpected[:3]}" if unexpected else "",
                 f"wrong shape {wrong[:3]}" if wrong else ""]
        raise HFLoadError(f"init_from {source}: its weights do not match its config.json ("
                          + "; ".join(p for p in parts if p) + ")")


def to_transformers(state: dict[str, torch.Tensor], spec: ModelSpec):
    """transformers' own GPTNeoXForCausalLM holding `state` (loaded strictly)."""
    from transformers import GPTNeoXForCausalLM
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding

    config = spec.to_hf_config()
    with torch.device("meta"):  # no time spent initialising weights that are replaced at once
        model = GPTNeoXForCausalLM(config)
    model.load_state_dict(engine_names(state), strict=not spec.tie_word_embeddings, assign=True)
    model.gpt_neox.rotary_emb = GPTNeoXRotaryEmbedding(config)  # its buffers are not in any state dict
    if spec.tie_word_embeddings:
        model.tie_weights()
    return model


def export_hf(state: dict[str, torch.Tensor], spec: ModelSpec, out_dir, tokenizer: Path | None = None) -> Path:
    """Writes `state` as an HF model directory (through transformers' class), files readable by others."""
    out_dir = Path(out_dir)
    model = to_transformers({k: v.detach().cpu() for k, v in state.items()}, spec)
    model.save_pretrained(out_dir, safe_serialization=True, max_shard_size=EXPORT_SHARD_SIZE)
    if tokenizer is not None and Path(tokenizer).is_file():
        shutil.copyfile(tokenizer, out_dir / "tokenizer.json")
    for path in out_dir.iterdir():
        if path.is_file():
            files.set_default_mode(path)
    return out_dir
