"""One extra Ray worker node (a raylet with its object store) on this machine, bound to 127.0.0.1.

Started by ``cluster/local.sh up``; runs until SIGTERM. Why not ``ray start --address=...``: on a
machine with another network interface, ``ray start`` either refuses a second node
(``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, which keeps the head on loopback) or rewrites 127.0.0.1 to
the external address (``=1``). This does what ``ray start`` does after those checks, the same way
``ray.cluster_utils.Cluster.add_node`` does: start a ``ray._private.node.Node`` that joins the head.
"""
from __future__ import annotations

import argparse
import os
import signal
import threading

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # this node's processes stay on 127.0.0.1 too

import ray._private.node  # noqa: E402
import ray._private.parameter  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True, help="the head's GCS address, 127.0.0.1:PORT")
    parser.add_argument("--num-cpus", type=int, default=1)
    parser.add_argument("--num-gpus", type=int, default=0)
    parser.add_argument("--object-store-bytes", type=int, default=500 * 1024 ** 2)
    args = parser.parse_args()

    params = ray._private.parameter.RayParams(
        gcs_address=args.address, node_ip_address="127.0.0.1", num_cpus=args.num_cpus, num_gpus=args.num_gpus,
        object_store_memory=args.object_store_bytes,
        include_log_monitor=False,  # the head's log monitor already follows this machine's logs
        node_manager_port=0, dashboard_agent_listen_port=None,  # free ports, not the head's
    )
    node = ray._private.node.Node(params, head=False, shutdown_at_exit=True, spawn_reaper=True)
    print(f"[clsys] worker node {node.node_id} joined {args.address} with {args.num_cpus} CPU(s)", flush=True)

    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
    node.kill_all_processes(check_alive=False, allow_graceful=True)


if __name__ == "__main__":
    main()
