"""Process groups for the context-parallel tests: gloo on loopback, one free port per group."""
import contextlib
import datetime
import os
import socket

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join(rank: int, R: int, port: int) -> None:
    """In a spawned worker: join the group of R processes on ``port``."""
    # a collective one rank never joins fails the test in minutes instead of gloo's default 30
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=R,
                            timeout=datetime.timedelta(minutes=2))


def spawn(worker, R: int, *args) -> None:
    """Run ``worker(rank, R, port, *args)`` in R processes (one thread each, unless set)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(worker, args=(R, free_port(), *args), nprocs=R)


@contextlib.contextmanager
def group_of_one():
    """A process group of this process alone."""
    join(0, 1, free_port())
    try:
        yield
    finally:
        dist.destroy_process_group()
