"""What a worker's name may be (``JoinRequest.worker_name``): checked by the worker's
config and again by the server, so a name cannot break the status table, forge lines of
the server's log or flood it."""

from __future__ import annotations

from asyncdiloco.errors import ConfigError, quoted

#: The longest worker name, in characters.
MAX_NAME_CHARS = 200


def check_worker_name(name: str) -> str:
    """``name`` when it is a valid worker name: empty (the server names the worker
    "worker-<id>"), or at most ``MAX_NAME_CHARS`` printable characters (no newline, tab or
    other control character), neither all spaces nor starting or ending with one.

    Raises:
        ConfigError: the name breaks one of those rules (the message says which).
    """
    if not name:
        return name
    if len(name) > MAX_NAME_CHARS:
        raise ConfigError(
            f"worker_name {quoted(name)} has {len(name)} characters; the limit is {MAX_NAME_CHARS}: give a shorter "
            f"--worker-name"
        )
    if not name.isprintable():
        raise ConfigError(
            f"worker_name {quoted(name)} holds a control character (newline, tab, escape, ...); give a --worker-name "
            f"of printable characters"
        )
    if not name.strip():
        raise ConfigError(f"worker_name {quoted(name)} is only spaces; give a --worker-name with a visible character")
    if name != name.strip():  # it would look like another name in the status table and the logs
        raise ConfigError(
            f"worker_name {quoted(name)} starts or ends with a space; give --worker-name {quoted(name.strip())}"
        )
    return name
