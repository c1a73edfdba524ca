"""The tensor-parallel process group: N ranks over gloo (CPU tensors), joined by rendezvous.

    init_method      who sets it                        what it reads
    env://           torchrun, or any launcher          MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    tcp://host:port  the engine, for the ranks it spawns the rank and size given here

The group is a value held by whoever joined it (the engine, a worker, the model's layers through
its Placement), never torch.distributed's global default group: a process may hold several, one
after another or at once, and nothing outside sees them. Collectives run on this group's gloo
backend: NCCL would be the choice on GPUs (a device group next to this CPU one).

Timeouts: every collective inside a step fails after `timeout` (a rank that died or hangs), so
nothing waits forever; a rank waiting for the next step waits as long as the engine is idle
(`broadcast_object(..., wait_forever=True)`), and still fails at once when the peer's connection
closes.

Besides collectives, a rank can leave a short message for rank 0 in the rendezvous's key-value store
(`post`, `posts`): rank 0 reads it when it chooses, so a rare event (a rank's disk-tier writes
stopping) costs no collective per step.
"""

from __future__ import annotations

import pickle
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT = timedelta(seconds=60)
_POSTS = "blockserve/posts"  # the store's keys of `post`
_FOREVER = timedelta(days=365)


class TensorParallelGroup:
    """Rank `rank` of `size`, joined through `init_method`; `close()` leaves the group.

    ValueError for a malformed init_method or rank; RuntimeError (torch's) when the rendezvous
    or a collective fails or times out."""

    def __init__(self, init_method: str, rank: int | None = None, size: int | None = None,
                 timeout: timedelta = DEFAULT_TIMEOUT):
        if not (init_method.startswith("env://") or init_method.startswith("tcp://")):
            raise ValueError(f"init_method {init_method!r}: use env:// (torchrun sets MASTER_ADDR, MASTER_PORT, "
                             "RANK, WORLD_SIZE) or tcp://host:port with a rank and a size")
        kwargs = {} if init_method.startswith("env://") else {"rank": rank, "world_size": size}
        if rank is not None and size is not None and not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside a group of {size} ranks")
        store, self.rank, self.size = next(dist.rendezvous(init_method, timeout=timeout, **kwargs))
        store.set_timeout(timeout)
        self.timeout = timeout
        self._store = store  # kept alive: rank 0's process serves it
        self._posting = threading.Lock()  # posts come from several threads (a rank's step loop and its writer)
        self._pg = dist.ProcessGroupGloo(store, self.rank, self.size, timeout)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor, *, op: dist.ReduceOp = dist.ReduceOp.SUM,
                   timeout: timedelta | None = None) -> torch.Tensor:
        """Reduce `tensor` over the ranks (a sum by default), in place; returns it."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        opts.timeout = timeout or self.timeout
        self._pg.allreduce([tensor], opts).wait()
        return tensor

    def gather_to_first(self, tensor: torch.Tensor, *, timeout: timedelta | None = None) -> list[torch.Tensor] | None:
        """Every rank's `tensor` (equal shapes), in rank order, on rank 0; None on the others."""
        outputs = [[torch.empty_like(tensor) for _ in range(self.size)]] if self.is_first else []
        opts = dist.GatherOptions()
        opts.rootRank = 0
        opts.timeout = timeout or self.timeout
        self._pg.gather(outputs, [tensor], opts).wait()
        return outputs[0] if self.is_first else None

    def broadcast_object(self, obj=None, *, wait_forever: bool = False, timeout: timedelta | None = None):
        """Rank 0's picklable `obj`, on every rank (others pass nothing). wait_forever: the
        receiving ranks wait without a timeout (for the next step of an idle engine)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = _FOREVER if wait_forever else timeout or self.timeout
        if self.is_first:
            payload = _to_bytes(obj)
            size = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self._pg.broadcast([size], opts).wait()
        opts.timeout = timeout or self.timeout
        if not self.is_first:
            payload = torch.empty(int(size), dtype=torch.uint8)
        self._pg.broadcast([payload], opts).wait()
        return obj if self.is_first else pickle.loads(payload.numpy().tobytes())

    def gather_objects(self, obj, *, timeout: timedelta | None = None) -> list | None:
        """Every rank's picklable `obj`, in rank order, on rank 0; None on the others."""
        payload = _to_bytes(obj)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        longest = int(self.all_reduce(size.clone(), op=dist.ReduceOp.MAX, timeout=timeout))
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: payload.numel()] = payload
        sizes, datas = self.gather_to_first(size, timeout=timeout), self.gather_to_first(padded, timeout=timeout)
        if sizes is None:
            return None
        return [pickle.loads(data[: int(n)].numpy().tobytes()) for n, data in zip(sizes, datas)]

    def post(self, topic: str, text: str) -> None:
        """Leave `text` under `topic` from this rank in the group's store (served by the rendezvous's
        host: rank 0's process): a message off the steps' path, no collective; `posts(topic)` reads it.
        A rank's later post under a topic replaces its earlier one. Safe from any thread."""
        with self._posting:
            self._store.set(f"{_POSTS}/{topic}/{self.rank}", text.encode())
            self._store.add(f"{_POSTS}/{topic}", 1)  # after the text: a count above 0 finds it

    def posts(self, topic: str) -> dict[int, str]:
        """The texts posted under `topic` so far, by rank; while there are none, one round trip to the store."""
        with self._posting:
            if self._store.add(f"{_POSTS}/{topic}", 0) == 0:
                return {}
            keys = {rank: f"{_POSTS}/{topic}/{rank}" for rank in range(self.size)}
            return {rank: self._store.get(key).decode() for rank, key in keys.items() if self._store.check([key])}

    def barrier(self) -> None:
        self._pg.barrier().wait()

    def close(self) -> None:
        """Leave the group (idempotent); collectives in flight on other ranks fail."""
        pg, self._pg = self._pg, None
        if pg is not None:
            pg.abort()
        self._store = None

    def __repr__(self) -> str:
        return f"TensorParallelGroup(rank={self.rank}, size={self.size})"


def _to_bytes(obj) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
