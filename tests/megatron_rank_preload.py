"""What every megatron rank process of the tests imports, loaded once per test process by the
forkserver that starts them (tests/test_megatron_parallel.py `run_ranks`): each rank is then a
fork of a process that has torch, megatron-core (on CPU, through the `torch.cuda` shim) and the
trainer imported, instead of a fresh interpreter importing them (~7 CPU-s per rank)."""

import warnings

warnings.simplefilter("ignore")

from backends.megatron import cpu_shim  # noqa: E402

cpu_shim.install()

import backends.megatron.backend  # noqa: E402, F401
import backends.megatron.model  # noqa: E402, F401
import training.setup  # noqa: E402, F401
import training.step  # noqa: E402, F401
