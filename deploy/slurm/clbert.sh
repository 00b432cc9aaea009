#!/bin/bash
# Contrastive pretraining (python -m clsys.pretrain) on a SLURM allocation of N nodes.
#
#   sbatch [sbatch options] deploy/slurm/clbert.sh [pretrain args...]
#   sbatch -N 4 --gpus-per-node=8 --cpus-per-task=64 deploy/slurm/clbert.sh \
#       --config clsys/configs/simcse_unsup.yaml data.url=s3://b/shards train.run_root=s3://b/runs
#
# One task per node. The first node of the allocation runs the Ray head, the other nodes Ray worker
# nodes (srun steps of this job); once all N have joined, this batch shell runs the driver,
#   python -m clsys.pretrain --resume latest [your options] cluster.num_workers=W cluster.use_gpu=G \
#       cluster.cpus_per_worker=C [your overrides]
# with RAY_ADDRESS set to the head. W: one Ray Train worker per GPU; on nodes without GPUs
# (cluster.use_gpu=false) one worker per node using all of the node's CPUs. Your overrides come last
# and win. `--resume latest` is always passed: a requeued job continues from the newest complete
# checkpoint, a first run (no checkpoint yet) starts fresh.
#
# Stopping and requeueing: SLURM sends SIGUSR1 to this shell 10 minutes before the time limit
# (--signal=B:USR1@600); `scancel --signal=USR1 --batch JOBID` does the same by hand (say, before a
# maintenance window). The script passes it on to the driver, whose workers write a checkpoint at
# the next step and stop; the driver exits with 75, the script stops Ray and requeues the job
# (`scontrol requeue`): its next run appends to the same log (--open-mode=append) and resumes from
# that checkpoint. SIGTERM, SIGINT and SIGHUP (scancel, preemption) are passed on as SIGUSR1 too, so
# the driver checkpoints if SLURM's KillWait gives it time, but never requeue: a cancelled job stays
# cancelled (a partition with PreemptMode=REQUEUE requeues preempted jobs itself).
#
# Exit code: the driver's (0 done, 2 bad config or data, 75 stopped on request and requeued, other:
# training failed); 64: bad usage/environment (not under SLURM, python without clsys/ray);
# 69: the Ray cluster did not come up (the message says which node or which timeout).
#
# Every #SBATCH default below can be overridden on the sbatch command line (`sbatch -t 4:00:00 ...`).
# Add --exclusive for whole nodes, --gpus-per-node=G (or your site's --gres=gpu:G) for GPUs,
# -p/-A for partition and account.
#SBATCH --job-name=clbert
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=8
#SBATCH --time=24:00:00
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
#SBATCH --signal=B:USR1@600
#
# Environment (the job inherits the environment sbatch is run from; or sbatch --export=ALL,NAME=value):
#   CLSYS_SETUP            shell code run first in this shell, e.g.
#                          'module load cuda/12.4; source /shared/clsys/.venv/bin/activate';
#                          the srun steps (Ray nodes) inherit the environment it leaves
#   CLSYS_PYTHON           python with clsys and ray[default] installed (default: python3 on PATH)
#   CLSYS_CONTAINER        command prefix for every Ray and python process (word-split),
#                          e.g. 'apptainer exec --nv --bind /scratch /shared/clsys.sif'
#   CLSYS_DIR              working directory (default: where sbatch was run); relative paths in the
#                          pretrain args are relative to it
#   CLSYS_ARGS             pretrain args, word-split, used when the script gets no arguments
#   CLSYS_WORKERS          Ray Train workers (default: the cluster's GPUs; without GPUs: the nodes)
#   CLSYS_CPUS_PER_WORKER  CPUs reserved per worker (default: a node's CPUs / its share of workers)
#   CLSYS_CPUS_PER_NODE    CPUs Ray may use per node (default: the job's CPUs per task)
#   CLSYS_GPUS_PER_NODE    GPUs Ray may use per node (default: SLURM's GPUs of the job on that node, else 0)
#   CLSYS_HEAD_IP          address the nodes reach the head at (default: the first node's hostname,
#                          resolved on that node; it must not be a loopback address on N > 1 nodes)
#   CLSYS_RAY_PORT         Ray GCS port (6379)
#   CLSYS_RAY_DASHBOARD_PORT  Ray dashboard port (8265; "off": no dashboard), bound to the head IP
#   CLSYS_RAY_CLIENT_PORT  Ray client server port (10001)
#   CLSYS_RAY_HEAD_ARGS, CLSYS_RAY_WORKER_ARGS  more `ray start` options (word-split) for the head /
#                          the other nodes, e.g. '--temp-dir=/local/ray --object-store-memory=20000000000'
#   CLSYS_JOIN_TIMEOUT     seconds for the head to start and all N nodes to join (600)
#   CLSYS_STOP_TIMEOUT     seconds for Ray to stop on the nodes before its steps are killed (60)
#   RAY_AUTH_MODE          token (default) or disabled. The token: RAY_AUTH_TOKEN if set, else the
#                          file RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token (read here, passed on to all
#                          nodes in the environment), else a new random one for this job. Never printed.

set -uo pipefail

log() { printf '[clbert] %s\n' "$*"; }
fail() { # fail CODE MESSAGE: error to the job log (stderr), then exit (the EXIT trap stops Ray)
    local code=$1
    shift
    printf '[clbert] error: %s\n' "$*" >&2
    exit "$code"
}

[[ -n ${SLURM_JOB_ID:-} ]] || fail 64 "not inside a SLURM job: submit with sbatch [options] $0 [pretrain args]"

cd "${CLSYS_DIR:-${SLURM_SUBMIT_DIR:-.}}" || fail 64 "cannot cd to ${CLSYS_DIR:-${SLURM_SUBMIT_DIR:-.}}"
if [[ -n ${CLSYS_SETUP:-} ]]; then
    # `module` and activate scripts are not written for `set -u`.
    set +u
    eval "$CLSYS_SETUP" || fail 64 "CLSYS_SETUP failed: $CLSYS_SETUP"
    set -u
fi

PY=${CLSYS_PYTHON:-python3}
CONTAINER=()
read -r -a CONTAINER <<<"${CLSYS_CONTAINER:-}"
RAY=("${CONTAINER[@]}" "$PY" -m ray.scripts.scripts)
RAY_PORT=${CLSYS_RAY_PORT:-6379}
DASHBOARD_PORT=${CLSYS_RAY_DASHBOARD_PORT:-8265}
CLIENT_PORT=${CLSYS_RAY_CLIENT_PORT:-10001}
JOIN_TIMEOUT=${CLSYS_JOIN_TIMEOUT:-600}
STOP_TIMEOUT=${CLSYS_STOP_TIMEOUT:-60}
HEAD_ARGS=()
WORKER_ARGS=()
read -r -a HEAD_ARGS <<<"${CLSYS_RAY_HEAD_ARGS:-}"
read -r -a WORKER_ARGS <<<"${CLSYS_RAY_WORKER_ARGS:-}"
# Python's and Ray's output reaches the job log as it happens.
export PYTHONUNBUFFERED=1
# Ray nodes stop when training is over: no 30 s "drain" on SIGTERM first (it also waits for a GCS
# that the same SIGTERM is stopping).
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=${RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S:-0}

mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
NNODES=${#NODES[@]}
((NNODES > 0)) || fail 64 "no nodes in SLURM_JOB_NODELIST='${SLURM_JOB_NODELIST:-}'"
HEAD=${NODES[0]}
log "job $SLURM_JOB_ID, run $((${SLURM_RESTART_COUNT:-0} + 1)) (restarts: ${SLURM_RESTART_COUNT:-0}), $NNODES node(s): ${NODES[*]}"

"${CONTAINER[@]}" "$PY" -c 'import clsys, ray' ||
    fail 64 "'${CONTAINER[*]} $PY' cannot import clsys and ray: set CLSYS_PYTHON or CLSYS_SETUP (see the top of $0)"

# srun does not inherit the job's --cpus-per-task (SLURM 22.05+): ask for it again, so that each Ray
# node's step gets (and is bound to) all of the task's CPUs.
STEP=(--ntasks-per-node=1 --overlap)
if [[ -n ${SLURM_CPUS_PER_TASK:-} ]]; then
    STEP+=(--cpus-per-task="$SLURM_CPUS_PER_TASK")
fi

# --- state and cleanup ---------------------------------------------------------------------------
HEAD_PID=""
WORKERS_PID=""
DRIVER_PID=""
RESENDER_PID=""
STOP_REQUESTED=""
FINISHING=""

stop_ray() {
    # SIGTERM to the Ray steps' tasks: `ray start --block` then stops the Ray processes of its node,
    # and only those (`ray stop` would stop every Ray on the machine). SIGTERM to srun itself would
    # SIGKILL the step at once; that is the fallback after CLSYS_STOP_TIMEOUT.
    local pids=() pid step deadline
    [[ -n $HEAD_PID ]] || return 0
    for pid in "$WORKERS_PID" "$HEAD_PID"; do
        if [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null; then
            pids+=("$pid")
        fi
    done
    WORKERS_PID=""
    HEAD_PID=""
    if ((${#pids[@]} == 0)); then
        log "Ray had already stopped on all nodes (its output is above)"
        return 0
    fi
    log "stopping Ray on $NNODES node(s)"
    for step in $(squeue --steps --jobs="$SLURM_JOB_ID" --noheader --format='%i %j' 2>/dev/null |
        awk '$2 == "clbert-ray-workers" || $2 == "clbert-ray-head" {print $1}'); do
        scancel --signal=TERM "$step" 2>/dev/null
    done
    deadline=$((SECONDS + STOP_TIMEOUT))
    for pid in "${pids[@]}"; do
        while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do
            sleep 1
        done
        if kill -0 "$pid" 2>/dev/null; then
            log "Ray did not stop within ${STOP_TIMEOUT}s: killing its step (srun pid $pid)"
            kill -TERM "$pid" 2>/dev/null
        fi
        wait "$pid" 2>/dev/null
    done
}

stop_resender() { # before the driver's pid can be reused
    if [[ -n $RESENDER_PID ]]; then
        kill "$RESENDER_PID" 2>/dev/null
        wait "$RESENDER_PID" 2>/dev/null
        RESENDER_PID=""
    fi
}

# shellcheck disable=SC2329  # called by the EXIT trap
on_exit() {
    if [[ -n $DRIVER_PID ]] && kill -0 "$DRIVER_PID" 2>/dev/null; then
        kill -TERM "$DRIVER_PID" 2>/dev/null
        wait "$DRIVER_PID" 2>/dev/null
    fi
    stop_resender
    stop_ray
}
trap on_exit EXIT

on_signal() { # $1: the signal this shell got
    [[ -z $FINISHING ]] || return 0
    case $1 in
    USR1) [[ -n $STOP_REQUESTED ]] || STOP_REQUESTED=USR1 ;;
    *) STOP_REQUESTED=$1 ;; # a cancel (scancel, preemption): never requeued by this script
    esac
    if [[ -z $DRIVER_PID ]]; then
        log "got SIG$1 before training started: stopping"
        return 0
    fi
    log "got SIG$1: asking the driver (pid $DRIVER_PID) to checkpoint at the next step and stop"
    if [[ -z $RESENDER_PID ]]; then
        # The driver ignores SIGUSR1 until its handler is installed (after it joined Ray), so the
        # request is repeated until it exits; its handler acts on the first one only.
        (while kill -USR1 "$DRIVER_PID" 2>/dev/null; do sleep 10; done) &
        RESENDER_PID=$!
    fi
}
for sig in USR1 TERM INT HUP; do
    # shellcheck disable=SC2064  # $sig is expanded now, on purpose
    trap "on_signal $sig" "$sig"
done

requeue() {
    FINISHING=1
    stop_ray
    log "requeueing job $SLURM_JOB_ID: its next run resumes from the newest checkpoint (--resume latest)"
    scontrol requeue "$SLURM_JOB_ID" ||
        log "scontrol requeue failed (submitted with --no-requeue?): submit the same command again to resume"
}

# --- head address, Ray settings --------------------------------------------------------------------
HEAD_IP=${CLSYS_HEAD_IP:-}
if [[ -z $HEAD_IP ]]; then
    HEAD_IP=$(srun --nodes=1 --ntasks=1 --overlap -w "$HEAD" hostname --ip-address |
        tr ' ' '\n' | grep -E -m1 '^[0-9]+(\.[0-9]+){3}$')
    [[ -n $HEAD_IP ]] || fail 69 "could not resolve the IPv4 address of $HEAD on it: set CLSYS_HEAD_IP"
    if ((NNODES > 1)) && [[ $HEAD_IP == 127.* ]]; then
        fail 69 "$HEAD resolves to the loopback address $HEAD_IP, which the other nodes cannot reach: set CLSYS_HEAD_IP"
    fi
fi
export RAY_ADDRESS="$HEAD_IP:$RAY_PORT"
# Ray replaces a 127.0.0.1 node address with the machine's outward one unless
# RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, and with 0 it refuses to start worker nodes: 0 only for a single
# node on loopback, 1 (Linux's default) otherwise. Set for every Ray process here, the driver included.
if ((NNODES == 1)) && [[ $HEAD_IP == 127.* ]]; then
    export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
else
    export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1
fi

export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
if [[ $RAY_AUTH_MODE == token && -z ${RAY_AUTH_TOKEN:-} ]]; then
    token_file=${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}
    if [[ -r $token_file ]]; then
        RAY_AUTH_TOKEN=$(<"$token_file")
        log "Ray token authentication, token from $token_file"
    else
        RAY_AUTH_TOKEN=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')
        log "Ray token authentication, with a token made for this job"
    fi
    export RAY_AUTH_TOKEN
fi

DASHBOARD=(--include-dashboard=false)
if [[ $DASHBOARD_PORT != off ]]; then
    DASHBOARD=(--include-dashboard=true --dashboard-host="$HEAD_IP" --dashboard-port="$DASHBOARD_PORT")
fi

# Run on each node by its step: the CPUs and GPUs SLURM gave the job there, unless overridden.
# shellcheck disable=SC2016  # expanded by the step's shell, on the node
NODE_CMD='cpus=${CLSYS_CPUS_PER_NODE:-${SLURM_CPUS_PER_TASK:-$(nproc)}}
gpus=${CLSYS_GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-0}}
exec "$@" --num-cpus="$cpus" --num-gpus="$gpus"'

# --- Ray head, then the other nodes ------------------------------------------------------------------
log "Ray head on $HEAD at $RAY_ADDRESS"
srun --nodes=1 --ntasks=1 -w "$HEAD" -J clbert-ray-head "${STEP[@]}" bash -c "$NODE_CMD" ray-head \
    "${RAY[@]}" start --head --block --node-ip-address="$HEAD_IP" --port="$RAY_PORT" \
    --ray-client-server-port="$CLIENT_PORT" "${DASHBOARD[@]}" --disable-usage-stats "${HEAD_ARGS[@]}" &
HEAD_PID=$!

deadline=$((SECONDS + JOIN_TIMEOUT))
until (exec 3<>"/dev/tcp/$HEAD_IP/$RAY_PORT") 2>/dev/null; do
    kill -0 "$HEAD_PID" 2>/dev/null || fail 69 "the Ray head on $HEAD exited before listening on $RAY_ADDRESS (its output is above)"
    ((SECONDS < deadline)) || fail 69 "the Ray head on $HEAD did not listen on $RAY_ADDRESS within ${JOIN_TIMEOUT}s"
    [[ -z $STOP_REQUESTED ]] || break
    sleep 1
done

if ((NNODES > 1)) && [[ -z $STOP_REQUESTED ]]; then
    others=$(
        IFS=,
        echo "${NODES[*]:1}"
    )
    log "Ray worker nodes: ${NODES[*]:1}"
    srun --nodes=$((NNODES - 1)) --ntasks=$((NNODES - 1)) -w "$others" -J clbert-ray-workers "${STEP[@]}" bash -c "$NODE_CMD" ray-worker \
        "${RAY[@]}" start --block --address="$RAY_ADDRESS" --disable-usage-stats "${WORKER_ARGS[@]}" &
    WORKERS_PID=$!
fi

# Wait until all nodes are alive in the cluster; prints: nodes CPUs GPUs min-CPUs-per-node.
JOIN_PY='
import sys, time
import ray
want, deadline = int(sys.argv[1]), time.time() + float(sys.argv[2])
ray.init(logging_level="ERROR", log_to_driver=False)
while True:
    nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
    if len(nodes) >= want or time.time() > deadline:
        break
    time.sleep(1)
print(len(nodes), int(sum(n.get("CPU", 0) for n in nodes)), int(sum(n.get("GPU", 0) for n in nodes)),
      int(min(n.get("CPU", 0) for n in nodes)))
sys.exit(0 if len(nodes) >= want else 1)
'
if [[ -z $STOP_REQUESTED ]]; then
    left=$((deadline - SECONDS))
    ((left > 0)) || left=1
    joined_file=$(mktemp)
    "${CONTAINER[@]}" "$PY" -c "$JOIN_PY" "$NNODES" "$left" >"$joined_file" &
    join_pid=$!
    while kill -0 "$join_pid" 2>/dev/null; do
        if ! kill -0 "$HEAD_PID" 2>/dev/null; then
            kill "$join_pid" 2>/dev/null
            fail 69 "Ray exited on the head node $HEAD (its output is above)"
        elif [[ -n $WORKERS_PID ]] && ! kill -0 "$WORKERS_PID" 2>/dev/null; then
            kill "$join_pid" 2>/dev/null
            fail 69 "Ray exited on the worker nodes ${NODES[*]:1} (their output is above)"
        elif [[ -n $STOP_REQUESTED ]]; then
            kill "$join_pid" 2>/dev/null
            break
        fi
        sleep 1
    done
    wait "$join_pid"
    status=$?
    read -r JOINED TOTAL_CPUS TOTAL_GPUS MIN_CPUS < <(tail -n 1 "$joined_file")
    rm -f "$joined_file"
    if [[ -z $STOP_REQUESTED ]]; then
        ((status == 0)) ||
            fail 69 "only ${JOINED:-0} of $NNODES nodes joined the Ray cluster within ${JOIN_TIMEOUT}s (their output is above)"
        log "Ray cluster up: $JOINED node(s), $TOTAL_CPUS CPU(s), $TOTAL_GPUS GPU(s)"
    fi
fi
if [[ $STOP_REQUESTED == USR1 ]]; then
    requeue
    exit 75
elif [[ -n $STOP_REQUESTED ]]; then
    exit 143
fi

# --- the driver ----------------------------------------------------------------------------------------
ARGS=("$@")
if ((${#ARGS[@]} == 0)) && [[ -n ${CLSYS_ARGS:-} ]]; then
    read -r -a ARGS <<<"$CLSYS_ARGS"
fi
# argparse takes the overrides in one run of positionals: options first, then overrides.
OPTIONS=()
OVERRIDES=()
user_workers="" user_gpu="" user_cpus=""
i=0
while ((i < ${#ARGS[@]})); do
    arg=${ARGS[i]}
    i=$((i + 1))
    case $arg in
    --config | --resume)
        value=${ARGS[i]:-}
        i=$((i + 1))
        if [[ $arg == --resume && ${SLURM_RESTART_COUNT:-0} -gt 0 ]]; then
            log "restarted job: ignoring --resume $value, resuming from the newest checkpoint"
            continue
        fi
        OPTIONS+=("$arg" "$value")
        ;;
    --resume=*)
        if ((${SLURM_RESTART_COUNT:-0} > 0)); then
            log "restarted job: ignoring $arg, resuming from the newest checkpoint"
            continue
        fi
        OPTIONS+=("$arg")
        ;;
    -*) OPTIONS+=("$arg") ;;
    *)
        case $arg in
        cluster.num_workers=*) user_workers=${arg#*=} ;;
        cluster.use_gpu=*) user_gpu=${arg#*=} ;;
        cluster.cpus_per_worker=*) user_cpus=${arg#*=} ;;
        esac
        OVERRIDES+=("$arg")
        ;;
    esac
done

if [[ -n $user_gpu ]]; then
    case ${user_gpu,,} in true | 1 | yes) USE_GPU=true ;; *) USE_GPU=false ;; esac
elif ((TOTAL_GPUS > 0)); then
    USE_GPU=true
else
    USE_GPU=false
fi
if [[ $USE_GPU == true ]]; then
    WORKERS=${CLSYS_WORKERS:-${user_workers:-$TOTAL_GPUS}}
else
    WORKERS=${CLSYS_WORKERS:-${user_workers:-$NNODES}}
fi
per_node=$(((WORKERS + NNODES - 1) / NNODES))
CPUS_PER_WORKER=${CLSYS_CPUS_PER_WORKER:-${user_cpus:-$((MIN_CPUS / per_node))}}
((CPUS_PER_WORKER > 0)) || CPUS_PER_WORKER=1

CMD=("${CONTAINER[@]}" "$PY" -m clsys.pretrain --resume latest "${OPTIONS[@]}"
    "cluster.num_workers=$WORKERS" "cluster.use_gpu=$USE_GPU" "cluster.cpus_per_worker=$CPUS_PER_WORKER"
    "${OVERRIDES[@]}")
log "driver: ${CMD[*]}"
# SIGUSR1 is ignored by the driver until it installs its handler (it would kill it before that).
(
    trap '' USR1
    exec "${CMD[@]}"
) &
DRIVER_PID=$!
if [[ -n $STOP_REQUESTED ]]; then # a signal came while the driver was being started
    on_signal "$STOP_REQUESTED"
fi
while :; do
    wait "$DRIVER_PID"
    rc=$?
    # A trapped signal interrupts `wait` (status > 128) while the driver runs on.
    if ((rc > 128)) && kill -0 "$DRIVER_PID" 2>/dev/null; then
        continue
    fi
    break
done
FINISHING=1
DRIVER_PID=""
stop_resender
log "driver exited with $rc"

# 75: the driver checkpointed and stopped on request. Requeue unless the job is being cancelled:
# `scontrol requeue` would bring back a job cancelled with scancel (SIGTERM), and a job preempted
# with PreemptMode=REQUEUE is requeued by SLURM itself.
if ((rc == 75)) && [[ -z $STOP_REQUESTED || $STOP_REQUESTED == USR1 ]]; then
    requeue
fi
exit "$rc"
