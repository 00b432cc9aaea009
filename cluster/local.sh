#!/usr/bin/env bash
# A multi-node Ray cluster on one machine, every process bound to 127.0.0.1.
#
#   cluster/local.sh up      a head (dashboard and job server on 127.0.0.1:8265, no CPUs of its own)
#                            plus CLSYS_LOCAL_NODES worker nodes (raylets) of CLSYS_LOCAL_NODE_CPUS each
#   cluster/local.sh status  `ray status` of that cluster
#   cluster/local.sh down    stop exactly the processes `up` started (not other Ray clusters)
#
# Then, from the repository root:
#   export RAY_AUTH_MODE=token RAY_ADDRESS=http://127.0.0.1:8265
#   ray job submit --runtime-env cluster/runtime_env.yaml --working-dir . -- \
#       python -m clsys.pretrain data.url=$PWD/runs/shards/enwiki-sample train.run_root=$PWD/runs
#
# Environment (defaults): CLSYS_RAY_PORT (6380) GCS port, CLSYS_DASHBOARD_PORT (8265),
# CLSYS_LOCAL_NODES (2), CLSYS_LOCAL_NODE_CPUS (1), CLSYS_LOCAL_DIR (/tmp/clsys-local-<port>) for
# pid files and logs, CLSYS_PYTHON (python3 on PATH, e.g. .venv/bin/python) with clsys installed.
# Ray's token authentication is on (RAY_AUTH_MODE=token; the token is ~/.ray/auth_token, created
# on first use): clients need RAY_AUTH_MODE=token too.
set -euo pipefail

port=${CLSYS_RAY_PORT:-6380}
dashboard_port=${CLSYS_DASHBOARD_PORT:-8265}
nodes=${CLSYS_LOCAL_NODES:-2}
node_cpus=${CLSYS_LOCAL_NODE_CPUS:-1}
state=${CLSYS_LOCAL_DIR:-/tmp/clsys-local-$port}
python=${CLSYS_PYTHON:-python3}
here=$(cd "$(dirname "$0")" && pwd)
ray_bin=$(dirname "$(command -v "$python")")/ray

# Keep every Ray process on loopback (see docs/running/ray.md, "Ray on one machine"), with token auth.
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=token

wait_for() {  # wait_for SECONDS WHAT COMMAND...: poll COMMAND every second until it succeeds
    local deadline=$((SECONDS + $1)) what=$2
    shift 2
    until "$@" >/dev/null 2>&1; do
        if ((SECONDS >= deadline)); then
            echo "error: $what not ready after ${SECONDS} s; logs in $state" >&2
            return 1
        fi
        sleep 1
    done
}

node_joined() {  # the node launcher prints this line once the head has registered its raylet
    grep -q "joined 127.0.0.1:$port" "$state/$1.log"
}

all_nodes_listed() {  # `ray status` reports from the autoscaler's view, which lags the raylets' registration
    local listed
    listed=$("$ray_bin" status --address="127.0.0.1:$port" 2>/dev/null | grep -c " node_") || return 1
    ((listed == nodes + 1))
}

start() {  # start a command in its own session, record its pid as $1
    local name=$1
    shift
    setsid "$@" >"$state/$name.log" 2>&1 < /dev/null &
    echo $! >"$state/$name.pid"
}

up() {
    if [[ -e $state/head.pid ]]; then
        echo "error: a local cluster is already recorded in $state (run: $0 down)" >&2
        exit 1
    fi
    mkdir -p "$state"
    # Token auth needs a token before the head starts (`ray start` does not create one); never print it.
    "$ray_bin" get-auth-token --generate >/dev/null
    start head "$ray_bin" start --head --block --num-cpus=0 --node-ip-address=127.0.0.1 --port="$port" \
        --dashboard-host=127.0.0.1 --dashboard-port="$dashboard_port" --disable-usage-stats
    wait_for 120 "the head" grep -q "block forever until terminated" "$state/head.log"
    for ((i = 1; i <= nodes; i++)); do  # one at a time: a small machine is slow to start raylets
        start "node-$i" "$python" "$here/local_node.py" --address="127.0.0.1:$port" --num-cpus="$node_cpus"
        wait_for 120 "worker node $i" node_joined "node-$i"
    done
    wait_for 120 "the cluster's node list" all_nodes_listed
    echo "[clsys] local Ray cluster up: head 127.0.0.1:$port (0 CPUs) + $nodes node(s) x $node_cpus CPU(s)"
    echo "  export RAY_AUTH_MODE=token RAY_ADDRESS=http://127.0.0.1:$dashboard_port"
}

down() {
    local pids=() pidfile pid
    for pidfile in "$state"/*.pid; do
        [[ -e $pidfile ]] || continue
        pids+=("$(cat "$pidfile")")
    done
    if ((${#pids[@]} == 0)); then
        echo "no local cluster recorded in $state"
        return 0
    fi
    # Each part runs in its own session (setsid): signal the whole process group, workers included.
    for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
    for _ in $(seq 30); do
        local alive=0
        for pid in "${pids[@]}"; do
            if pgrep -g "$pid" >/dev/null 2>&1 || pgrep -s "$pid" >/dev/null 2>&1; then alive=1; fi
        done
        ((alive)) || break
        sleep 1
    done
    for pid in "${pids[@]}"; do pkill -KILL -s "$pid" 2>/dev/null || true; done
    rm -f "$state"/*.pid
    echo "[clsys] local Ray cluster down"
}

case ${1:-} in
    up) up ;;
    down) down ;;
    status) "$ray_bin" status --address="127.0.0.1:$port" ;;
    *) echo "usage: $0 up|status|down" >&2; exit 2 ;;
esac
