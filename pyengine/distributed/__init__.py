"""Layer 4.5 (above experiments, below cli): sweeps on Dask. :func:`scan` runs a job over a
grid, in-process or on a Dask cluster (a ``LocalCluster`` by default from the CLI, any
scheduler by address), into a resumable store; ``scan.load(out)`` reads a stored sweep back.

Modules: :mod:`.sweep` (scan, load, the task function), :mod:`.store` (one ``.npz`` per
point + a manifest), :mod:`.jobs` (the Job interface, the ``norms`` job), :mod:`.model_jobs`
(``spectral``, ``recovery``), :mod:`.experiment_jobs` (``attention``, ``stability``: they
run the experiments, the layer below), :mod:`.worker` (per-process model cache),
:mod:`.cluster` (a local cluster bound to 127.0.0.1). :data:`JOBS` holds every job
once this package is imported.
"""

from .jobs import JOBS, Job, NormsJob, get_job, register_job, seed_of
from .model_jobs import RecoveryJob, SpectralJob, corpus_ids, corpus_text, norm_sites
from .experiment_jobs import AttentionJob, StabilityJob
from .store import Store
from .sweep import MEMORY_BUDGET, ScanResult, load, run_chunk, scan
from .cluster import local_client

scan.load = load  # pyengine.scan.load(out)

__all__ = ["AttentionJob", "JOBS", "MEMORY_BUDGET", "Job", "NormsJob", "RecoveryJob", "ScanResult", "SpectralJob",
           "StabilityJob", "Store", "corpus_ids", "corpus_text", "get_job", "load", "local_client", "norm_sites", "register_job",
           "run_chunk", "scan", "seed_of"]
