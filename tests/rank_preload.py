"""What the tests' rank processes import, loaded once per test process by the forkserver that
starts them (tests/helpers.py `rank_context`): each rank is then a fork of a process that has
torch, the trainer and (where installed) megatron-core on CPU through the `torch.cuda` shim
imported, instead of a fresh interpreter importing them (~4-7 CPU-s per rank)."""

import warnings

warnings.simplefilter("ignore")

import torch  # noqa: E402, F401

import training.setup  # noqa: E402, F401
import training.step  # noqa: E402, F401

try:
    from backends.megatron import cpu_shim
except ImportError:  # no megatron-core here: the torch ranks need none
    cpu_shim = None
else:
    cpu_shim.install()
    import backends.megatron.backend  # noqa: F401
    import backends.megatron.model  # noqa: F401
