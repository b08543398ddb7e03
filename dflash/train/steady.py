"""The old address of dflash.train.run.steady (steady-state steps under a sync guard), which the docs gave before the
package moved: tools written against it keep importing from here. New code imports dflash.train.run.steady."""

from dflash.train.run.steady import *  # noqa: F403
