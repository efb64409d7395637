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


def exit_process(main) -> None:
    """Runs `main()` and ends the process with its status (SystemExit's and an uncaught exception's as Python
    gives them) without finalizing the interpreter: what Python's exit does first (joining non-daemon threads, the
    atexit handlers, flushing stdout and stderr) runs while the interpreter is whole, then `os._exit`.

    Why: torch's gloo worker threads outlive `destroy_process_group()` while anything holds their group (DDP's
    reducer does, past its module's deletion and a garbage collection), and one that drops a finished
    collective's tensors after their Python object is gone must take the GIL to release it. Once the main thread
    is finalizing the interpreter, CPython ends such a thread with pthread_exit, whose unwinding through a noexcept
    C++ destructor calls std::terminate: "terminate called without an active exception" and SIGABRT at the exit
    of a run that had finished (a 2-rank CPU launch's rank 1, 1 in ~51 under load; 10 in 12 with both ranks on
    one core and no destroy_process_group, 0 in 12 so). Without that finalization no thread meets it."""
    import atexit
    import os
    import sys
    import threading

    try:
        code = main()
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # noqa: BLE001 - said as Python says it, with its exit status
        sys.excepthook(*sys.exc_info())
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    shutdown = getattr(threading, "_shutdown", None)  # what the interpreter's exit runs first
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a console gone: nothing left to say on it
            pass
    os._exit(code & 0xFF)
