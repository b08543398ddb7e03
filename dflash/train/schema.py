"""The old address of dflash.train.config.schema (the settings' flags, TOML keys and saved configs), which the docs gave before the
package moved: tools written against it keep importing from here. New code imports dflash.train.config.schema."""

from dflash.train.config.schema import *  # noqa: F403
