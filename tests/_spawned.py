"""Run a function in spawned processes joined in one gloo process group (the harness of the
torch.distributed tests): each process calls ``fn(rank)`` and sends back what it returns,
or the error it raised with its traceback."""
from __future__ import annotations

import os
import socket
import traceback
from typing import Any, Callable, Dict

import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world_size: int, port: int, fn: Callable[[int], Any], queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        queue.put((rank, fn(rank)))
    except Exception as err:  # noqa: BLE001 - reported to the test
        queue.put((rank, {"error": f"{type(err).__name__}: {err}\n"
                                   f"{traceback.format_exc()[-3000:]}"}))
    finally:
        dist.destroy_process_group()


def run_spawned(fn: Callable[[int], Any], world_size: int = 2,
                timeout: float = 480) -> Dict[int, Any]:
    """``fn(rank)``'s result by rank, from ``world_size`` spawned processes; fails the test
    naming the error when one of them raised.

    Args:
        fn: a module-level function of the test module (the spawned processes import it).
        world_size: the number of processes.
        timeout: seconds to wait for each result.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(rank, world_size, port, fn, queue))
             for rank in range(world_size)]
    for p in procs:
        p.start()
    out = dict(queue.get(timeout=timeout) for _ in procs)
    for p in procs:
        p.join(60)
    errors = [r["error"] for r in out.values() if isinstance(r, dict) and "error" in r]
    assert not errors, errors
    return out
