#!/usr/bin/env bash
# Launch train.py through `accelerate launch` on 1..N GPUs, N CPU processes, or several nodes, under a
# supervisor (utils/runtime/launch.py) that delivers a scheduler's SIGTERM to the training ranks however it is sent
# (to this PID, as a container's PID 1, to the process group, by timeout or SLURM) and waits for their
# checkpoint. Run with --help for the options. Everything accelerate needs is passed on its command line;
# no `accelerate config` file is required.
# Stop signals are caught from the first line on. Before the supervisor starts: nothing has started, nothing to
# save. Once it runs (a child of this script, below), each goes to it, held until it catches signals itself.
supervisor="" supervisor_ready=0 held_signals=() stop_exit_code=0
on_stop() {
    if [[ -z "$supervisor" ]]; then
        echo "start_training.sh: stopped by a signal before training started; nothing to save" >&2
        exit "$stop_exit_code"
    elif [[ "$supervisor_ready" == 1 ]]; then
        kill -s "$1" "$supervisor" 2>/dev/null || true
    else
        held_signals+=("$1")
    fi
}
trap 'on_stop TERM' TERM
trap 'on_stop HUP' HUP
trap 'on_stop USR1' USR1
trap 'on_stop INT' INT
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PROG="start_training.sh"

# Python for the checks below: the repo's .venv when set up
if [[ -x "$SCRIPT_DIR/.venv/bin/python" ]]; then
    export VIRTUAL_ENV="$SCRIPT_DIR/.venv"
    export PATH="$VIRTUAL_ENV/bin:$PATH"
fi
python="$(command -v python3 || command -v python || true)"

# The lists of choices (presets, precisions, resume forms) come from configs/ (one home for each).
PRESET_CHOICES="a preset" PRECISION_CHOICES="a precision" RESUME_CHOICES="auto | latest | a checkpoint"
load_choices() {
    [[ -n "$python" ]] && eval "$(PYTHONPATH="$SCRIPT_DIR${PYTHONPATH:+:$PYTHONPATH}" "$python" -m configs.query --choices 2>/dev/null)" || true
}

usage() {
    load_choices
    cat <<EOF
Usage: ./$PROG --config NAME [options] [-- extra train.py args]

Launches train.py with accelerate. The command is printed on one line before it runs.

Required:
  --config NAME|FILE       training preset ($PRESET_CHOICES: configs/presets/) or a .yaml/.json file

Where it runs:
  --gpus N                 processes per node (default: every visible GPU). Without --cpu each
                           process gets one GPU; N may not exceed the visible GPUs.
  --cpu                    run on the CPU: --gpus N starts N processes over gloo (default 1).
                           Same distributed code path as GPUs; useful for tests and laptops.
                           With no GPU visible and neither --cpu nor --gpus, one CPU process runs.
  --strategy ddp|fsdp      ddp (default): every process holds the whole model; fsdp: parameters,
                           gradients and optimizer state sharded over the processes (FSDP2), sharded
                           checkpoints (sets --set strategy=...; works with --cpu too)
  --nodes N                number of machines (default 1); run this script once on each of them
  --node-rank R            this machine's rank, 0..N-1 (default 0)
  --node-rank-from VAR     this machine's rank is the value of the environment variable VAR
                           (a Kubernetes Indexed Job's pods: JOB_COMPLETION_INDEX; deploy/kubernetes/)
  --main-addr HOST         address of the rank-0 machine (required when --nodes > 1)
  --main-port P            port on the rank-0 machine (default 29500; one machine: a free one)

Forwarded to train.py:
  --resume X               $RESUME_CHOICES
  --max-steps N            stop after N optimizer steps
  --mixed-precision M      $PRECISION_CHOICES (default: the preset's)
  --no-background-upload   upload checkpoints in the foreground
  --set KEY=VALUE          any training-config field (repeatable; python train.py --help lists them)
  -- ARGS...               everything after -- goes to train.py unchanged (e.g. --output-dir DIR;
                           default: runs/RUN_NAME/ here, RUN_NAME being run_name or the preset's name)

Restarts (inside the allocation; see docs/preemptible-gpus.md):
  --max-restarts N         when a training process dies after a training step (killed, a CUDA error, a lost
                           peer, the hang watchdog), end the others and relaunch every rank with --resume auto
                           from the newest complete checkpoint, up to N times (default 0: no restarts). A stop
                           signal, a setting or input error (exit 2) or a failure before the first step is
                           never retried.
  --restart-delay S        seconds before the first restart, doubled for each next one, at most 300 (default 10)
  --stop-exit-code N       exit with N (4..255) instead of 0 when a stop signal ended the run before it finished
                           (its checkpoint written, or nothing to save yet): a Kubernetes Job takes a pod that
                           exits 0 as done, so deploy/kubernetes/ sets 143 and its podFailurePolicy reschedules it

Other:
  --dry-run                print the accelerate command and exit without running it
  -h, --help               this text

Stopping (preemption): SIGTERM, SIGHUP or SIGUSR1 to this script's PID, to its process group, or to it as a
container's PID 1 (docker stop, Kubernetes), from timeout or from SLURM: every training process finishes
its current optimizer step, rank 0 writes a checkpoint (the launcher waits as long as that takes), and
the script exits 0 (--stop-exit-code N: N) with a last line naming the checkpoint. Ctrl-C does the same; a
second Ctrl-C stops the processes at once. Continue with --resume auto (or latest).

Without this script: torchrun --nproc-per-node N train.py --config NAME ... works too (set
ACCELERATE_USE_CPU=true for CPU processes); it then delivers signals itself (and SIGKILLs ranks 30 s
after a SIGTERM), so prefer this script where jobs get preempted.

Environment:
  CUDA_VISIBLE_DEVICES     limits the GPUs counted and used
  TRAIN_SCRIPT             script to launch instead of train.py (used by the tests)
  OMP_NUM_THREADS          CPU threads per process (CPU runs default to cores / processes)
  OMP_WAIT_POLICY, GOMP_SPINCOUNT   how those threads wait (default: a short spin, then sleep; see
                           docs/contracts.md)

Examples:
  ./$PROG --config demo                                  # anywhere: one process (GPU if present)
  ./$PROG --config demo --cpu --gpus 2                   # two CPU processes over gloo
  ./$PROG --config production --gpus 8                   # one node, 8 GPUs
  ./$PROG --config production --resume auto              # continue the newest checkpoint, if any
  ./$PROG --config demo --set max_steps=50 --set learning_rate=1e-3
  ./$PROG --config production --gpus 8 --nodes 2 --node-rank 0 --main-addr 10.0.0.1   # on node 0
  ./$PROG --config production --gpus 8 --nodes 2 --node-rank 1 --main-addr 10.0.0.1   # on node 1
  ./$PROG --config production --gpus 8 --nodes 2 --node-rank-from JOB_COMPLETION_INDEX --main-addr neox-0.neox \
      --resume auto --stop-exit-code 143                 # in each pod of a Kubernetes Indexed Job (deploy/kubernetes/)
EOF
}

usage_error() {  # a mistake on the command line: one line, exit 2
    echo "$PROG: error: $1" >&2
    exit 2
}

fail() {  # the machine is not set up for it: one line, exit 1
    echo "$PROG: error: $1" >&2
    exit 1
}

is_count() { [[ "$1" =~ ^[0-9]+$ ]]; }
# A number bash's arithmetic holds exactly: it wraps past 2^63 without a word (400 nines compare as -1), so a
# number of more than 18 digits (leading zeros aside) is refused in one line before any comparison.
check_size() {  # check_size FLAG VALUE (a whole number, or seconds with a fraction)
    local whole="${2%%.*}"
    whole="${whole#"${whole%%[!0]*}"}"
    [[ "${#whole}" -le 18 ]] || usage_error "$1: a number of ${#whole} digits is out of range (at most 18 digits)"
}
whole() {  # whole FLAG VALUE: prints VALUE in base 10 (bash reads a leading 0 as octal: 08 is no number to it)
    is_count "$2" || usage_error "$1 '$2' is not a whole number"
    check_size "$1" "$2"
    echo "$((10#$2))"
}

# --- arguments ---------------------------------------------------------------------------------------
config="" gpus="" cpu=0 nodes=1 node_rank="" node_rank_from="" main_addr="" main_port="" strategy="ddp" dry_run=0
mixed_precision="" max_restarts=0 restart_delay=10
train_args=()
sets=()
extra_args=()

need_value() {  # need_value FLAG NUMBER_OF_REMAINING_ARGS
    [[ "$2" -ge 2 ]] || usage_error "$1 needs a value"
}

while [[ $# -gt 0 ]]; do
    arg="$1"
    if [[ "$arg" == --*=* ]]; then  # --flag=value -> --flag value
        set -- "${arg%%=*}" "${arg#*=}" "${@:2}"
        arg="$1"
    fi
    case "$arg" in
        -h|--help) usage; exit 0 ;;
        --config) need_value "$1" $#; config="$2"; shift 2 ;;
        --gpus) need_value "$1" $#; gpus="$2"; shift 2 ;;
        --cpu) cpu=1; shift ;;
        --nodes) need_value "$1" $#; nodes="$2"; shift 2 ;;
        --node-rank) need_value "$1" $#; node_rank="$(whole --node-rank "$2")" || exit 2; shift 2 ;;
        --node-rank-from) need_value "$1" $#; node_rank_from="$2"; shift 2 ;;
        --main-addr) need_value "$1" $#; main_addr="$2"; shift 2 ;;
        --main-port) need_value "$1" $#; main_port="$2"; shift 2 ;;
        --strategy) need_value "$1" $#; strategy="$2"; sets+=(--set "strategy=$2"); train_args+=(--set "strategy=$2")
                    shift 2 ;;
        --resume) need_value "$1" $#; train_args+=(--resume "$2"); shift 2 ;;
        --max-steps) need_value "$1" $#; is_count "$2" || usage_error "--max-steps '$2' is not a whole number"
                     check_size "$1" "$2"; train_args+=(--max-steps "$2"); shift 2 ;;
        --mixed-precision) need_value "$1" $#  # checked with the config, below
                     train_args+=(--mixed-precision "$2"); mixed_precision="$2"; shift 2 ;;
        --no-background-upload) train_args+=(--no-background-upload); shift ;;
        --set) need_value "$1" $#; [[ "$2" == *=* ]] || usage_error "--set '$2': expected KEY=VALUE"
               train_args+=(--set "$2"); sets+=(--set "$2"); shift 2 ;;
        --max-restarts) need_value "$1" $#; is_count "$2" || usage_error "--max-restarts '$2' is not a whole number"
                        check_size "$1" "$2"; max_restarts="$2"; shift 2 ;;
        --restart-delay) need_value "$1" $#; [[ "$2" =~ ^[0-9]+(\.[0-9]+)?$ ]] \
                             || usage_error "--restart-delay '$2' is not a number of seconds"
                         check_size "$1" "$2"; restart_delay="$2"; shift 2 ;;
        --stop-exit-code) need_value "$1" $#
                          [[ "$2" =~ ^0*[0-9]{1,3}$ ]] && (( 10#$2 == 0 || (10#$2 >= 4 && 10#$2 <= 255) )) \
                              || usage_error "--stop-exit-code '$2': give a status from 4 to 255, or 0 (the default: \
a finished run's; 1, 2 and 3 are a failure's, a setting error's and a hang's)"
                          stop_exit_code=$((10#$2)); shift 2 ;;
        --dry-run) dry_run=1; shift ;;
        --) shift; extra_args=("$@"); break ;;
        --output-dir|--data-dir|--print-config) usage_error "$1 is a train.py option: put it after -- (e.g. -- $1 ...)" ;;
        *) usage_error "unknown option '$1' (train.py options go after --; ./$PROG --help lists the options)" ;;
    esac
done

[[ -n "$config" ]] || { load_choices; usage_error "--config NAME is required ($PRESET_CHOICES, or a .yaml/.json file; ./$PROG --help lists the options)"; }
[[ -z "$gpus" ]] || gpus="$(whole --gpus "$gpus")" || exit 2
[[ -z "$gpus" || "$gpus" -ge 1 ]] || usage_error "--gpus must be at least 1"
nodes="$(whole --nodes "$nodes")" || exit 2
[[ "$nodes" -ge 1 ]] || usage_error "--nodes $nodes must be at least 1"
rank_source=""  # where the node's rank came from, as an error names it
if [[ -n "$node_rank_from" ]]; then
    [[ -z "$node_rank" ]] || usage_error "give --node-rank R or --node-rank-from VAR, not both"
    [[ "$node_rank_from" =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] \
        || usage_error "--node-rank-from '$node_rank_from' is not an environment variable's name (e.g. JOB_COMPLETION_INDEX)"
    [[ -n "${!node_rank_from+set}" ]] || usage_error "--node-rank-from $node_rank_from: the variable is not set \
(a Kubernetes Indexed Job sets JOB_COMPLETION_INDEX in each pod: completionMode: Indexed); elsewhere give --node-rank R"
    node_rank="${!node_rank_from}"
    is_count "$node_rank" || usage_error "--node-rank-from $node_rank_from: its value is not a whole number (a node's rank)"
    node_rank="$(whole "--node-rank-from $node_rank_from" "$node_rank")" || exit 2
    rank_source="--node-rank-from $node_rank_from ($node_rank_from=$node_rank)"
fi
node_rank="${node_rank:-0}"
rank_source="${rank_source:-"--node-rank $node_rank"}"
[[ "$node_rank" -lt "$nodes" ]] || usage_error "$rank_source must be below --nodes $nodes"
[[ -z "$main_port" ]] || main_port="$(whole --main-port "$main_port")" || exit 2
[[ -z "$main_port" ]] || [[ "$main_port" -ge 1 && "$main_port" -le 65535 ]] \
    || usage_error "--main-port $main_port is not a port number (1 to 65535)"
case "$strategy" in ddp|fsdp) ;; *) usage_error "--strategy '$strategy': use ddp or fsdp" ;; esac
if [[ "$nodes" -gt 1 && -z "$main_addr" ]]; then
    usage_error "--nodes $nodes needs --main-addr HOST (the address of the node with --node-rank 0)"
fi

# --- environment -------------------------------------------------------------------------------------
train_script="${TRAIN_SCRIPT:-$SCRIPT_DIR/train.py}"
[[ -f "$train_script" ]] || fail "training script not found: $train_script"
[[ -n "$python" ]] || fail "no python3 on PATH; run ./setup.sh first"

# The preset (or config file) and --set values, checked before anything starts; and the run's mixed
# precision, which accelerate wants on its command line (fp8 runs torchao's float8 inside bf16).
if ! precision="$(PYTHONPATH="$SCRIPT_DIR${PYTHONPATH:+:$PYTHONPATH}" "$python" -m configs.query mixed_precision \
                  --config "$config" "${sets[@]}" \
                  ${mixed_precision:+--mixed-precision "$mixed_precision"} 2>&1)"; then
    echo "$PROG: ${precision##*$'\n'}" >&2
    exit 2
fi
precision="${precision##*$'\n'}"  # the value is the last line (a config warning may come before it)
[[ "$precision" == fp8 ]] && precision=bf16

# GPUs this process may use: `nvidia-smi -L` lines, narrowed by CUDA_VISIBLE_DEVICES when it is set.
visible_gpus() {
    command -v nvidia-smi >/dev/null 2>&1 || { echo 0; return; }
    local listing count
    if ! listing="$(nvidia-smi -L 2>&1)"; then
        if ! grep -qi "no devices" <<<"$listing"; then
            echo "$PROG: warning: 'nvidia-smi -L' failed (${listing%%$'\n'*}); counting no GPUs" >&2
        fi
        echo 0; return
    fi
    count="$(grep -cE '^GPU [0-9]+:' <<<"$listing" || true)"
    if [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then
        local ids=() id listed=0
        IFS=',' read -ra ids <<<"${CUDA_VISIBLE_DEVICES// /}"
        for id in "${ids[@]}"; do  # CUDA stops at the first invalid entry
            [[ -n "$id" && "$id" != -* && "$id" != NoDevFiles ]] || break
            listed=$((listed + 1))
        done
        [[ "$listed" -lt "$count" ]] && count="$listed"
    fi
    echo "$count"
}

visible="$(visible_gpus)"
if [[ "$cpu" -eq 1 ]]; then
    per_node="${gpus:-1}"
elif [[ "$visible" -eq 0 ]]; then
    if [[ -n "$gpus" ]]; then
        usage_error "--gpus $gpus: asked for $gpus GPU(s) but no NVIDIA GPU is visible; add --cpu to run $gpus process(es) on the CPU"
    fi
    echo "$PROG: no NVIDIA GPU visible: running one CPU process (--cpu --gpus N runs N CPU processes)"
    cpu=1
    per_node=1
else
    per_node="${gpus:-$visible}"
    if [[ "$per_node" -gt "$visible" ]]; then
        [[ "$visible" -eq 1 ]] && verb="is" || verb="are"
        usage_error "--gpus $per_node: asked for $per_node GPUs but $visible $verb visible (nvidia-smi -L, CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset})"
    fi
fi
total=$((per_node * nodes))

# --- the accelerate command --------------------------------------------------------------------------
env_args=()
threads_choice=""
launch=()
# accelerate-launch: accelerate's own entry point for `accelerate launch` (the same parser and launch), without
# the `accelerate` CLI's other commands (its `estimate-memory` imports transformers): ~1 CPU-s less at every
# launch and restart
if [[ -x "$(dirname "$(command -v python3 || echo /nonexistent)")/accelerate-launch" ]]; then
    launch=(accelerate-launch)
else
    command -v python3 >/dev/null 2>&1 && python3 -c 'import importlib.util as u, sys; sys.exit(u.find_spec("accelerate") is None)' \
        || fail "no .venv here and python3 on PATH has no accelerate; run ./setup.sh first"
    launch=(python3 -m accelerate.commands.launch)
fi
launch+=(--num_processes "$total" --num_machines "$nodes" --dynamo_backend no --mixed_precision "$precision")
if [[ "$total" -gt 1 ]]; then
    launch+=(--multi_gpu)  # torchrun's multi-process launcher; FSDP is applied by train.py itself
fi
if [[ "$cpu" -eq 1 ]]; then
    # `accelerate launch --cpu` starts a single process whatever --num_processes says; several CPU
    # processes go through the multi-GPU (torchrun) launcher with ACCELERATE_USE_CPU, which selects gloo.
    env_args+=(ACCELERATE_USE_CPU=true)
    [[ "$total" -eq 1 ]] && launch+=(--cpu)
    if [[ -z "${OMP_NUM_THREADS:-}" ]]; then  # how they wait: utils/runtime/threads.py, in each rank
        cores="$(nproc 2>/dev/null || echo 1)"
        threads=$((cores / per_node)); [[ "$threads" -ge 1 ]] || threads=1
        env_args+=(OMP_NUM_THREADS="$threads")
        threads_choice="start_training.sh: $cores core(s) / $per_node process(es) per node"
    fi
fi
if [[ "$nodes" -gt 1 ]]; then
    launch+=(--machine_rank "$node_rank" --main_process_ip "$main_addr" --main_process_port "${main_port:-29500}")
elif [[ -n "$main_port" ]]; then
    launch+=(--main_process_port "$main_port")
elif [[ "$total" -gt 1 ]]; then
    # one machine, no --main-port: a free port, so runs side by side never meet at torchrun's 29500
    main_port="$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')" \
        || fail "cannot find a free port for the ranks to meet on; give one with --main-port P"
    launch+=(--main_process_port "$main_port")
fi

cmd=("${launch[@]}" "$train_script" --config "$config" "${train_args[@]}" "${extra_args[@]}")
printed="$(printf '%q ' "${cmd[@]}")"
echo "+ ${env_args[*]:+${env_args[*]} }${printed% }"
[[ "$dry_run" -eq 1 ]] && exit 0

for assignment in "${env_args[@]}"; do
    export "${assignment?}"
done
if [[ -n "$threads_choice" ]]; then
    export NEOX_THREADS_CHOICE="$threads_choice"  # the ranks' first lines say why they have that many
fi
# The supervisor runs as a child in a session of its own (a signal to this script's process group reaches it
# once, through this script), never exec'd: an exec'd interpreter dies of a stop signal that comes before its
# first line has installed its handlers. A signal until then is held here and handed over once it catches them.
supervisor_script="$SCRIPT_DIR/utils/runtime/launch.py"
catches_stops() {  # whether process $1 is the supervisor with its handlers for SIGTERM and SIGINT (bits 14 and 1
    # of /proc's SigCgt). Past its exec only: the shell forked to start it shows this script's traps until it execs.
    # Builtins only, no command substitution: a signal whose trap runs while bash parses a `$(...)` here (this
    # loop is where a stop signal meets the script once the supervisor exists) left bash's parser broken ("trap:
    # line 2: unexpected EOF while looking for matching `)'") and the held signal lost: the run trained on.
    local argv=() line mask=""
    { mapfile -d '' argv < "/proc/$1/cmdline"; } 2>/dev/null || return 1
    [[ " ${argv[*]} " == *" $supervisor_script "* ]] || return 1
    { while IFS= read -r line; do
        if [[ "$line" == SigCgt:* ]]; then mask="${line#SigCgt:}"; mask="${mask//[[:space:]]/}"; break; fi
    done < "/proc/$1/status"; } 2>/dev/null || return 1
    [[ -n "$mask" ]] && (( (16#$mask >> 14) & 1 )) && (( (16#$mask >> 1) & 1 ))
}
set +e
export NEOX_LAUNCHER_PID=$$  # the ranks stop with a checkpoint if this script is SIGKILLed (utils/runtime/launch.py)
# The supervisor runs with -S (no site hooks, so no installed project either): the repo's packages by path.
export PYTHONPATH="$SCRIPT_DIR${PYTHONPATH:+:$PYTHONPATH}"
if command -v setsid >/dev/null 2>&1; then
    setsid "$python" -S "$supervisor_script" --max-restarts "$max_restarts" --restart-delay "$restart_delay" \
        --stop-exit-code "$stop_exit_code" -- "${cmd[@]}" &  # -S: no site hooks, it catches sooner
else
    "$python" -S "$supervisor_script" --max-restarts "$max_restarts" --restart-delay "$restart_delay" \
        --stop-exit-code "$stop_exit_code" -- "${cmd[@]}" &
fi
supervisor=$!
while kill -0 "$supervisor" 2>/dev/null && ! catches_stops "$supervisor"; do
    sleep 0.01
done
supervisor_ready=1
for held in "${held_signals[@]}"; do
    kill -s "$held" "$supervisor" 2>/dev/null
done
while kill -0 "$supervisor" 2>/dev/null; do
    wait "$supervisor"  # returns early when a signal's trap ran; the supervisor goes on
done
wait "$supervisor"
exit $?
