"""Running a step on some ranks without stranding the others: rank 0 first (`main_process_first`), or rank 0
alone (`main_process_only`), with a UserError raised on every rank together rather than leaving the others
at a barrier the failed rank never reaches; and `local_tensor`, this rank's part of a sharded tensor."""
from __future__ import annotations

from utils.errors import UserError


def main_process_first(accelerator, fn):
    """`fn()` on rank 0 first, then on the first process of each other node, then on the rest: each may
    reuse what an earlier one made (a cache, a download), on a shared disk or on its own node's. A UserError
    is raised on each rank only after every rank has passed every barrier, so one rank failing never leaves
    the others waiting at a barrier it will not reach."""
    result = error = None
    turn = 0 if accelerator.is_main_process else 1 if accelerator.is_local_main_process else 2
    for phase in range(3):
        if phase == turn:
            try:
                result = fn()
            except UserError as exc:
                error = exc
        accelerator.wait_for_everyone()
    if error is not None:
        raise error
    return result


def main_process_only(accelerator, fn):
    """`fn()` on rank 0 alone; a UserError it raises stops every rank together: rank 0 raises it (and
    says it), the others exit 2 quietly, instead of waiting at a collective rank 0 will never reach."""
    result = problem = None
    if accelerator.is_main_process:
        try:
            result = fn()
        except UserError as exc:
            problem = exc
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        failed = broadcast_object_list([problem is not None])[0]
        if failed and not accelerator.is_main_process:
            raise SystemExit(2)
    if problem is not None:
        raise problem
    return result


def local_tensor(t):
    """This rank's shard of a DTensor (FSDP2's parameters and gradients); any other tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t
