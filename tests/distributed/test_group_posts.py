"""A rank's message to rank 0 through the group's store (`post`, `posts`): two ranks as two threads of
this process (no collective involved, so no rank process is needed)."""

from __future__ import annotations

import threading

from blockserve.tensor_parallel.group import TensorParallelGroup
from tests.server_process import free_port


def test_a_rank_s_post_is_read_by_rank_0_under_its_topic_only():
    port = free_port()
    groups: dict[int, TensorParallelGroup] = {}

    def join(rank: int) -> None:
        groups[rank] = TensorParallelGroup(f"tcp://127.0.0.1:{port}", rank, 2)

    joiner = threading.Thread(target=join, args=(1,))
    joiner.start()
    join(0)
    joiner.join()
    try:
        assert groups[0].posts("writes") == {}
        groups[1].post("writes", "the disk tier is full")
        assert groups[0].posts("writes") == {1: "the disk tier is full"}
        assert groups[0].posts("other") == {}
        groups[0].post("writes", "rank 0 too")
        assert groups[1].posts("writes") == {0: "rank 0 too", 1: "the disk tier is full"}
    finally:
        for group in groups.values():
            group.close()
