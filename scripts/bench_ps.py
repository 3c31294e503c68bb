"""Parameter-server transport benchmark (prints JSON): push + pull through the PS vs raw MPI Send/Recv.

  .venv/bin/python scripts/bench_ps.py [--sizes_kb=1,16,256,1024,16384,65536] [--shards=1,2] [--seconds=0.5]
  .venv/bin/python scripts/bench_ps.py --quick  # CI smoke (seconds): 1 KB and 1 MB, 1 and 2 shards

For every model size (float32 bytes of the whole weight vector) and shard count S, it launches ``mpiexec -n S+1``
(ranks 0..S-1: PS shards running the real service loop, :class:`hetpipe_jax.mpi.ps_server.ParameterServerService`;
rank S: one VW's :class:`hetpipe_jax.mpi.ps_client.MPIPSClient`) and times, in the same processes:

* ``ps``: one wave = push the update (every shard its slice, applied on receipt) + pull the weights (every shard
  answers its slice) + assemble them;
* ``raw``: the same bytes with blocking upper-case ``Send``/``Recv``: the VW sends each shard its slice, each shard
  sends it back.

``ratio`` = raw seconds per wave / PS seconds per wave (1 = as fast as raw MPI; issue 12's target: >= 0.35 at
>= 1 MB). Throughput is ``2 * bytes / seconds`` (push + pull). The machine is shared: compare ratios of one run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
from hetpipe_jax import flag_checks  # noqa: E402

_SIZES_KB = flags.DEFINE_list("sizes_kb", ["1", "16", "256", "1024", "16384", "65536"], "Model sizes in KiB.")
_SHARDS = flags.DEFINE_list("shards", ["1", "2"], "PS shard counts.")
_SECONDS = flags.DEFINE_float("seconds", 0.5, "Target seconds per measurement (at least 3 waves).")
_QUICK = flags.DEFINE_bool("quick", False, "Smoke run: 1 KiB and 1 MiB, 1 and 2 shards, 0.05 s per measurement.")
_WORKER = flags.DEFINE_bool("worker", False, "Internal: run as one rank of the benchmark under mpiexec.")


def _worker(sizes_kb: list[int], seconds: float) -> None:
  import numpy as np
  from mpi4py import MPI
  from hetpipe_jax.ps.param_server import ParameterServer
  from hetpipe_jax.mpi.ps_server import ParameterServerService
  from hetpipe_jax.ps.shards import ShardLayout
  from hetpipe_jax.mpi.ps_client import MPIPSClient
  comm = MPI.COMM_WORLD
  rank, world = comm.Get_rank(), comm.Get_size()
  num_shards = world - 1
  vw_rank = num_shards
  results = []
  for kb in sizes_kb:
    n = kb * 1024 // 4
    offsets = [n * s // num_shards for s in range(num_shards + 1)]
    shards = ShardLayout.build(offsets, list(range(num_shards)), num_shards)
    # how many waves: a short probe of raw exchanges sets the count every rank uses
    reps = np.zeros(1, np.int64)
    # --- raw MPI Send/Recv of the same bytes
    def raw_exchange(count: int) -> float:
      comm.Barrier()
      t0 = time.perf_counter()
      if rank == vw_rank:
        parts = [np.ones(shards.size(s), np.float32) for s in range(num_shards)]
        for _ in range(count):
          for s in range(num_shards):
            comm.Send(parts[s], dest=s, tag=21)
          for s in range(num_shards):
            comm.Recv(parts[s], source=s, tag=22)
      else:
        buf = np.empty(shards.size(rank), np.float32)
        for _ in range(count):
          comm.Recv(buf, source=vw_rank, tag=21)
          comm.Send(buf, dest=vw_rank, tag=22)
      comm.Barrier()
      return time.perf_counter() - t0

    probe = raw_exchange(3) / 3
    reps[0] = max(3, min(2000, int(seconds / max(probe, 1e-6))))
    comm.Bcast(reps, root=vw_rank)
    count = int(reps[0])
    raw_s = raw_exchange(count) / count
    # --- the PS: push + pull per wave, through the service loop
    comm.Barrier()
    if rank == vw_rank:
      client = MPIPSClient(comm, 0, n, 1, shards=shards if num_shards > 1 else None, first_vw_rank=num_shards)
      delta = np.full(n, 1e-6, np.float32)
      for wave in range(2):  # warm-up
        client.push(wave, delta, 0.0, 1)
        client.request_pull(wave + 1)
        while client.poll_pull() is None:
          time.sleep(1e-5)  # yields the core (the shards share it on this machine)
      t0 = time.perf_counter()
      for wave in range(2, 2 + count):
        client.push(wave, delta, 0.0, 1)
        client.request_pull(wave + 1)
        while client.poll_pull() is None:
          time.sleep(1e-5)  # yields the core (the shards share it on this machine)
      ps_s = (time.perf_counter() - t0) / count
      client.finish(2 + count, {})
      results.append({"size_bytes": 4 * n, "num_shards": num_shards, "waves": count,
                      "raw_s_per_wave": raw_s, "ps_s_per_wave": ps_s,
                      "raw_gb_per_s": 2 * 4 * n / raw_s / 1e9, "ps_gb_per_s": 2 * 4 * n / ps_s / 1e9,
                      "ratio": raw_s / ps_s})
    else:
      server = ParameterServer(np.zeros(shards.size(rank), np.float32), 1)
      service = ParameterServerService(comm, server, num_minibatches_per_vw=0, num_inflight=1, evaluate=None,
                                       eval_every_waves=0, log_every_waves=10 ** 9, log_metrics=lambda line: None,
                                       progress=False, first_vw_rank=num_shards, lead=rank == 0)
      service.run()
    comm.Barrier()
  if rank == vw_rank:
    print(json.dumps(results), flush=True)


def main(argv) -> None:
  del argv
  if _QUICK.value:
    flag_checks.refuse_replaced("--quick", ["sizes_kb", "seconds"])
  sizes = [1, 1024] if _QUICK.value else [int(s) for s in _SIZES_KB.value]
  seconds = 0.05 if _QUICK.value else _SECONDS.value
  if _WORKER.value:
    _worker(sizes, seconds)
    return
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
  env = {**os.environ, "PYTHONPATH": root}
  rows = []
  for shards in [int(s) for s in _SHARDS.value]:
    cmd = [mpiexec if os.path.exists(mpiexec) else "mpiexec", "-n", str(shards + 1), sys.executable,
           os.path.abspath(__file__), "--worker", f"--sizes_kb={','.join(map(str, sizes))}", f"--seconds={seconds}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root, timeout=900, check=False)
    if proc.returncode != 0:
      raise SystemExit(f"error: bench_ps worker with {shards} shards failed:\n{proc.stderr[-2000:]}")
    rows += json.loads(proc.stdout.strip().splitlines()[-1])
  big = [r["ratio"] for r in rows if r["size_bytes"] >= 1 << 20]
  print(json.dumps({"rows": rows, "min_ratio_at_1mb_or_more": min(big) if big else None,
                    "target_ratio_at_1mb_or_more": 0.35,
                    "meets_target": (min(big) >= 0.35) if big else None,
                    "machine": {"cpus": os.cpu_count(), "loadavg": os.getloadavg()}}, indent=2))


if __name__ == "__main__":
  app.run(main)
