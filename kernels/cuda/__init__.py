"""The cuda backend (Jetson and other NVIDIA GPUs): numba.cuda kernels (kernels.py), the
one place that touches a GPU or numba's simulator (device.py), and the binds
(backend.py). Nothing here loads numba.cuda or cupy until a kernel is bound."""
