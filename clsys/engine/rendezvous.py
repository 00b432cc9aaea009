"""The process group's rendezvous store, listening on the node's Ray address only.

Ray Train's own set-up lets rank 0's ``init_process_group`` start torch's TCPStore, which listens on
every interface of the machine (``::``): on a laptop or a shared host that is a port open to the
network for the whole run. torch has no option for the address, but a TCPStore server can take a
socket that is already listening. So rank 0 binds one to its Ray node address (127.0.0.1 in a local
cluster, the cluster-network address on a multi-node one), serves the store from it, and every rank,
rank 0 included, joins it as a client, as torchelastic's ranks join their agent's store
(``TORCHELASTIC_USE_AGENT_STORE``). Everything else is Ray Train's torch set-up, unchanged.
"""
from __future__ import annotations

import os
import socket
from datetime import timedelta

import ray
from ray.train.torch.config import (
    TorchConfig,
    _set_torch_distributed_env_vars,
    _setup_torch_process_group,
    _TorchBackend,
)

_served = []  # rank 0's listening socket and store server, alive as long as its process


def _serve_store(world_size: int, timeout_s: int) -> tuple[str, int]:
    import torch.distributed as dist

    address = ray.util.get_node_ip_address()
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.bind((address, 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    store = dist.TCPStore(address, port, world_size, is_master=True, master_listen_fd=listener.fileno(),
                          wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    _served.extend([listener, store])
    return address, port


def _join_store(address: str, port: int) -> None:
    os.environ.update({"MASTER_ADDR": address, "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True"})
    _set_torch_distributed_env_vars()  # RANK, LOCAL_RANK, WORLD_SIZE, ... as Ray Train sets them


class _BoundStoreBackend(_TorchBackend):
    def on_start(self, worker_group, backend_config: TorchConfig) -> None:
        address, port = worker_group.execute_single(0, _serve_store, len(worker_group), backend_config.timeout_s)
        worker_group.execute(_join_store, address, port)
        ray.get([worker_group.execute_single_async(rank, _setup_torch_process_group, backend=backend_config.backend,
                                                   world_rank=rank, world_size=len(worker_group),
                                                   init_method="env://", timeout_s=backend_config.timeout_s)
                 for rank in range(len(worker_group))])


class BoundStoreTorchConfig(TorchConfig):
    """``TorchConfig`` (``backend`` must be given) whose rendezvous store listens on the node's Ray address only."""

    @property
    def backend_cls(self):
        return _BoundStoreBackend
