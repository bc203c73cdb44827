"""A KV cache no single worker could hold: decoding against 1,000,000 keys x 2 heads x
d64 float32 (1 GiB of K and V, made on the workers) on a LocalCluster whose 2 workers
each have a 512 MiB memory limit, against one process over the same data.  Not
collected by `pytest` (the file name does not match test_*.py: it takes tens of
seconds); CI runs `pytest tests/cluster_dask.py`."""

import dask.array as da
import distributed
import numpy as np
from conftest import assert_close

import fastattn
import fastattn.dask as fdask

N_KEYS, H, D = 1_000_000, 2, 64


def test_decode_beyond_one_workers_memory():
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, memory_limit="512MiB",
                                  dashboard_address=None, silence_logs=50) as cluster, \
            distributed.Client(cluster) as client:
        rng = da.random.default_rng(7)
        chunks = (H, 62_500, D)                                   # 32 MiB of K (and of V) a chunk
        k = rng.standard_normal((H, N_KEYS, D), chunks=chunks, dtype=np.float32)
        v = rng.standard_normal((H, N_KEYS, D), chunks=chunks, dtype=np.float32)
        q = np.random.default_rng(8).standard_normal((H, 4, D)).astype(np.float32)   # 4 new tokens a head
        assert k.nbytes + v.nbytes >= 10**9                     # 1.02 GB of K and V; 2 x 512 MiB of workers
        out, lse = fdask.attention(q, k, v, causal=True, return_lse=True)
        got, got_lse = client.compute([out, lse], sync=True)
        parts = [key for key in dict(out.__dask_graph__())
                 if isinstance(key, tuple) and key[0].startswith("fastattn-part-")]
        assert len(parts) == N_KEYS // chunks[1]                 # a task per key block, K and V never whole
        # the same data in one process (1 GiB here), computed by fastattn.attention
        k_np, v_np = da.compute(k, v, scheduler="threads")
        want, want_lse = fastattn.attention(q, k_np, v_np, causal=True, return_lse=True)
    assert_close(got, want, np.float32)
    assert_close(got_lse, want_lse, np.float32, "lse")
