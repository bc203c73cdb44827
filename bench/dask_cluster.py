"""fastattn.dask on a LocalCluster of 2 single-threaded worker processes against
fastattn.attention on 2 threads in one process: B4 H8 N4096 d64 causal, float32,
for several chunk sizes (query and key rows a chunk).

    python bench/dask_cluster.py [--repeats 5] [--chunks 512,1024,2048,4096]

The inputs are persisted on the workers before timing; the result is either kept on
the workers (out.sum() computed: its blocks stay where they were made, as a
pipeline's next step would read them) or gathered to the client (out computed: one
32 MiB array concatenated and sent).  Each figure is the median of the
repeats; "x one process" is the one-process time over the cluster's (above 1: the
cluster is faster).  Two rows bound what any chunking can reach on the cluster: a
trivial graph (four one-element chunks summed: the scheduling alone), and one chunk
a batch (four pair tasks, no key splits and no merges: only the scheduling, the
inputs' transfers and the two workers side by side)."""

import argparse
import statistics
import time

import dask.array as da
import distributed
import numpy as np

import fastattn
import fastattn.dask as fdask

B, H, N, D = 4, 8, 4096, 64


def median_time(fn, repeats):
    fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def pair_tasks(out):
    """The (query block, key block) tasks of a fastattn.dask result's graph."""
    return sum(1 for key in dict(out.__dask_graph__())
               if isinstance(key, tuple) and key[0].startswith("fastattn-part-"))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--chunks", default="512,1024,2048,4096")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, H, N, D)).astype(np.float32) for _ in range(3))
    one = median_time(lambda: fastattn.attention(q, k, v, causal=True, num_threads=2), args.repeats)
    flop = 4 * B * H * N * (N + 1) / 2 * D
    rows = [("one process, 2 threads", "-", one, True)]   # (name, pair tasks, seconds, does the work)
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                                  silence_logs=50) as cluster, distributed.Client(cluster) as client:
        ones = client.persist(da.ones((4,), chunks=1))
        distributed.wait(ones)
        t = median_time(lambda: client.compute(ones.sum()).result(), args.repeats)
        rows.append(("LocalCluster 2x1, a trivial graph (four one-element chunks summed)", "-", t, False))
        qd, kd, vd = (client.persist(da.from_array(x, chunks=(1, H, N, D))) for x in (q, k, v))
        distributed.wait([qd, kd, vd])
        out = fdask.attention(qd, kd, vd, causal=True)
        total = out.sum()
        t = median_time(lambda total=total: client.compute(total).result(), args.repeats)
        rows.append(("LocalCluster 2x1, one chunk a batch (no key splits), result kept on the workers",
                     pair_tasks(out), t, True))
        for c in (int(x) for x in args.chunks.split(",")):
            qd, kd, vd = (client.persist(da.from_array(x, chunks=(B, H, c, D))) for x in (q, k, v))
            distributed.wait([qd, kd, vd])
            out = fdask.attention(qd, kd, vd, causal=True)
            tasks = pair_tasks(out)
            total = out.sum()   # the result stays on the workers; one number comes back
            t = median_time(lambda total=total: client.compute(total).result(), args.repeats)
            rows.append((f"LocalCluster 2x1, chunks of {c} rows, result kept on the workers", tasks, t, True))
            t = median_time(lambda out=out: client.compute(out).result(), args.repeats)
            rows.append((f"LocalCluster 2x1, chunks of {c} rows, result gathered to the client", tasks, t, True))
            got = client.compute(out).result()
            assert np.abs(got - fastattn.attention(q, k, v, causal=True)).max() < 1e-4
    print(f"B{B} H{H} N{N} d{D} causal float32, fastattn {fastattn.__version__} ({fastattn._core.isa_name()}), "
          f"medians of {args.repeats}")
    print("| run | pair tasks | ms | GFLOP/s | x one process |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, tasks, t, work in rows:   # (the trivial graph: its time only)
        rate, x = (f"{flop / t / 1e9:.1f}", f"{one / t:.2f}") if work else ("-", "-")
        print(f"| {name} | {tasks} | {t * 1e3:.1f} | {rate} | {x} |")


if __name__ == "__main__":
    main()
