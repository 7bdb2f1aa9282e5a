"""File and folder names as the data modules show and store them.

A name on Linux is any bytes but "/" and NUL: a newline, a terminal escape, bytes that are not
UTF-8. Python hands undecodable bytes over as lone surrogates ("\\udcff"), which neither a log
handler writing UTF-8 nor a TensorFlow string tensor accepts, and a newline in a name would start a
new line in the log, so a name could forge one. Hence two forms:

  shown(name)   for log lines and errors: `repr`, quoted and escaped (a newline is "\\n", a byte
                that is not UTF-8 "\\udcff"); one line whatever the name holds.
  stored(name)  for what a record, `labels.json` or `labels.txt` holds: valid UTF-8 on one line,
                undecodable bytes as "\\xff" and control characters as their escapes, so that
                readers in any language can decode it.
  inline(path)  a path the user gave (an output folder): as it is when it is printable, else
                `shown`.
  as_bytes(path) the path as the operating system spells it, for TensorFlow's file ops.
"""

import os


def shown(name) -> str:
    """`name` (a str or bytes path) quoted and escaped for a log line or an error."""
    return repr(os.fsdecode(name) if isinstance(name, bytes) else os.fspath(name))


def inline(path) -> str:
    """`path` as it is when every character of it is printable, else `shown(path)`."""
    text = os.fsdecode(path) if isinstance(path, bytes) else os.fspath(path)
    return text if text.isprintable() and text == stored(text) else shown(text)


def stored(name) -> str:
    """`name` as valid, printable UTF-8 text: bytes that are not UTF-8 as "\\xNN", control
    characters (a newline, a tab, an escape) as their Python escapes."""
    raw = name if isinstance(name, bytes) else as_bytes(name)
    text = raw.decode("utf-8", "backslashreplace")
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def as_bytes(path) -> bytes:
    """The bytes the operating system knows `path` by (a str from `os.listdir` may hold the
    surrogates of undecodable bytes, which `os.fsencode` turns back into those bytes)."""
    path = os.fspath(path)
    if isinstance(path, bytes):
        return path
    try:
        return os.fsencode(path)
    except UnicodeEncodeError:
        # A surrogate that no file system listing made (a caller's own string): escaped, as it
        # cannot name a file anyway.
        return path.encode("utf-8", "backslashreplace")
