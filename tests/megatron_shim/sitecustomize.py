"""Test-only: megatron-core on the CPU for every process started with this directory on
PYTHONPATH (the launcher, its actors, the trainer's rank processes inherit it).

Role: arms `backends.megatron.cpu_shim` so its `torch.cuda` stand-ins are installed the moment a
process imports megatron-core through the backend; processes that never do are unaffected.
Production runs never have this directory on their path.
"""

from backends.megatron import cpu_shim

cpu_shim.install_on_import()
