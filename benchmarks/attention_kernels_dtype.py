"""Issue 11: the fused attention kernels at T = 2000 (dk 10, dv 15, one head), numba vs cpp, float32 vs float64,
1 and 2 threads (medians of 5). Run: python benchmarks/attention_kernels_dtype.py"""
import time, numpy as np
from pyengine.backends import resolve
import pyengine as pe
def med(f, n=5):
    ts=[]
    for _ in range(n):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    return 1e3*np.median(ts)
T=2000
for threads in (1, 2):
    pe.set_num_threads(threads)
    for dt in (np.float32, np.float64):
        rng=np.random.default_rng(0)
        q=rng.standard_normal((1,T,10)).astype(dt); k=rng.standard_normal((1,T,10)).astype(dt); v=rng.standard_normal((1,T,15)).astype(dt)
        o=np.empty((1,T,15),dt); lse=np.empty((1,T)); ent=np.empty((1,T))
        do=rng.standard_normal((1,T,15)).astype(dt); dq=np.empty_like(q); dk=np.empty_like(k); dv=np.empty_like(v); sp=np.empty((1,T))
        for be in ("numba","cpp"):
            fw=resolve("attention_forward",be); bw=resolve("attention_backward",be)
            fw(q,k,v,0,1/np.sqrt(10),o,lse,ent); bw(q,k,v,o,do,lse,0,1/np.sqrt(10),dq,dk,dv,sp)
            tf=med(lambda: fw(q,k,v,0,1/np.sqrt(10),o,lse,ent)); tb=med(lambda: bw(q,k,v,o,do,lse,0,1/np.sqrt(10),dq,dk,dv,sp))
            print(f"threads {threads} {np.dtype(dt).name} {be}: fwd {tf:.1f} ms bwd {tb:.1f} ms", flush=True)
