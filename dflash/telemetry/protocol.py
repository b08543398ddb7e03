"""The old address of dflash.telemetry.wire.protocol (the frames), which the docs gave before the
package moved: tools written against it keep importing from here. New code imports dflash.telemetry.wire.protocol."""

from dflash.telemetry.wire.protocol import *  # noqa: F403
