"""The old address of dflash.telemetry.wire.reader (the one frame reader), which the docs gave before the
package moved: tools written against it keep importing from here. New code imports dflash.telemetry.wire.reader."""

from dflash.telemetry.wire.reader import *  # noqa: F403
