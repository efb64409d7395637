"""The compiled code a run carries with its checkpoints, so that a restart on another machine skips the compile.

With `compile_model`, rank 0 keeps `checkpoints/compile_cache.safetensors` beside the run's checkpoints (written
after the first step, rewritten before a checkpoint when the compile made more) and every checkpoint carries a
copy, listed in its manifest and uploaded with it. The file holds torch's portable compile artifacts
(`torch.compiler.save_cache_artifacts()`: Inductor's and AOTAutograd's graphs, autotuning results; on a GPU
Triton's kernels inside them) and the C++ kernel libraries Inductor built into its cache folder on a CPU, which
torch's artifacts leave out (`<cache>/xx/NAME.so`: without them a CPU resume pays most of the compile again).
Its metadata says what it was made for (`made_for`: torch, Python, platform, device, the model record, the
sequence length and the settings that change the compiled code) and carries an HMAC-SHA256 of all of it under
the secret `NEOX_COMPILE_CACHE_KEY` when that is set.

A resume loads it before the first compile (`load`), on every rank, into this machine's Inductor cache folder
(TORCHINDUCTOR_CACHE_DIR). Nothing in it is used unless, in this order: the manifest lists it and its size and
crc32c match (integrity against the run's own writer, a torn copy, a flipped bit); it is a safetensors file of
this format; its `made_for` is this run's; its signature verifies under this machine's secret (`compile_cache:
signed`, the default; `unsigned` skips this check); and every entry is an artifact kind and a file name torch's
own cache would use, inside the cache folder. Anything else is one line naming what did not match and a normal
compile, never an error. Loaded entries are then used the way torch uses its own: a graph's entry only under
the key torch computes for this run's graph (a hash of the graph, its inputs, torch's version and settings),
with torch's guards; a kernel library only under the hash of the source and compile command Inductor generates
now. A mismatch the check above missed therefore costs a compile, not a wrong kernel.

What is trusted: these entries are code (pickled graphs whose loading runs code, generated Python, native
libraries). The crc32c proves nothing against someone who can write the checkpoint's folder or bucket: they can
write a matching manifest too. Only the signature does, and only against someone who does not hold the secret;
with `compile_cache: unsigned` whoever can write the checkpoint can run code in the resuming process.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import platform
import re
import struct
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from utils.checkpoint.format import COMPILE_CACHE_FILE, MANIFEST
from utils.errors import UserError
from utils.io import files
from utils.io.storage import bytes_crc32c
from utils.settings import Settings

KEY_ENV = "NEOX_COMPILE_CACHE_KEY"  # the signing secret: set on every machine of the run, never in the bucket
FORMAT = "neox-compile-cache"
VERSION = "1"
TORCH_ENTRY = "torch"  # torch.compiler.save_cache_artifacts()'s bytes
KERNEL_PREFIX = "kernel/"  # + the library's path in the Inductor cache folder
MAX_BYTES = 2 << 30  # a larger file is not read (a crafted manifest may claim any size)
# the kinds of torch's artifacts loaded, and the form of their keys (each becomes a path in the cache folder)
_ARTIFACT_KEYS = {"inductor": re.compile(r"[A-Za-z0-9_]{8,128}"), "aot_autograd": re.compile(r"[A-Za-z0-9_]{8,128}"),
                  "autotune": re.compile(r"[A-Za-z0-9_]{1,8}/[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}\.best_config")}
_KERNEL_NAME = re.compile(r"[A-Za-z0-9_]{1,8}/[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}\.so")


@dataclass(frozen=True)
class CompileCacheSettings(Settings):
    """Whether the compiled code travels (`compile_cache`), and the settings that change what is compiled."""

    compile_model: bool
    compile_cache: str
    mixed_precision: str
    strategy: str
    attention: str
    position_reset: bool
    model_impl: str
    activation_checkpointing: str
    activation_checkpointing_every: int
    gradient_checkpointing: bool


class NotLoaded(Exception):
    """Why a checkpoint's compiled code is not used: the rest of the line after 'compile cache: '. Said by rank 0:
    every rank reads the same checkpoint and meets the same reason, unless its own copy is broken (CopyBroken)."""


class CopyBroken(NotLoaded):
    """This rank's copy of the file cannot be read or does not match its manifest entry: every rank says it."""


def secret_from_env() -> bytes | None:
    """NEOX_COMPILE_CACHE_KEY as bytes; None when unset. Too short a secret is a UserError (it is never shown)."""
    value = os.environ.get(KEY_ENV, "")
    if not value:
        return None
    if len(value) < 16:
        raise UserError(f"{KEY_ENV} has {len(value)} characters; a signing secret needs at least 16 random ones "
                        f"(e.g. `openssl rand -hex 32`), the same on every machine of the run (docs/checkpoints.md)")
    return value.encode()


def made_for(settings: CompileCacheSettings, model: dict, seq_len: int, device) -> dict:
    """What compiled code is valid for: torch, Python, the platform its libraries load on, the device, the model
    record, the sequence length and the settings that change the compiled graphs."""
    import torch

    where = device.type
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        where = f"cuda {torch.cuda.get_device_name(device)} sm_{major}{minor} CUDA {torch.version.cuda}"
    libc = " ".join(platform.libc_ver())
    compile_settings = {k: v for k, v in asdict(settings).items() if k not in ("compile_model", "compile_cache")}
    return {"torch": f"{torch.__version__} ({torch.version.git_version[:12]})",
            "python": f"{sys.version_info.major}.{sys.version_info.minor}",
            "platform": f"{platform.machine()} {libc}".strip(), "device": where, "model": model, "seq_len": seq_len,
            "settings": compile_settings}


def inductor_cache_dir() -> Path:
    """The Inductor cache folder of this process (TORCHINDUCTOR_CACHE_DIR, else torch's default)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir())


class CompileCache:
    """The compile artifacts of a run: `load(checkpoint)` before the first compile, `update()` (rank 0) when the
    compile may have made more; `path` is the file beside the checkpoints that every checkpoint copies."""

    def __init__(self, settings: CompileCacheSettings, made_for: dict, checkpoints: Path, is_main: bool, log,
                 rank: int = 0):
        self.settings, self.made_for, self.is_main, self.log, self.rank = settings, made_for, is_main, log, rank
        self.path = Path(checkpoints) / COMPILE_CACHE_FILE
        self.on = settings.compile_model and settings.compile_cache != "off"
        self.secret = secret_from_env() if self.on else None
        self.since = time.time() - 1  # kernel libraries newer than this were built (or loaded) by this run
        self._saved: tuple | None = None  # what the file holds: (torch's artifact keys, kernel names)

    # ------------------------------------------------------------------------------------------------ save

    def update(self) -> bool:
        """Rank 0: writes the file when torch holds artifacts it does not have yet. True when written."""
        if not (self.on and self.is_main):
            return False
        import torch

        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return False
        blob, info = saved
        cache = inductor_cache_dir()
        kernels = self._kernels(cache)
        what = (tuple(sorted((kind, tuple(keys)) for kind, keys in info.artifacts.items())), tuple(sorted(kernels)))
        if what == self._saved:
            return False
        entries = {TORCH_ENTRY: blob}
        for rel in kernels:
            try:
                entries[KERNEL_PREFIX + rel] = (cache / rel).read_bytes()
            except OSError:
                continue  # removed meanwhile (another process cleaned the cache): compiled again on resume
        made = json.dumps(self.made_for, sort_keys=True)
        metadata = {"format": FORMAT, "version": VERSION, "made_for": made,
                    "signature": _signature(self.secret, made, entries) if self.secret else ""}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            files.write_bytes(self.path, _pack(entries, metadata))
        except OSError as exc:  # a full disk: the next checkpoint says it; the run goes on without the file
            self.log.warning(f"warning: compile cache: cannot write {self.path} ({exc.strerror or exc}); a restart "
                             f"compiles again")
            return False
        self._saved = what
        return True

    def _kernels(self, cache: Path) -> list[str]:
        """The kernel libraries of this run in the cache folder: those this process has loaded (the compiled
        graphs' kernels) and those written since it started (its own builds, Inductor's CPU-feature probes, and
        what `load` put there)."""
        found = set()
        real = os.path.realpath(cache)
        try:
            with open("/proc/self/maps") as maps:
                for line in maps:
                    parts = line.split(None, 5)
                    if len(parts) == 6 and parts[5].startswith(real + os.sep):
                        found.add(os.path.relpath(parts[5].strip(), real))
        except OSError:
            pass  # not Linux: the libraries written since the start still count
        for path in cache.glob("*/*.so"):
            try:
                if path.stat().st_mtime >= self.since:
                    found.add(path.relative_to(cache).as_posix())
            except OSError:
                continue
        return sorted(rel for rel in found if _KERNEL_NAME.fullmatch(rel))

    # ------------------------------------------------------------------------------------------------ load

    def load(self, checkpoint: Path) -> str | None:
        """Before the first compile: the checkpoint's compiled code into this machine's cache folder, after the
        checks of the module docstring. Returns the line said (None: nothing to say, compile is off)."""
        if not self.settings.compile_model:
            return None
        try:
            line = self._load(Path(checkpoint))
        except CopyBroken as why:
            line = f"compile cache: {why}; compiling"
            if not self.is_main:
                self.log.warning(f"rank {self.rank}: {line}")
        except NotLoaded as why:
            line = f"compile cache: {why}; compiling"
        if self.is_main:
            self.log.info(line)
        return line

    def _load(self, checkpoint: Path) -> str:
        where = f"{checkpoint.name}/{COMPILE_CACHE_FILE}"
        if self.settings.compile_cache == "off":
            raise NotLoaded(f"not loaded from {checkpoint.name} (compile_cache=off)")
        try:
            manifest = files.parse_json((checkpoint / MANIFEST).read_text())
        except (OSError, ValueError) as exc:
            raise CopyBroken(f"cannot read {checkpoint.name}/{MANIFEST} ({exc})") from None
        listed = manifest.get("files") if isinstance(manifest, dict) else None
        entry = listed.get(COMPILE_CACHE_FILE) if isinstance(listed, dict) else None
        if entry is None:
            raise NotLoaded(f"{checkpoint.name} carries no compiled code (written with compile off, before the "
                            f"first step's compile, or by an engine before compile caches)")
        size, crc = (entry.get("size"), entry.get("crc32c")) if isinstance(entry, dict) else (None, None)
        if type(size) is not int or not isinstance(crc, str):
            raise NotLoaded(f"{checkpoint.name}/{MANIFEST}'s entry for it is malformed")
        if size > MAX_BYTES:
            raise NotLoaded(f"{where} would be {size:,} bytes, more than the {MAX_BYTES:,} read")
        try:
            data = (checkpoint / COMPILE_CACHE_FILE).read_bytes()
        except OSError as exc:
            raise CopyBroken(f"cannot read {where} ({exc.strerror or exc})") from None
        if len(data) != size or bytes_crc32c(data) != crc:
            raise CopyBroken(f"{where} does not match its manifest entry ({len(data):,} bytes, crc32c "
                            f"{bytes_crc32c(data)}; the manifest says {size:,}, {crc}): it is corrupt")
        metadata, entries = _unpack(data, where)
        made = metadata["made_for"]
        saved_for = _parse_made_for(made, where)
        if saved_for != self.made_for:
            raise NotLoaded(f"{where} was made for {_difference(saved_for, self.made_for)}")
        signed = self._check_signature(metadata["signature"], made, entries, where)
        counts = self._populate(entries, where)
        return (f"compile cache: loaded from {checkpoint.name} ({counts}; {len(data) / 1e6:.1f} MB, "
                f"{'signature verified' if signed else 'unsigned: compile_cache=unsigned trusts the checkpoint'})")

    def _check_signature(self, signature: str, made: str, entries: dict, where: str) -> bool:
        """True when it verifies under this machine's secret; NotLoaded when it must and does not."""
        if self.secret is not None and signature and hmac.compare_digest(signature,
                                                                          _signature(self.secret, made, entries)):
            return True
        if self.settings.compile_cache == "unsigned":
            return False
        if self.secret is None:
            raise NotLoaded(f"{where} is compiled code, loaded only when signed and verified under {KEY_ENV}, which "
                            f"this process does not have (set the run's secret on every machine, or "
                            f"compile_cache=unsigned to trust whoever can write the checkpoint: docs/checkpoints.md)")
        if not signature:
            raise NotLoaded(f"{where} is unsigned (written without {KEY_ENV}); compiled code is loaded only when its "
                            f"signature verifies")
        raise NotLoaded(f"{where}'s signature does not verify under this {KEY_ENV} (another secret, or the file was "
                        f"altered)")

    def _populate(self, entries: dict, where: str) -> str:
        """torch's artifacts into its caches and the kernel libraries into the cache folder, after checking every
        kind, key and name (each becomes a path there). Returns what was loaded, counted."""
        from torch.compiler._cache import CacheArtifactManager

        try:
            artifacts = torch_artifacts(entries[TORCH_ENTRY]) if TORCH_ENTRY in entries else {}
        except Exception:  # noqa: BLE001 - torch's reader raises what it raises on bytes it did not write
            raise NotLoaded(f"{where}: torch cannot read its compile artifacts") from None
        for kind, items in artifacts.items():
            form = _ARTIFACT_KEYS.get(kind)
            for item in items:
                if form is None or not (isinstance(item.key, str) and form.fullmatch(item.key)):
                    raise NotLoaded(f"{where} holds a {kind!r} artifact keyed {str(item.key)[:60]!r}, not one torch's "
                                    f"cache would name")
        cache = inductor_cache_dir()
        cache.mkdir(parents=True, exist_ok=True)
        kernels = {name[len(KERNEL_PREFIX):]: data for name, data in entries.items() if name.startswith(KERNEL_PREFIX)}
        for rel in kernels:
            if not (_KERNEL_NAME.fullmatch(rel) and files.inside(cache, rel)):
                raise NotLoaded(f"{where} holds a kernel named {rel[:60]!r}, not a library of the cache folder")
        try:
            CacheArtifactManager.populate_caches(artifacts)
        except Exception as exc:  # noqa: BLE001 - an entry this torch cannot take: it compiles instead
            raise NotLoaded(f"{where}: torch could not take its artifacts ({type(exc).__name__}: "
                            f"{str(exc)[:120]})") from None
        written = 0
        for rel, data in kernels.items():
            target = cache / rel
            if target.exists():
                continue  # this machine's own build of the same source and command
            target.parent.mkdir(parents=True, exist_ok=True)
            files.write_bytes(target, data)
            os.chmod(target, 0o755)
            written += 1
        graphs = ", ".join(f"{len(items)} {kind}" for kind, items in sorted(artifacts.items()))
        return f"{graphs or 'no graphs'}, {len(kernels)} kernel librar{'y' if len(kernels) == 1 else 'ies'}"


# ----------------------------------------------------------------------------------------------- the file

def torch_artifacts(blob: bytes) -> dict:
    """torch.compiler.save_cache_artifacts()'s bytes -> {kind: [artifact, ...]}, every chunk of them. Each call of
    save_cache_artifacts appends a chunk per kind to the bytes it returns, and torch's own reader (a dict of the
    chunks) keeps only the last one of each kind: a run that compiled more after its first save (an evaluation's
    graphs) would hand on only those. Parsing builds no object but torch's artifact records (strings and bytes)."""
    from torch.compiler._cache import CacheArtifactManager, _deserialize_single_cache
    from torch.utils._appending_byte_serializer import AppendingByteSerializer

    CacheArtifactManager._ensure_cache_artifacts_registered()
    merged: dict[str, list] = {}
    for kind, items in AppendingByteSerializer.to_list(blob, deserialize_fn=_deserialize_single_cache):
        merged.setdefault(kind, []).extend(items)
    return merged


def _signature(secret: bytes, made: str, entries: dict) -> str:
    """HMAC-SHA256 under `secret` of the format, `made_for` and every entry (its name, its bytes' sha256)."""
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for part in (f"{FORMAT} {VERSION}".encode(), made.encode()):
        mac.update(struct.pack("<Q", len(part)) + part)
    for name in sorted(entries):
        encoded = name.encode()
        mac.update(struct.pack("<Q", len(encoded)) + encoded + hashlib.sha256(entries[name]).digest())
    return mac.hexdigest()


def _pack(entries: dict[str, bytes], metadata: dict[str, str]) -> bytes:
    """A safetensors file of one uint8 tensor per entry, with `metadata` in its header."""
    import numpy as np
    from safetensors.numpy import save

    return save({name: np.frombuffer(data, dtype=np.uint8) for name, data in entries.items()}, metadata=metadata)


def _unpack(data: bytes, where: str) -> tuple[dict, dict[str, bytes]]:
    """(metadata, entries) of a file `_pack` wrote; NotLoaded for anything else (safetensors checks the layout)."""
    from safetensors import SafetensorError, deserialize

    try:
        (length,) = struct.unpack("<Q", data[:8])
        header = files.parse_json(data[8:8 + length]) if 8 <= length + 8 <= len(data) else None
        tensors = deserialize(data)
    except (SafetensorError, struct.error, ValueError, UnicodeDecodeError) as exc:
        raise NotLoaded(f"{where} is not a readable safetensors file ({str(exc)[:120]})") from None
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    if not (isinstance(metadata, dict) and metadata.get("format") == FORMAT and metadata.get("version") == VERSION
            and isinstance(metadata.get("made_for"), str) and isinstance(metadata.get("signature"), str)):
        raise NotLoaded(f"{where} is not a compile cache of this engine (format {FORMAT} {VERSION})")
    entries = {}
    for name, tensor in tensors:
        if tensor["dtype"] != "U8" or len(tensor["shape"]) != 1 or not (
                name == TORCH_ENTRY or name.startswith(KERNEL_PREFIX)):
            raise NotLoaded(f"{where} holds an entry {name[:60]!r} this format does not have")
        entries[name] = bytes(tensor["data"])
    return metadata, entries


def _parse_made_for(text: str, where: str) -> dict:
    try:
        value = files.parse_json(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise NotLoaded(f"{where}'s made_for is not a JSON object")
    return value


def _difference(saved: dict, current: dict) -> str:
    """"torch 2.12.0 (this run: 2.13.0)", "another model (hidden_size 64, this run: 192)", ...: what differs."""
    def shown(value) -> str:
        text = json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else str(value)
        return text if len(text) <= 60 else text[:57] + "..."

    parts = []
    for key in sorted(set(saved) | set(current)):
        old, new = saved.get(key), current.get(key)
        if old == new:
            continue
        if isinstance(old, dict) and isinstance(new, dict):
            fields = [f"{k} {shown(old.get(k))}, this run: {shown(new.get(k))}" for k in sorted(set(old) | set(new))
                      if old.get(k) != new.get(k)]
            what = {"model": "another model", "settings": "other compile settings"}.get(key, f"another {key}")
            parts.append(f"{what} ({'; '.join(fields[:3])})")
        else:
            parts.append(f"{key} {shown(old)} (this run: {shown(new)})")
    return "; ".join(parts[:3])
