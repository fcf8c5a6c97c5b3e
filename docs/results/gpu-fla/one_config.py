"""A pytest plugin for checking fla's kernels for correctness inside a short lease (``-p one_config``):
every Triton autotuner keeps one configuration, so each kernel variant compiles once instead of timing up
to 48. What it verifies is fla with the kept configuration (a miscompile can depend on the configuration);
speed is not measured with it. The kept one: fewest stages, then 4 warps where offered, then the smallest
blocks. Triton skips its pruning and benchmarking for a single configuration."""
from triton.runtime import autotuner

_init = autotuner.Autotuner.__init__


def _conservative(config):
    blocks = sum(v for v in config.kwargs.values() if isinstance(v, int))
    return (config.num_stages or 0, config.num_warps != 4, blocks)


def _one_config_init(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    if len(self.configs) > 1:
        self.configs = [min(self.configs, key=_conservative)]


autotuner.Autotuner.__init__ = _one_config_init
