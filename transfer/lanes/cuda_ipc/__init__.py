"""The same-host GPU lane: owners' memory mapped by CUDA IPC, pages gathered by one kernel.

Its modules need the CUDA driver (the kernel is compiled by NVRTC) to run: import them
only where a GPU is.
"""
