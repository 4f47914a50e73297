"""Scripts for a CUDA machine: the Triton kernels (kernels_gpu.py) and the worker on the GPU
(worker_gpu.py)."""
