"""Errors that ftbench reports to the user as one line, without a traceback."""


class FtbenchError(Exception):
    """Base class: the message alone is what the user needs to read."""


class ConfigError(FtbenchError):
    """The experiment configuration is invalid; the message names the key path."""


class SourceError(FtbenchError):
    """A model or dataset source cannot be found or read."""


class ManifestError(FtbenchError):
    """A prepared data folder does not match its manifest (missing, truncated or altered shard)."""


class UnsupportedConfiguration(FtbenchError):
    """This machine cannot run the configuration (e.g. fp16 on a CPU); recorded as a status, not a crash."""


class TerminatedError(FtbenchError):
    """The job was terminated from outside (SIGTERM: scancel, preemption, the scheduler's own limit). It
    leaves no result, so the next invocation trains the run again; what it measured is in its log."""
