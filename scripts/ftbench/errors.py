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
    """The job was terminated from outside (SIGTERM: scancel, preemption, the scheduler's own limit). A cancel or a
    preemption leaves no result, so the next invocation trains the run again; the scheduler's time limit leaves a
    timeout row of the steps taken in the run's kept/ folder (cluster/kept_rows.py), which the next job keeps."""


def describe(exc: BaseException, limit: int = 300) -> str:
    """An exception as one line, 'Type: message', with its root cause where it wraps another: a wrapper's own
    words can hide what to fix (transformers' lazy import says only "Could not import module 'Trainer'"; its
    cause says "No module named 'multiprocess'")."""
    line = _one_line(exc)
    root = exc
    seen = {id(exc)}
    while True:  # explicit causes only (raise ... from): an error raised while handling another need not be its effect
        nested = root.__cause__
        if nested is None or id(nested) in seen:
            break
        seen.add(id(nested))
        root = nested
    if root is not exc and _one_line(root) not in line:
        cause = _one_line(root)
        # The cause is what to act on: the wrapper's words are cut first when the line is too long.
        return f"{line[:max(60, limit - len(cause) - 13)]} (caused by {cause})"[:limit]
    return line[:limit]


def _one_line(exc: BaseException) -> str:
    message = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__
