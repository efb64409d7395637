"""Processes and signals: what keeps a run's processes together and ends them cleanly.

- `launch`: the launcher's supervisor (run by start_training.sh): delivers stop signals, restarts, exit codes;
- `signals`: the stop signal, agreed by every rank at a step boundary; the supervisor watch;
- `run_status`: how a run ended, as rank 0 tells the launcher;
- `distributed`: collectives that strand no rank (rank 0 first, barriers), local shards of DTensors, a
  process exit that no thread of torch can abort;
- `host_memory`: CPU training keeps the large blocks it frees;
- `threads`: how CPU threads wait (set before torch loads OpenMP) and the run's line on how many and why;
- `cpu_share`: a CPU run's threads keep to fewer cores while other programs use them, and spread out again.

May import: utils, utils.io.
"""
