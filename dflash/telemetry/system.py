"""The old address of dflash.telemetry.wire.system (the process, thread and GPU sampler), which moved into
the wire when dflash-top began sampling processes it does not own (`dflash-top --pid`): tools written
against it keep importing from here. New code imports dflash.telemetry.wire.system."""

from dflash.telemetry.wire.system import *  # noqa: F403
from dflash.telemetry.wire.system import SystemSampler, cuda_ordinals  # noqa: F401 - named for the linters
