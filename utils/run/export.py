"""The end of a run: the exported model (final_model/, HF format) of a run that finished, and of a resume
that finds its run already finished; and `write_export`, the one way an HF directory is written (these and
scripts/export_hf.py): whole or not at all, a full disk or a file past the size limit one line."""
from __future__ import annotations

from pathlib import Path

from utils import layout
from utils.checkpoint.format import parse_checkpoint_name
from utils.data.dataset_info import FILE as DATASET_FILE
from utils.data.tokenizer import FILE as TOKENIZER_FILE
from utils.io import files
from utils.model.hf import ExportTokenizer, export_hf, load_checkpoint_model
from utils.runtime.run_status import RunStatus

FINAL_MODEL_ADVICE = ("the checkpoints are intact: export one with scripts/export_hf.py CHECKPOINT_DIR OUT_DIR into "
                      "a folder you may write, with space to spare")


def write_export(weights, spec, out: Path, tokenizer, warn=None, advice: str = FINAL_MODEL_ADVICE) -> Path:
    """`export_hf` into a temporary folder beside `out`, renamed to `out` when whole (an earlier export there
    is replaced): a write that fails leaves no half-written model that a later look (`finished_run`, a user's
    rerun into a folder that must be empty) takes for one. No room (a full disk, `ulimit -f`) or no permission
    is one line naming `out` and `advice`."""
    with files.write_guard(out, advice=advice), files.atomic_directory(out) as tmp:
        export_hf(weights, spec, tmp, tokenizer=tokenizer, warn=warn, shown_as=out)
    return out


def export_final_model(model, spec, described: Path, state, output_dir: Path, parallel,
                       log) -> tuple[Path | None, bool]:
    """End of a completed run: check the ranks agree on the weights, export final_model/ (rank 0).
    Returns (export dir or None, weights in sync). Collective: every rank calls it."""
    weights = parallel.full_state_dict(model)  # rank 0 gets it
    in_sync, all_sums = parallel.weights_in_sync(model)
    if not in_sync:
        log.error(f"weights differ between ranks after training: {all_sums}")
    if weights is None:
        return None, in_sync
    tokenizer = ExportTokenizer.find(described)  # its dataset.json names EOS
    if tokenizer is None:
        log.warning(f"no tokenizer.json in {described}, so {output_dir / layout.FINAL_MODEL} has none: "
                    f"AutoTokenizer cannot load it. Export a checkpoint again with scripts/export_hf.py CHECKPOINT "
                    f"OUT --tokenizer PATH (the tokenizer.json the data was prepared with)")
    export_dir = write_export(weights, spec, output_dir / layout.FINAL_MODEL, tokenizer, log.warning)
    log.write_row({"step": state.step, "tokens": state.tokens, "weights_in_sync": in_sync, "weight_sums": all_sums,
                   "final": True})
    log.info(f"Done: {state.step} steps, {state.tokens:,} tokens. Model exported to {export_dir}")
    return export_dir, in_sync


def finished_run(resume_path: Path, max_steps: int, described: Path, output_dir: Path, accelerator, log,
                 lock) -> Path | None:
    """A checkpoint at `max_steps` is a finished run: says so, exports final_model/ from the checkpoint (rank 0)
    only when it is missing, closes the log, frees the output dir and records the run's status; returns
    final_model/. None when there are steps left to train."""
    parsed = parse_checkpoint_name(Path(resume_path).name)
    step = parsed[1] if parsed else None
    if step != max_steps:
        return None
    final = output_dir / layout.FINAL_MODEL
    if accelerator.is_main_process:
        if (final / "config.json").is_file():
            log.info(f"The run already finished: checkpoint {resume_path.name} is at max_steps={step}, and the model "
                     f"is in {final}; nothing to do (raise --max-steps to train further)")
        else:
            spec, weights, _ = load_checkpoint_model(resume_path)
            has_tokenizer = (described / DATASET_FILE).is_file() or (described / TOKENIZER_FILE).is_file()
            write_export(weights, spec, final, described if has_tokenizer else resume_path, log.warning)
            log.info(f"The run already finished at step {step} ({resume_path.name}); final_model/ was missing: "
                     f"exported it to {final}")
    accelerator.wait_for_everyone()
    log.close()
    lock.release()
    RunStatus(0, step=max_steps, checkpoint=str(resume_path), final_model=str(final)).write()
    return final
