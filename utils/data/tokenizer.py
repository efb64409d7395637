"""Reading a tokenizer: the one place a tokenizer path becomes a `tokenizers.Tokenizer`, for prepare_data.py,
scripts/export_hf.py, generate.py, the export into final_model/ and training's samples.

A tokenizer is a `tokenizer.json` (the tokenizers library's file), a directory holding one (an HF tokenizer
directory, a checkpoint), or a GPT-2-style directory: `vocab.json` + `merges.txt` (maybe
`tokenizer_config.json`, `added_tokens.json`) without `tokenizer.json`, which transformers' GPT2TokenizerFast
turns into a byte-level BPE from those files alone (no hub access, no code from the directory). Either
way the result carries its tokenizer.json text, which prepare_data.py writes beside the shards: everything
after reads that one file.

Special tokens: the end-of-document token is the one the caller names (dataset.json's, `--eos-token`), else
the one tokenizer_config.json / special_tokens_map.json name, else the first of EOS_CANDIDATES in the
vocabulary; a named token that is not in the vocabulary is not used.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from utils.errors import NotAFileError, UserError
from utils.io import files

FILE = "tokenizer.json"
GPT2_FILES = ("vocab.json", "merges.txt")
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>")
GPT2_SPECIAL = "<|endoftext|>"  # GPT2TokenizerFast's default unk/bos/eos, added to the vocabulary unless told not to


class TokenizerError(UserError):
    """A tokenizer path with no tokenizer, or an unreadable one; the message names the path."""


@dataclass(frozen=True)
class LoadedTokenizer:
    tokenizer: object  # tokenizers.Tokenizer
    json: bytes  # its tokenizer.json: the file's own bytes, or the converted tokenizer's
    source: Path  # the file or directory read

    @property
    def directory(self) -> Path:
        """Where its tokenizer_config.json would be."""
        return self.source if self.source.is_dir() else self.source.parent

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def configured(self, key: str) -> str | None:
        """The token tokenizer_config.json / special_tokens_map.json name for `key` (e.g. "eos_token"), when
        it is in the vocabulary."""
        name = configured_tokens(self.directory).get(key)
        return name if name is not None and self.tokenizer.token_to_id(name) is not None else None

    def end_of_document(self) -> str | None:
        """The configured EOS, else the first of EOS_CANDIDATES in the vocabulary; None: neither."""
        return self.configured("eos_token") or next(
            (t for t in EOS_CANDIDATES if self.tokenizer.token_to_id(t) is not None), None)


def read_tokenizer(source, option: str = "--tokenizer") -> LoadedTokenizer | None:
    """The tokenizer at `source` (see the module docstring); None when there is none there, a TokenizerError
    (naming `option`, if any, and the file) when there is one that cannot be read."""
    from tokenizers import Tokenizer

    where = f"{option} " if option else ""
    source = Path(source).expanduser()
    file = source / FILE if source.is_dir() else source
    if file.exists() and not file.is_dir():
        try:
            data = files.read_bytes(file)  # a FIFO or a device is refused, never waited on
        except NotAFileError as exc:
            raise TokenizerError(f"{where}{exc}") from None
        try:
            return LoadedTokenizer(Tokenizer.from_str(data.decode("utf-8")), data, source)
        except Exception as exc:  # tokenizers raises its own exception type for malformed files
            raise TokenizerError(f"{where}{file}: not a tokenizers JSON file ({exc})") from None
    if source.is_dir() and any((source / name).is_file() for name in GPT2_FILES):
        tokenizer = _from_gpt2_files(source, where)
        return LoadedTokenizer(tokenizer, tokenizer.to_str().encode("utf-8"), source)
    return None


def _from_gpt2_files(directory: Path, where: str):
    """The byte-level BPE of a GPT-2-style directory, built by transformers' GPT2TokenizerFast from the files
    on disk (local_files_only; the class is named, so no tokenizer_class / auto_map in the directory is
    followed). Special tokens the directory does not name and its vocabulary lacks are not invented."""
    missing = [name for name in GPT2_FILES if not (directory / name).is_file()]
    if missing:
        raise TokenizerError(f"{where}{directory}: has {' + '.join(n for n in GPT2_FILES if n not in missing)} but "
                             f"no {missing[0]} (a GPT-2-style tokenizer needs both, or give its {FILE})")
    from transformers import GPT2TokenizerFast
    from transformers.utils import logging as hf_logging

    try:
        vocab = json.loads(files.read_text(directory / "vocab.json", encoding="utf-8"))
        named = configured_tokens(directory)
        unset = {} if GPT2_SPECIAL in vocab else {
            key: None for key in ("unk_token", "bos_token", "eos_token") if key not in named}
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # no advice about the tokenizer class the directory names
        try:
            return GPT2TokenizerFast.from_pretrained(str(directory), local_files_only=True, **unset).backend_tokenizer
        finally:
            hf_logging.set_verbosity(verbosity)
    except Exception as exc:  # malformed JSON or merges: transformers and tokenizers raise their own types
        raise TokenizerError(f"{where}{directory}: cannot read its vocab.json + merges.txt as a GPT-2 tokenizer "
                             f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None


def configured_tokens(directory: Path) -> dict[str, str]:
    """An HF tokenizer directory's special tokens by role (bos_token, eos_token, pad_token, unk_token), from
    special_tokens_map.json and tokenizer_config.json (the latter wins)."""
    names = {}
    for file in ("special_tokens_map.json", "tokenizer_config.json"):
        try:
            raw = json.loads(files.read_text(directory / file, encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not isinstance(raw, dict):
            continue
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            value = raw.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                names[key] = value
    return names
