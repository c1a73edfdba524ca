"""A tensor-parallel rank other than 0: it loads its shard and runs each step rank 0 sends it.

    rank 0 (engine process)                       rank r > 0 (this module)
    ───────────────────────                       ────────────────────────
    join ──────────── rendezvous ──────────────── join
    EngineConfig ─── broadcast ─────────────────► load this rank's shard (weights narrowed as read)
    gather ◄──────── (ok, KV memory) | error ──── report
    (KV config, max_num_seqs, max_model_len) ───► check its KV specs equal rank 0's; build a ModelRunner
    gather ◄──────── ok | error ───────────────── report
    with kv_offload_dir: (dtype, marker, sizes) ► check rank 0's marker file is in its directory; its tiers
    gather ◄──────── (ok, fingerprint) | error ── fingerprint of its own shard ("rank r of N")
    every rank's fingerprints ─── broadcast ────► its store: writes its entries of the save orders
    per step: SchedulerOutput ─── broadcast ────► the same forward (collectives inside); no sampling
    read at steps with saves ◄── group store ──── post, once after a step, if its writes stopped (disk full)
    read by stats() ◄─────────── group store ──── post its writer's counts, at most once a second (writer thread)
    None ──────────── broadcast ────────────────► leave

Started by a launcher with the env:// variables set, or the same way by the engine (`spawn`,
rank_process.py, which also passes BLOCKSERVE_TP_READY_FD):

    MASTER_ADDR=<rank 0's host> MASTER_PORT=<port> RANK=<r> WORLD_SIZE=<N> python -m blockserve.distributed.worker

It needs no flags: the model and every engine setting come from rank 0. Any error ends the process
with a non-zero status after telling rank 0 (a report at start-up; mid-run, its connections close,
which fails rank 0's step at once), its traceback's last line on stderr naming the error.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import traceback
from datetime import timedelta

import torch

from blockserve.distributed.rank_process import READY_FD
from blockserve.tensor_parallel.group import TensorParallelGroup

logger = logging.getLogger("blockserve.worker")


def _report(error: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(error), error)).strip()


def run_worker(init_method: str = "env://", rank: int | None = None, size: int | None = None,
               startup_timeout_s: float = 600.0, joining=None) -> None:
    """Serve as one rank until rank 0 says stop; raises what went wrong (after reporting it to rank 0).
    `joining()`, if given, is called once the rank's modules are imported, just before it joins."""
    from blockserve.attention.paged_attention import BACKENDS
    from blockserve.models.loader import load_model
    from blockserve.models.placement import Placement
    from blockserve.worker.model_runner import ModelRunner

    startup = timedelta(seconds=startup_timeout_s)
    store = None
    if joining is not None:
        joining()
    group = TensorParallelGroup(init_method, rank, size, timeout=startup)
    try:
        config = group.broadcast_object(timeout=startup)
        group.timeout = timedelta(seconds=config.distributed_timeout_s)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        try:
            loaded = load_model(config.model, BACKENDS[config.attention_backend],
                                quantized_matmul=config.quantized_matmul,
                                quantized_activations=config.quantized_activations,
                                quantized_max_rows=config.quantized_max_rows,
                                placement=Placement(tp=group, keep_16bit_weights=config.dtype == "auto"))
            report = ("ok", config.kv_cache_bytes())
        except Exception as error:
            report = ("error", _report(error))
        group.gather_objects(report, timeout=startup)
        if report[0] == "error":
            return
        setup = group.broadcast_object(timeout=startup)
        if setup is None:  # rank 0 failed after loading: nothing to serve
            return
        kv_config, max_num_seqs, max_model_len = setup
        specs = loaded.model.kv_cache_specs(config.block_size)
        mismatched = [layer for g in kv_config.groups for layer in g.layer_names
                      if layer not in specs or config.kv_spec(specs[layer]) != g.spec]
        report = ("ok", None) if not mismatched else (
            "error", f"rank {group.rank}'s KV specs differ from rank 0's for layers {mismatched[:4]}")
        group.gather_objects(report, timeout=startup)
        if mismatched:
            return
        runner = ModelRunner(loaded.model, kv_config, max_num_seqs, max_model_len, config.seed, device="cpu")
        topic = None
        if config.kv_offload_dir is not None:
            store, topic = _offload_store(group, config, kv_config, loaded.model, startup)
            if store is None:
                return
            runner.offload = store
        while (step := group.broadcast_object(wait_forever=True)) is not None:
            if step.blocks_to_load:  # one payload per rank after rank 0: this rank's
                step = dataclasses.replace(step, blocks_to_load={
                    g: [(block, payloads[group.rank - 1]) for block, payloads in loads]
                    for g, loads in step.blocks_to_load.items()})
            runner.execute(step)
            if topic is not None and not store.writing:  # its writes stopped: rank 0 stops ordering saves
                group.post(topic, store.stopped_why or "its writes stopped")
                topic = None
    finally:
        if store is not None:
            store.close()  # writes what is queued
        group.close()


def _offload_store(group, config, kv_config, model, startup):
    """(this rank's second-tier store, the topic it posts to when its writes stop) (executor.py's
    `_share_offload` on rank 0), or (None, None) when this rank could not set it up (reported to
    rank 0, which stops)."""
    from blockserve.distributed.executor import counts_text, writer_counts_topic, writes_stopped_topic
    from blockserve.kv.tiers import DiskTier, TieredKVStore
    from blockserve.worker.kv_fingerprint import model_fingerprint

    dtype, marker, (queue_bytes, disk_bytes) = group.broadcast_object(timeout=startup)
    tiers = None
    try:
        if not os.path.exists(os.path.join(config.kv_offload_dir, marker)):
            raise ValueError(f"rank {group.rank} does not see rank 0's --kv-offload-dir "
                             f"{os.path.abspath(config.kv_offload_dir)!r}: every rank reads the others' entries, "
                             "so they need one directory (a file system they share)")
        tiers = [DiskTier(config.kv_offload_dir, disk_bytes)]
        report = ("ok", model_fingerprint(model, config, kv_config, dtype, group.rank, group.size))
    except Exception as error:
        report = ("error", _report(error))
    group.gather_objects(report, timeout=startup)
    if report[0] == "error":
        return None, None
    fingerprints = group.broadcast_object(timeout=startup)
    counts = writer_counts_topic(marker)
    store = TieredKVStore(tiers, fingerprints, queue_bytes, loader_thread=False, rank=group.rank,
                          report=lambda c: group.post(counts, counts_text(c)))
    return store, writes_stopped_topic(marker)


def _tell_the_engine_when_joining():
    """The engine that started this rank waits for one byte on the pipe READY_FD names (none: a launcher's rank)."""
    fd = os.environ.pop(READY_FD, None)
    if fd is None:
        return None

    def joining() -> None:
        os.write(int(fd), b"1")
        os.close(int(fd))

    return joining


if __name__ == "__main__":
    joining = _tell_the_engine_when_joining()
    # a rank the engine started logs only warnings and errors: the engine's log speaks for every rank
    logging.basicConfig(level=logging.INFO if joining is None else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        run_worker("env://", joining=joining)
    except Exception:
        logger.exception("tensor-parallel worker failed")
        sys.exit(1)
