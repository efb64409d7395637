"""The training config: typed fields, overridable one by one; the presets are the YAML files in
configs/presets/ (one file per preset, read here: the only copy), and config files of the same form."""
from __future__ import annotations

import dataclasses
import difflib
import json
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import yaml

from configs.model_config import ConfigError, get_model_spec
from utils.observe.trackers import TRACKERS
from utils.settings import Bounds, parse_number, shown_number
from utils.training.optim import MUON_SCALES as OPTIMIZER_MUON_SCALES
from utils.training.optim import OPTIMIZERS as OPTIMIZER_REGISTRY
from utils.training.schedules import DECAY_SHAPES as SCHEDULE_DECAY_SHAPES
from utils.training.schedules import SCHEDULES

MIXED_PRECISION_MODES = ("bf16", "fp16", "fp8", "no")
MODEL_IMPLS = ("native", "hf")
REPORT_TO = (*TRACKERS, "none")  # utils/observe/trackers.py: the registry
MEMORY_PROFILES = ("auto", "off", "conservative", "balanced", "aggressive")
OPTIMIZER_STATE_DTYPES = ("fp32", "bf16")
OPTIMIZERS = tuple(OPTIMIZER_REGISTRY)  # utils/training/optim/: the registry
MUON_NS_DTYPES = ("auto", "bf16", "fp32")  # utils/training/optim/muon.py: ns_dtype_for
MUON_SCALES = tuple(OPTIMIZER_MUON_SCALES)  # utils/training/optim: torch's adjust_lr_fn by name
INITS = ("hf", "neox")  # utils/model/init.py: init_weights
STRATEGIES = ("ddp", "fsdp")  # utils/parallel/strategies.py: one class each
# utils/model/activation_checkpointing.py applies them; configs/profiles.py counts their memory
ACTIVATION_CHECKPOINTING = ("none", "full", "every_k", "selective")
ATTENTION = ("causal", "document")  # utils/model/layers.py: use_document_masking
SPIKE_GUARDS = ("off", "warn", "skip", "rollback")  # utils/training/spike_guard.py says what each does
LR_SCHEDULES = tuple(SCHEDULES)  # utils/training/schedules.py: the registry
DECAY_SHAPES = tuple(SCHEDULE_DECAY_SHAPES)
SHUFFLES = ("global", "blocks")  # utils/data/mixture.py: Shuffle
COMPILE_CACHES = ("signed", "unsigned", "off")  # utils/checkpoint/compile_cache.py says what each trusts
SOURCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
SOURCE_KEYS = ("path", "weight", "epochs", "val_files")
TASK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # it names metrics: eval/<task>/acc
# the fields whose value is one of a list: validate() checks each against it, in this order
CHOICES = {"mixed_precision": MIXED_PRECISION_MODES, "model_impl": MODEL_IMPLS, "attention": ATTENTION,
           "spike_guard": SPIKE_GUARDS, "activation_checkpointing": ACTIVATION_CHECKPOINTING,
           "strategy": STRATEGIES, "profile": MEMORY_PROFILES, "optimizer_state_dtype": OPTIMIZER_STATE_DTYPES,
           "optimizer": OPTIMIZERS, "muon_ns_dtype": MUON_NS_DTYPES, "muon_scale": MUON_SCALES, "init": INITS,
           "lr_schedule": LR_SCHEDULES, "shuffle": SHUFFLES, "decay_shape": DECAY_SHAPES,
           "compile_cache": COMPILE_CACHES}
# what `--resume` takes (train.py and the launcher's help both show this list)
RESUME_FORMS = ("auto", "latest", "a checkpoint name", "a local path", "a gs:// URL")


def precision_name(mode: str) -> str:
    """A `mixed_precision` mode as logs say it: `no` is fp32."""
    return "fp32" if mode == "no" else mode


# seq_len's default caps a model's positions at 8,192 tokens: Llama 3's pretraining context (its rope scaling's
# original_max_position_embeddings) and SmolLM2's whole one; longer is a long-context stage you choose. At micro-batch
# 1, a 1-1.5B model's plan at this length fits an 80 GiB GPU without activation checkpointing.
DEFAULT_SEQ_LEN_CAP = 8192


def default_seq_len(spec) -> tuple[int, str]:
    """(tokens a sequence, why) when `seq_len` is not set: the model's max_position_embeddings, at most its
    pretraining context before rope scaling (original_max_position_embeddings) and DEFAULT_SEQ_LEN_CAP.
    Training and scripts/memory_plan.py both take their default from here."""
    positions = spec.max_position_embeddings
    original = int(spec.rope_scaling[3]) if spec.rope_scaling else positions
    if min(original, DEFAULT_SEQ_LEN_CAP) >= positions:
        return positions, "the model's max_position_embeddings"
    if original <= DEFAULT_SEQ_LEN_CAP:
        return original, (f"the model's context before rope scaling (original_max_position_embeddings) of its "
                          f"{positions:,} positions")
    return DEFAULT_SEQ_LEN_CAP, f"the default cap for models of more positions ({positions:,} here)"


def check_seq_len(seq_len: int, spec) -> None:
    if seq_len > spec.max_position_embeddings:
        raise ConfigError(f"seq_len={seq_len} exceeds model '{spec.name}' max_position_embeddings="
                          f"{spec.max_position_embeddings}")


def _field(default, help: str, bounds: str | None = None, special: dict | None = None):
    """A field with its `--help` text and, for a number, its range (an interval, see Bounds; validate()
    checks every field's)."""
    metadata = {"help": help}
    if bounds is not None:
        metadata["bounds"] = Bounds(bounds, special)
    return field(default=default, metadata=metadata)


@dataclass
class TrainingConfig:
    """Every setting of a run. `train.py --help` lists them with their defaults; `--set KEY=VALUE` or a
    `--config FILE.yaml` changes any of them."""

    preset: str = _field("custom", "the preset (or config file) this config started from")
    model: str = _field("gpt-neox-1.2b", "architecture by name (configs/model_config.py); ignored with init_from")
    model_impl: str = _field("native", "native: the project's model of the family; hf: transformers' class "
                                       "of the family (GPTNeoXForCausalLM, LlamaForCausalLM, ...)")
    init_from: str = _field("", "an HF directory of a registered family (docs/models.md: config.json + "
                                "safetensors): start from its weights")
    seq_len: int = _field(0, "tokens per training sequence (1 has no next token to learn); 0: the model's "
                             "max_position_embeddings, at most its context before rope scaling and 8192 (the "
                             "export keeps every position)", "[2, inf)",
                          {0: "the model's positions, at most its context before rope scaling and 8192"})
    # data
    data_dir: str = _field("data/training", "local shard directory, or gs://BUCKET/PREFIX of a prepared dataset to "
                                            "stream from (a dataset.json there sets the vocabulary)")
    max_files: int = _field(-1, "use the first N shard files (by path); -1: all", "[1, inf)", {-1: "all files"})
    val_files: int = _field(1, "shard files held out (the last by path) for validation", "[0, inf)")
    demo_data: bool = _field(False, "build the demo corpus into data_dir when it has no shards")
    dataloader_num_workers: int = _field(4, "DataLoader worker processes per rank (0: read in the main process)",
                                         "[0, inf)")
    prefetch_factor: int = _field(4, "batches each worker prepares ahead", "[1, inf)")
    shuffle: str = _field("global", "each epoch's order: global (every sequence permuted) | blocks (shards permuted, "
                                    "sequences shuffled within blocks of shuffle_block_shards shards: few shards "
                                    "at a time, for a bounded data cache)")
    shuffle_block_shards: int = _field(16, "shuffle=blocks: shards per block", "[1, inf)")
    data_cache_gb: float = _field(0.0, "gs:// data: local disk its cache of shards may fill on each node (split over "
                                       "the node's processes); 0: no bound", "[0, inf)")
    data_cache_dir: str = _field("", "gs:// data: where shards are cached (empty: a folder in the system's temporary "
                                     "directory)")
    data_mix: dict = field(default_factory=dict, metadata={
        "help": "weighted sources {name: {path, weight, epochs?, val_files?}}, or on the command line "
                "name=PATH:WEIGHT[:EPOCHS],...; data_dir becomes the first source's folder; empty: data_dir alone"})
    # optimisation
    max_steps: int = _field(10000, "optimizer steps: the LR schedule's horizon and where training ends", "[1, inf)")
    stop_at_step: int = _field(0, ">0: save and exit 0 after this step, schedule unchanged (time-limited jobs)",
                               "[0, inf)")
    per_device_train_batch_size: int = _field(4, "sequences per micro-batch per process", "[1, inf)")
    gradient_accumulation_steps: int = _field(4, "micro-batches per optimizer step", "[1, inf)")
    learning_rate: float = _field(3e-4, "peak learning rate (above 1e12 a typo: the first update overflows fp32)",
                                  "(0, 1e12]")
    min_lr_ratio: float = _field(0.1, "the schedule decays to learning_rate * min_lr_ratio at max_steps", "[0, 1]")
    warmup_steps: int = _field(500, "linear warmup steps", "[0, inf)")
    lr_schedule: str = _field("cosine",
                              "after warmup: cosine | wsd (stable, then decay at the end) | linear | constant")
    decay_steps: int = _field(0, "wsd: decay over the last N steps (0: decay_fraction of max_steps)", "[0, inf)")
    decay_fraction: float = _field(0.2, "wsd: the share of max_steps the decay takes when decay_steps is 0",
                                   "[0, 1]")
    decay_shape: str = _field("linear", "wsd: the decay's shape, linear | cosine | sqrt")
    weight_decay: float = _field(0.1, "AdamW weight decay (matrices only; each step scales them by 1 - "
                                      "learning_rate * weight_decay)", "[0, 100]")
    adam_beta1: float = _field(0.9, "AdamW beta1", "[0, 1)")
    adam_beta2: float = _field(0.95, "AdamW beta2", "[0, 1)")
    adam_eps: float = _field(1e-8, "AdamW epsilon (above 1 it swamps every update)", "(0, 1]")
    optimizer: str = _field("adamw", "adamw | muon: torch's Muon for the blocks' 2-D weight matrices (AdamW for "
                                     "embeddings, head, norms, biases), LR matched to AdamW's update size")
    muon_momentum: float = _field(0.95, "optimizer=muon: Muon's (Nesterov) momentum", "[0, 1)")
    muon_ns_dtype: str = _field("auto", "optimizer=muon: Newton-Schulz's precision, bf16 (torch's) | fp32 | auto "
                                        "(fp32 when mixed_precision=no, else bf16)")
    muon_scale: str = _field("moonlight", "optimizer=muon: each matrix's update scaled to AdamW's RMS, 0.2 * "
                                          "sqrt(max(rows, cols)), so learning_rate serves both (moonlight), or "
                                          "by sqrt(max(1, rows / cols)) (original: wants a larger learning_rate)")
    cautious_weight_decay: bool = _field(False, "optimizer=muon: decay a block matrix's entries only where the "
                                                "update moves them towards zero too (modded-nanogpt)")
    init: str = _field("hf", "fresh weights: hf (normal, std initializer_range) | neox (GPT-NeoX small_init + "
                             "wang_init, as Pythia); init_from and resumes are unaffected")
    z_loss: float = _field(0.0, "auxiliary z-loss coefficient (z_loss * logsumexp^2, OLMo uses 1e-4; above 1 the z "
                                "term swamps the cross-entropy); 0: off", "[0, 1]")
    max_grad_norm: float = _field(1.0, "clip gradients to this global norm; 0: no clipping (the norm is still "
                                       "measured and logged, as grad_norm)", "[0, 1e6]")
    seed: int = _field(42, "seed of the weights, the data order and every RNG", "[0, 4294967295]")
    # speed and memory
    strategy: str = _field("ddp", "ddp: every rank holds the whole model; fsdp: parameters, gradients and optimizer "
                                  "state sharded over the ranks (FSDP2), sharded checkpoints")
    mixed_precision: str = _field("bf16", "bf16 | fp16 (CUDA, with a grad scaler) | fp8 (Hopper/Ada, torchao) | no")
    compile_model: bool = _field(True, "torch.compile each transformer block (regional compile)")
    compile_cache: str = _field("signed", "compile_model: checkpoints carry the compiled code, and a resume on any "
                                          "machine loads it instead of compiling: signed (loaded only when its "
                                          "signature verifies under NEOX_COMPILE_CACHE_KEY) | unsigned (loaded "
                                          "unsigned: whoever can write the checkpoint can run code in the run) | off")
    attention: str = _field("causal", "causal: every token sees all before it in its sequence; document: only those "
                                      "of its own document (packed documents end at the data's EOS id)")
    position_reset: bool = _field(False, "attention=document: rotary positions restart at every document")
    eos_id: int = _field(-1, "attention=document: the end-of-document id; -1: from the data's dataset.json",
                         "[0, inf)", {-1: "from the data"})
    activation_checkpointing: str = _field("none", "what the backward pass recomputes instead of keeping: none | full "
                                                   "(each block) | every_k (every k-th block) | selective (the "
                                                   "element-wise ops; matmul and attention outputs are kept)")
    activation_checkpointing_every: int = _field(2, "every_k: checkpoint blocks 0, k, 2k, ...", "[1, inf)")
    gradient_checkpointing: bool = _field(False, "true: activation_checkpointing=full (the older switch)")
    profile: str = _field("auto", "memory profile: auto (by GPU memory) | off | conservative | balanced | aggressive")
    optimizer_state_dtype: str = _field("fp32", "AdamW moments in fp32 or bf16 (half the memory)")
    preflight_steps: int = _field(2, "forward/backward passes checked for a finite loss before step 1", "[0, inf)")
    # logging, eval, checkpoints
    logging_steps: int = _field(100, "optimizer steps per log line and metrics row", "[1, inf)")
    eval_interval: int = _field(500, "optimizer steps between validation runs", "[1, inf)")
    eval_batches: int = _field(20, "validation batches per evaluation", "[1, inf)")
    # samples during training (utils/evals/sampling.py)
    sample_every: int = _field(0, "every N optimizer steps, continue sample_prompts into logs/samples.jsonl, the log "
                                  "and TensorBoard's text tab; 0: off", "[0, inf)")
    sample_prompts: list[str] = field(default_factory=list, metadata={
        "help": "prompts for sample_every (a YAML list; --set sample_prompts='[\"a\", \"b\"]' or one prompt)"})
    sample_max_new_tokens: int = _field(32, "tokens each sample continues for", "[1, inf)")
    report_to: str = _field("tensorboard", "trackers: tensorboard, wandb, mlflow, a comma-separated list, or none")
    save_steps: int = _field(500, "optimizer steps between checkpoints", "[1, inf)")
    save_total_limit: int = _field(3, "local checkpoints kept (the newest); one not yet in GCS is never deleted",
                                   "[1, inf)")
    run_name: str = _field("", "names the run's checkpoint folder in GCS and its trackers; default: the preset")
    gcs_bucket: str = _field("", "bucket for checkpoints (empty: they stay local)")
    gcs_prefix: str = _field("", "checkpoints go to gs://BUCKET/PREFIX/checkpoints/RUN/NAME/")
    background_upload: bool = _field(True, "upload checkpoints in a background thread")
    upload_timeout_s: int = _field(600, "at exit, wait at most this long for uploads still running", "[0, inf)")
    process_group_timeout_s: int = _field(3600, "collective timeout: long enough for rank 0's checkpoint I/O",
                                          "[1, inf)")
    hang_timeout_s: int = _field(1800, "hang watchdog: a run whose training loop makes no progress for this long "
                                       "writes every rank's stacks to logs/hang-*.txt and exits 3 (restarted by "
                                       "--max-restarts or the scheduler); above any honest step (evaluations, "
                                       "checkpoints and rollbacks count as progress: docs/preemptible-gpus.md); 0: "
                                       "off", "[0, inf)")
    # downstream evals (utils/evals/)
    eval_tasks: dict = field(default_factory=dict, metadata={
        "help": "task files scored with validation, as lm-evaluation-harness scores them {name: FILE} (or a list of "
                "files, named after them); on the command line name=FILE,... or FILE,...; empty: none"})
    eval_tasks_every: int = _field(0, "optimizer steps between downstream evals; 0: with validation "
                                      "(eval_interval)", "[0, inf)")
    eval_tasks_limit: int = _field(0, "score the first N examples of each task; 0: all", "[0, inf)")
    # loss-spike guard (utils/training/spike_guard.py)
    spike_guard: str = _field("warn", "a step whose loss or gradient norm is more than spike_threshold standard "
                                      "deviations above the mean of the last spike_window steps is a spike: off | "
                                      "warn (a line and a metrics row) | skip (its update is not applied) | rollback "
                                      "(as skip, and after spike_patience spikes the run goes back to its newest "
                                      "checkpoint and skips the data read since)")
    spike_window: int = _field(128, "the steps (spikes left out) a step is measured against; none is judged before "
                                    "there are this many", "[2, inf)")
    spike_threshold: float = _field(6.0, "standard deviations above the window's mean that make a spike", "(0, 1000]")
    spike_patience: int = _field(3, "rollback: spikes within spike_window steps that roll the run back", "[1, inf)")
    spike_max_rollbacks: int = _field(3, "rollback: rollbacks to one checkpoint before the run stops (the spikes "
                                         "come back whatever data is skipped)", "[1, inf)")

    @property
    def effective_run_name(self) -> str:
        """`run_name`, else the preset's name, or a config file's name without its folder and suffix."""
        return self.run_name or (Path(self.preset).stem if is_config_file(self.preset) else self.preset)

    def seq_len_for(self, spec) -> int:
        return self.seq_len or default_seq_len(spec)[0]

    def validate(self) -> "TrainingConfig":
        """Checks each field on its own. What depends on the model actually built (seq_len against its
        positions, vocabulary against the data) is checked once the model is known (see train.py). Every
        number is checked against the range declared beside its field, every choice against its list."""
        for f in fields(self):
            check_range(f.name, getattr(self, f.name))
        if not self.init_from:  # with init_from, the model comes from its config.json (checked when loaded)
            check_seq_len(self.seq_len, get_model_spec(self.model))  # an unknown model raises too
        for name in CHOICES:
            check_choice(name, getattr(self, name))
        self._validate_report_to()
        self._validate_combinations()
        self._validate_data_mix()
        if self.gcs_bucket.startswith("gs://") or "/" in self.gcs_bucket:
            raise ConfigError(
                f"gcs_bucket='{self.gcs_bucket}' must be a bare bucket name; put folders in gcs_prefix"
            )
        return self

    def warnings(self) -> list[str]:
        """Settings valid alone that will not do what they say: one line each, for the run to print once it has
        decided its values (after a resume kept its recipe: train.py, the Trainer)."""
        lines = []
        if self.warmup_steps > self.max_steps:
            lines.append(f"warning: warmup_steps={self.warmup_steps} exceeds max_steps={self.max_steps}: the learning "
                         f"rate never reaches learning_rate={self.learning_rate:g}; lower warmup_steps")
        return lines

    def _validate_combinations(self) -> None:
        """Fields valid alone that do not go together."""
        if self.attention == "document" and self.model_impl != "native":
            raise ConfigError("attention=document masks the native model's attention; use model_impl=native")
        if self.spike_guard == "rollback" and self.spike_patience > self.spike_window:
            raise ConfigError(f"spike_patience={self.spike_patience} exceeds spike_window={self.spike_window}: that "
                              f"many spikes never fall within the window, so the run would never roll back; lower "
                              f"spike_patience or raise spike_window")
        if self.strategy == "fsdp" and self.model_impl != "native":
            raise ConfigError("strategy=fsdp shards the native model; use model_impl=native (or strategy=ddp)")
        if self.strategy == "fsdp" and self.mixed_precision == "fp16":
            raise ConfigError("strategy=fsdp does not run fp16 (it needs a sharded grad scaler); use "
                              "--mixed-precision bf16")
        if self.z_loss and self.model_impl == "hf":
            raise ConfigError(f"z_loss={self.z_loss:g} needs model_impl=native (its chunked LM-head loss); "
                              f"use model_impl=native or z_loss=0")
        if self.sample_every and not self.sample_prompts:
            raise ConfigError(f"sample_every={self.sample_every} needs sample_prompts (a list of prompts)")

    def _validate_report_to(self) -> None:
        bad = [t for t in self.report_to.split(",") if t.strip() and t.strip().lower() not in REPORT_TO]
        if bad:
            raise ConfigError(f"report_to='{self.report_to}': unknown tracker '{bad[0].strip()}'; use "
                              f"{', '.join(REPORT_TO)} or a comma-separated list of them")
        named = [t.strip().lower() for t in self.report_to.split(",") if t.strip()]
        if "none" in named and len(named) > 1:
            raise ConfigError(f"report_to='{self.report_to}': 'none' cannot be combined with trackers; use "
                              f"report_to=none, or list only the trackers")

    def _validate_data_mix(self) -> None:
        """Each source's values; with a mixture, data_dir is its first source's folder (whose dataset.json
        and tokenizer.json stand for all: the sources' tokenizers must agree)."""
        for name, entry in self.data_mix.items():
            where = f"data_mix source '{name}'"
            if not SOURCE_NAME.fullmatch(name):
                raise ConfigError(f"{where}: a name is letters, digits, '_', '.' or '-' (it names metrics such as "
                                  f"tokens/{name})")
            if not entry["path"].strip():
                raise ConfigError(f"{where}: path is empty; give the source's shard folder")
            if not (entry["weight"] >= 0 and entry["weight"] != float("inf")):
                raise ConfigError(f"{where}: weight={entry['weight']} must be a finite number >= 0")
            if entry.get("epochs", 1) < 1 or entry.get("val_files", 0) < 0:
                raise ConfigError(f"{where}: epochs must be at least 1 and val_files not negative")
        if self.data_mix:
            if not any(e["weight"] > 0 for e in self.data_mix.values()):
                raise ConfigError("data_mix: every weight is 0; give at least one source a positive weight")
            self.data_dir = next(iter(self.data_mix.values()))["path"]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_FIELDS = {f.name: f for f in fields(TrainingConfig)}
_SETTABLE = {name: f for name, f in _FIELDS.items() if name != "preset"}
CONFIG_FILE_SUFFIXES = (".yaml", ".yml", ".json")


def check_range(name: str, value) -> None:
    """A number against the range declared beside its field (Bounds): ConfigError 'NAME=VALUE must be ...'."""
    f = _FIELDS[name]
    bounds = f.metadata.get("bounds")
    refused = bounds.refusal(value, f.type) if bounds is not None else None
    if refused:
        shown = shown_number(value)
        named = f"{name}={value}" if shown == str(value) else f"{name} ({shown})"
        raise ConfigError(f"{named} {refused}")


def check_choice(name: str, value) -> None:
    """A field whose value is one of a list (CHOICES) against it."""
    if name in CHOICES and value not in CHOICES[name]:
        raise ConfigError(f"{name}='{value}' is not valid; use one of {', '.join(CHOICES[name])}")


def _unknown_field(key: str, where: str) -> ConfigError:
    close = difflib.get_close_matches(key, _SETTABLE, n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return ConfigError(f"{where}: unknown training-config field '{key}'; {hint}`python train.py --help` lists them all")


def _coerce(name: str, raw, where: str):
    """A value from `--set` (a string) or a config file (YAML/JSON types) -> the field's type."""
    kind = _SETTABLE[name].type
    if name == "data_mix":
        return parse_data_mix(raw, where)
    if name == "eval_tasks":
        return parse_eval_tasks(raw, where)
    try:
        if kind == "bool":
            if isinstance(raw, bool):
                return raw
            low = str(raw).strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if kind in ("int", "float"):  # the one numeric parsing (utils/settings.py): below 2^63, finite
            try:
                return parse_number(raw, kind)
            except ValueError as exc:
                if str(exc).startswith("must be"):
                    raise ConfigError(f"{where}: {name} {exc}") from None
                raise
        if kind == "list[str]":
            if isinstance(raw, str):  # from --set: a JSON list, or one prompt
                raw = json.loads(raw) if raw.strip().startswith("[") else [raw]
            if not isinstance(raw, (list, tuple)) or not all(isinstance(v, str) for v in raw):
                raise ValueError
            return list(raw)
        if isinstance(raw, (list, tuple)) and name == "report_to":
            return ",".join(str(v) for v in raw)
        if isinstance(raw, bool) and name == "mixed_precision":  # YAML reads a bare `no` as false: fp32
            if raw:
                raise ConfigError(f"{where}: mixed_precision is true (YAML reads a bare yes, true or on so), which "
                                  f"names no precision; use one of {', '.join(MIXED_PRECISION_MODES)}")
            return "no"
        if isinstance(raw, bool):  # YAML reads a bare off / on (no / yes) as a bool: `profile: off`, `spike_guard: off`
            return "on" if raw else "off"
        if isinstance(raw, (dict, list, tuple)):
            raise ValueError
        return str(raw)
    except ConfigError:
        raise
    except (TypeError, ValueError):
        shown = repr(raw) if len(repr(raw)) <= 80 else repr(raw)[:77] + "..."
        raise ConfigError(f"{where}: expected a value of type {kind} for {name}, got {shown}") from None


def coerce_flag(name: str, value, flag: str):
    """A command-line flag's value for field `name` (train.py's --max-steps, ...), parsed as `--set` parses
    it (`flag` names it in the error line): a number past 2^63 is one line, never an OverflowError later."""
    return _coerce(name, value, flag)


def _source_from_text(text: str) -> dict | None:
    """"PATH:WEIGHT[:EPOCHS]" -> {path, weight[, epochs]} (strings), or None when no number follows the path.
    Numbers are taken from the right, so a path may hold ':' itself (C:\\data, a drive letter)."""
    def number(value: str) -> bool:
        try:
            float(value)
        except ValueError:
            return False
        return True

    parts = text.rsplit(":", 2)
    if len(parts) == 3 and number(parts[1]) and number(parts[2]):
        return {"path": parts[0], "weight": parts[1], "epochs": parts[2]}
    path, sep, weight = text.rpartition(":")
    return {"path": path, "weight": weight} if sep and number(weight) else None


def parse_data_mix(raw, where: str) -> dict:
    """`data_mix` from a config file ({name: {path, weight, epochs?, val_files?}}) or `--set`
    ("name=PATH:WEIGHT[:EPOCHS],...") -> {name: {"path": str, "weight": float, ...}} (weights as given;
    the loader normalises them). The values are checked in TrainingConfig.validate()."""
    usage = "expected name=PATH:WEIGHT[:EPOCHS],... or a mapping {name: {path: DIR, weight: W}}"
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return {}
    if isinstance(raw, str):
        out = {}
        for item in raw.split(","):
            name, sep, rest = item.strip().partition("=")
            entry = _source_from_text(rest)
            if not sep or entry is None:
                raise ConfigError(f"{where}: data_mix item '{item.strip()}': the weight must be a number after the "
                                  f"path's last ':'; {usage}")
            if name.strip() in out:
                raise ConfigError(f"{where}: data_mix names source '{name.strip()}' twice; give each source its own "
                                  f"name")
            out[name.strip()] = entry
        raw = out
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: data_mix: {usage}, got {type(raw).__name__}")
    mix = {}
    for name, entry in raw.items():
        if not isinstance(entry, dict) or "path" not in entry or "weight" not in entry:
            raise ConfigError(f"{where}: data_mix source '{name}' needs path and weight ({usage})")
        unknown = [k for k in entry if k not in SOURCE_KEYS]
        if unknown:
            raise ConfigError(f"{where}: data_mix source '{name}': unknown key '{unknown[0]}'; use "
                              f"{', '.join(SOURCE_KEYS)}")
        try:
            clean = {"path": str(entry["path"]), "weight": float(entry["weight"])}
            for key in ("epochs", "val_files"):
                if entry.get(key) is not None:
                    value = entry[key]
                    if isinstance(value, bool) or isinstance(value, float) and not value.is_integer():
                        raise ValueError
                    clean[key] = int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: data_mix source '{name}': weight must be a number and epochs / val_files "
                              f"whole numbers, got {entry!r}") from None
        mix[str(name)] = clean
    return mix


def task_name(path, name: str | None = None) -> str:
    """A downstream eval task's name in metrics (eval/<name>/acc): `name`, else the file's name up to its
    first dot."""
    name = name or Path(path).name.split(".")[0]
    if not TASK_NAME.fullmatch(name):
        raise ConfigError(f"task name '{name}' ({path}): use letters, digits, '_', '.' or '-' (give it as "
                          f"NAME=FILE)")
    return name


def parse_eval_tasks(raw, where: str) -> dict:
    """`eval_tasks` from a config file ({name: FILE} or [FILE, ...]) or `--set` ("name=FILE,...", "FILE,..." or
    either as JSON) -> {name: FILE}; a file without a name is named after it (its name up to the first dot)."""
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return {}
    if isinstance(raw, str) and raw.strip().startswith(("[", "{")):  # --set with a JSON list or mapping
        try:
            raw = json.loads(raw)
        except ValueError as exc:
            raise ConfigError(f"{where}: eval_tasks: not valid JSON ({exc})") from None
    elif isinstance(raw, str):
        raw = [item.strip() for item in raw.split(",") if item.strip()]
    if isinstance(raw, list):
        pairs = [item.partition("=")[::2] if isinstance(item, str) and "=" in item else (None, item) for item in raw]
    elif isinstance(raw, dict):
        pairs = list(raw.items())
    else:
        raise ConfigError(f"{where}: eval_tasks: expected name=FILE,... or a mapping {{name: FILE}}, got "
                          f"{type(raw).__name__}")
    tasks = {}
    for name, path in pairs:
        if not isinstance(path, str) or not path.strip():
            raise ConfigError(f"{where}: eval_tasks: {path!r} is not a file path")
        try:
            name = task_name(path.strip(), None if name is None else str(name).strip())
        except ConfigError as exc:
            raise ConfigError(f"{where}: eval_tasks: {exc}") from None
        if name in tasks:
            raise ConfigError(f"{where}: eval_tasks: two tasks named '{name}'; name them apart with name=FILE")
        tasks[name] = path.strip()
    return tasks


PRESET_DIR = Path(__file__).resolve().parent / "presets"


class RefusedSetting(ValueError):
    """What a settings file's parser refuses: a key given twice in one mapping, a value of a YAML type a setting
    never takes."""


# YAML types the safe loader builds besides plain ones (strings, numbers, booleans, null, lists, mappings): a
# setting is none of them, and `!!binary` or a bare date would otherwise reach a field as bytes' or a date's text
_NON_PLAIN_YAML = {"binary": "bytes", "timestamp": "a date", "set": "a set", "omap": "an ordered map",
                   "pairs": "a list of pairs"}


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (YAML itself keeps the last) and the
    non-plain types (_NON_PLAIN_YAML)."""

    def construct_non_plain(self, node):
        what = _NON_PLAIN_YAML[node.tag.rpartition(":")[2]]
        raise RefusedSetting(f"line {node.start_mark.line + 1}: {node.tag.replace('tag:yaml.org,2002:', '!!')} "
                           f"({what}) is not a plain value; write a string, number, true/false, list or mapping "
                           f"(quote a date or any text to keep it text)")

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise RefusedSetting(f"line {key_node.start_mark.line + 1}: key '{key}' appears twice in one mapping; "
                                   f"give each key once")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


for _tag in _NON_PLAIN_YAML:
    _UniqueKeyLoader.add_constructor(f"tag:yaml.org,2002:{_tag}", _UniqueKeyLoader.construct_non_plain)


def _unique_json_object(pairs: list) -> dict:
    keys = [key for key, _ in pairs]
    twice = next((key for key in keys if keys.count(key) > 1), None)
    if twice is not None:
        raise RefusedSetting(f"key '{twice}' appears twice in one object; give each key once")
    return dict(pairs)


def load_settings_text(text: str, json_format: bool = False):
    """A preset's or config file's YAML (or JSON) text -> its data. A key given twice in one mapping (a field,
    a data_mix source) is refused, naming it: both formats would silently keep the last."""
    if json_format:
        return json.loads(text, object_pairs_hook=_unique_json_object)
    return yaml.load(text, Loader=_UniqueKeyLoader)


def _load_presets() -> dict[str, "TrainingConfig"]:
    """configs/presets/NAME.yaml -> the preset NAME: the fields it sets over the defaults."""
    presets = {}
    for path in sorted(PRESET_DIR.glob("*.yaml")):
        raw = load_settings_text(path.read_text()) or {}
        for key in raw:
            if key not in _SETTABLE:
                raise _unknown_field(str(key), str(path))
        presets[path.stem] = TrainingConfig(preset=path.stem, **{k: _coerce(k, v, str(path)) for k, v in raw.items()})
    return presets


PRESETS: dict[str, TrainingConfig] = _load_presets()


def parse_overrides(pairs: list[str]) -> dict:
    """`["key=value", ...]` -> typed dict; an unknown key or bad value is a ConfigError."""
    out = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"--set {pair}: expected KEY=VALUE")
        key, raw = pair.split("=", 1)
        key, where = key.strip(), f"--set {pair if len(pair) <= 80 else pair[:77] + '...'}"
        if key not in _SETTABLE:
            raise _unknown_field(key, where)
        out[key] = _coerce(key, raw, where)
    return out


def is_config_file(name: str) -> bool:
    return Path(name).suffix.lower() in CONFIG_FILE_SUFFIXES


def read_config_file(path) -> tuple[str | None, dict]:
    """A YAML or JSON file of training-config fields -> (base preset or None, its name or None, typed overrides).

    `base: NAME` starts from a preset (default: the field defaults); `preset: NAME` names the config (its
    run name unless `run_name` is set; what `--print-config` writes, so its output loads back as the same
    config); every other key is a field."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read it ({exc.strerror or exc})") from None
    try:
        raw = load_settings_text(text, json_format=path.suffix.lower() == ".json")
    except RefusedSetting as exc:
        raise ConfigError(f"--config {path}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - any parser failure on the user's file is one line
        # yaml.YAMLError / json.JSONDecodeError: both say where; odd YAML (`!!bool maybe`, a list as a key) also
        # raises KeyError, TypeError or ValueError from inside the loader
        first = str(exc).replace("\n", " ")
        raise ConfigError(f"--config {path}: not valid {path.suffix.lstrip('.').upper()} ({first})") from None
    if raw is None:  # an empty file (or only comments) would silently train the default 1.2B model
        raise ConfigError(f"--config {path}: the file is empty; give at least one field (e.g. 'base: demo' "
                          f"starts from the demo preset), or name a preset instead: --config demo "
                          f"(presets: {', '.join(PRESETS)})")
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {path}: expected a mapping of field: value, found a {type(raw).__name__}")
    base = raw.pop("base", None)
    name = raw.pop("preset", None)
    if base is not None and base not in PRESETS:
        raise ConfigError(f"--config {path}: base '{base}' is not a preset; valid presets: {', '.join(PRESETS)}")
    overrides = {}
    for key, value in raw.items():
        if key not in _SETTABLE:
            raise _unknown_field(str(key), f"--config {path}")
        overrides[key] = _coerce(key, value, f"--config {path}")
    return base, None if name is None else str(name), overrides


def get_training_config(preset: str, overrides: dict | None = None) -> TrainingConfig:
    """A preset name or a config file, then `overrides`, validated."""
    if is_config_file(preset):
        base, name, from_file = read_config_file(preset)
        start = replace(PRESETS[base]) if base else TrainingConfig()
        return replace(start, preset=name or str(preset), **(from_file | (overrides or {}))).validate()
    if preset not in PRESETS:
        close = difflib.get_close_matches(preset, PRESETS, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise ConfigError(f"unknown config '{preset}'; {hint}valid configs: {', '.join(PRESETS)}, or a "
                          f"{'/'.join(CONFIG_FILE_SUFFIXES)} file")
    return replace(PRESETS[preset], **(overrides or {})).validate()


# What a resumed run keeps from its checkpoint unless this command sets it: the optimizer, its hyperparameters,
# the loss and the LR schedule. A preset (or a default) changed since the run started reaches new runs only,
# so a checkpoint of an earlier version continues exactly (what the command sets itself follows as before).
RECIPE_FIELDS = ("optimizer", "learning_rate", "min_lr_ratio", "warmup_steps", "lr_schedule", "decay_steps",
                 "decay_fraction", "decay_shape", "max_steps", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps",
                 "muon_momentum", "muon_scale", "cautious_weight_decay", "z_loss", "max_grad_norm")
# Every field the engine reads back from a checkpoint's config record: the recipe, what the checkpoint's state
# must agree with (utils/checkpoint/checkpointer.py KEEP_ON_RESUME, FOLLOW_CONFIG_ON_RESUME), and the model class
# its weights were trained as (utils/model/hf.py load_checkpoint_model).
RECORDED_FIELDS = (*RECIPE_FIELDS, "seed", "optimizer_state_dtype", "model_impl")
# When each of them appeared after the first engine's config (dfae064, which had the others), and what the
# engines before it did: a record they wrote lacks the field, and its run trained with that value
# (`git log -S "    FIELD: " -- configs/training_config.py`; each default at its introduction kept the old way,
# but model_impl's: the native model came with it, and the engines before trained transformers' class).
FIELDS_ADDED = {
    "model_impl": ("2e1d95f", "hf"),
    "optimizer_state_dtype": ("772787b", "fp32"),  # AdamW's moments in fp32
    "lr_schedule": ("98a7c31", "cosine"),  # warmup, then cosine to learning_rate * min_lr_ratio
    "decay_steps": ("98a7c31", 0), "decay_fraction": ("98a7c31", 0.2), "decay_shape": ("98a7c31", "linear"),
    "optimizer": ("3ea89f9", "adamw"),  # AdamW was the only optimizer
    "muon_momentum": ("3ea89f9", 0.95), "z_loss": ("3ea89f9", 0.0),
    "cautious_weight_decay": ("67d5821", False),
    "muon_scale": ("460b1dc", "moonlight"),  # Muon matched AdamW's update RMS (torch's match_rms_adamw) from the start
}


def recorded_settings(saved: dict, where: str) -> dict:
    """The fields a resume reads back from a checkpoint's config record (RECORDED_FIELDS; `saved` may come from a
    bucket, or be crafted), each checked as a setting is: its type as a config file's value, its declared range,
    its choices (ConfigError 'FIELD=VALUE must be ...'); each the record lacks is the value of the engine that wrote
    it (FIELDS_ADDED). A whole record (one naming its preset: every engine's does) lacking a field every engine
    wrote is refused. `where` names the record in an error's line. The one place such a record is checked:
    check_trainer_state (utils/checkpoint/format.py) and keep_recipe both ask here."""
    values = {}
    try:
        for key in RECORDED_FIELDS:
            if key in saved:
                values[key] = _coerce(key, saved[key], where)
                check_range(key, values[key])
                check_choice(key, values[key])
            elif key in FIELDS_ADDED:
                values[key] = FIELDS_ADDED[key][1]
            elif "preset" in saved:
                raise ConfigError(f"{key} is missing, which every engine records")
    except ConfigError as exc:
        raise ConfigError(str(exc) if str(exc).startswith(where) else f"{where}: {exc}") from None
    return values


def keep_recipe(cfg: TrainingConfig, saved: dict, explicit, where: str) -> tuple[TrainingConfig, str | None]:
    """`cfg` with the recipe (RECIPE_FIELDS) of the checkpoint's config `saved` where this command did not set
    the field (`explicit`: the fields it set) and the checkpoint's run started from the same preset or config
    file; and the line that says what was kept (None: nothing). A field the record lacks (an earlier engine's)
    is what that engine trained with (recorded_settings). `where` names the checkpoint's file for an error."""
    try:
        recorded = recorded_settings(saved, where)
        if saved.get("preset") != cfg.preset:
            return cfg, None
        kept = {key: recorded[key] for key in RECIPE_FIELDS
                if key in recorded and key not in explicit and recorded[key] != getattr(cfg, key)}
        continued = replace(cfg, **kept).validate()
    except ConfigError as exc:
        shown = str(exc) if str(exc).startswith(where) else f"{where}: {exc}"
        raise ConfigError(f"{shown}; the checkpoint is corrupt or crafted: resume from another one") from None
    if not kept:
        return cfg, None

    def listed(values) -> str:
        return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())

    return continued, (
        f"resume: the run continues the recipe it started with ({listed(kept)}); '{cfg.preset}' now says "
        f"{listed({k: getattr(cfg, k) for k in kept})}, which reaches new runs (set a field with --set to change it "
        f"here)")


def describe_fields() -> str:
    """Every field with its type, default and meaning: the tail of `train.py --help`."""
    defaults = TrainingConfig()
    width = max(len(name) for name in _SETTABLE)
    lines = []
    for name, f in _SETTABLE.items():
        default = getattr(defaults, name)
        bounds = f.metadata.get("bounds")
        meaning = f.metadata.get("help", "") + (f"; range {bounds.interval}" if bounds else "")
        lines.append(f"  {name:<{width}}  {f.type:<5} {default!r:<16} {meaning}")
    return "\n".join(lines)


def to_yaml(cfg: TrainingConfig) -> str:
    """Every field, `preset` first: as a `--config` file it resolves to the same config (and the same text)."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
