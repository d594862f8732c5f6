"""Facts of the machine a job runs on, and the NCCL settings they call for.

``skylift doctor`` gathers the facts and judges them; the launcher reads the same facts
to set NCCL up for the workers. Both sit above this package, which imports neither.
"""
