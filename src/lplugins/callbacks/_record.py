"""What a commit marker records, and how checkpoints are named and ordered in their directory.

A checkpoint directory holds, for every committed checkpoint ``NAME``:

* ``NAME`` -- the data: a file (``torch.save`` zip) or a directory (sharded strategies such as DeepSpeed);
* ``NAME.commit`` -- the commit marker, a small JSON :class:`Record` written *last*.

Temporary entries start with :data:`TMP_PREFIX`; damaged committed checkpoints are moved into the
:data:`QUARANTINE` folder. Names come from a :class:`NameTemplate`: by default
``step=<9 digits>-epoch=<4 digits>.ckpt``, or a Lightning-style ``filename`` template.
"""

from __future__ import annotations

import json
import math
import re
import string
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field

COMMIT_SUFFIX = ".commit"
TMP_PREFIX = ".tmp."
#: The folder in a checkpoint directory where damaged committed checkpoints are moved (never resumed from).
QUARANTINE = "quarantine"
FORMAT_VERSION = 1
NAME_RE = re.compile(r"^step=(\d+)-epoch=(\d+)(-v\d+)?\.ckpt$")
EXTENSION = ".ckpt"
#: The fields every template may use besides metric names.
STATE_FIELDS = ("epoch", "step")
_VERSION_RE = r"(-v\d+)?"
_INT_RE = r"[-+]?\d+"
_FLOAT_RE = r"(?:[-+]?(?:\d[\d.]*(?:e[-+]?\d+)?%?|inf)|nan)"
_METRIC_NAME_RE = re.compile(r"^[A-Za-z_][\w.\-]*$")


class NameTemplate:
    """How checkpoints are named: the default, or a Lightning-style ``filename`` template.

    A template names ``{epoch}`` (the 0-based epoch of the saved step), ``{step}`` (the global step) and
    any logged metric (``{val_loss:.3f}``), with Python format specs. With ``auto_insert_metric_name``
    (as in Lightning's ``ModelCheckpoint``), ``{name}`` becomes ``name={name}``. ``.ckpt`` is appended, and
    ``-vN`` before it when the name is taken already.

    Args:
        template: The template, or ``None`` for ``step=000000012-epoch=0001``.
        auto_insert_metric_name: Write ``name=`` in front of every field.

    Raises:
        ValueError: the template is malformed (the message says how; the caller names the argument).

    >>> NameTemplate().name(NameTemplate().base(step=12, epoch=1, metrics={}), version=2)
    'step=000000012-epoch=0001-v2.ckpt'
    >>> t = NameTemplate("{epoch}-{step}-{val_loss:.3f}")
    >>> t.name(t.base(step=100, epoch=3, metrics={"val_loss": 0.12345}))
    'epoch=3-step=100-val_loss=0.123.ckpt'
    >>> bool(t.pattern.match("epoch=3-step=100-val_loss=0.123-v2.ckpt")), t.metric_names
    (True, ('val_loss',))
    """

    def __init__(self, template: str | None = None, auto_insert_metric_name: bool = True) -> None:
        self.template = template
        self.auto_insert_metric_name = auto_insert_metric_name
        self.fields: list[tuple[str, str | None, str]] = []  # (literal, field or None, format spec)
        if template is None:
            self.pattern = NAME_RE
            self.metric_names: tuple[str, ...] = ()
            return
        self.fields = _parse(template)
        self.metric_names = tuple(dict.fromkeys(f for _, f, _ in self.fields if f and f not in STATE_FIELDS))
        try:
            sample = self.base(step=0, epoch=0, metrics=dict.fromkeys(self.metric_names, 0.0))
        except (ValueError, TypeError) as err:
            raise ValueError(
                f"a format spec does not fit its value ({err}): epoch and step are ints, metrics floats"
            ) from None
        if not sample.strip(" ."):
            raise ValueError("it makes an empty name")
        regex = "".join(
            re.escape(literal) + ("" if name is None else self._label(name) + self._value_re(name, spec))
            for literal, name, spec in self.fields
        )
        self.pattern = re.compile(f"^{regex}{_VERSION_RE}{re.escape(EXTENSION)}$")

    def _label(self, name: str) -> str:
        return re.escape(name + "=") if self.auto_insert_metric_name else ""

    @staticmethod
    def _value_re(name: str, spec: str) -> str:
        if name in STATE_FIELDS and (not spec or spec[-1] in "dn"):
            return _INT_RE
        if name not in STATE_FIELDS and (not spec or spec[-1] in "eEfFgG%"):
            return _FLOAT_RE
        return r"[^/]+?"  # an unusual spec: still only names of this template (their literals anchor them)

    def base(self, step: int, epoch: int, metrics: Mapping[str, float]) -> str:
        """The name for this state, without version and extension (a metric not in ``metrics`` is nan)."""
        if self.template is None:
            return f"step={step:09d}-epoch={epoch:04d}"
        values: dict[str, float | int] = {"step": step, "epoch": epoch}
        parts = []
        for literal, name, spec in self.fields:
            parts.append(literal)
            if name is not None:
                value = values[name] if name in STATE_FIELDS else metrics.get(name, math.nan)
                parts.append((name + "=" if self.auto_insert_metric_name else "") + format(value, spec))
        return "".join(parts)

    @staticmethod
    def name(base: str, version: int = 0) -> str:
        """``base`` with ``-vN`` (for ``version`` > 0) and the extension."""
        return f"{base}-v{version}{EXTENSION}" if version else base + EXTENSION


def _parse(template: str) -> list[tuple[str, str | None, str]]:
    if not isinstance(template, str) or not template:
        raise ValueError("it must be a non-empty string")
    if "/" in template or "\\" in template or template.startswith(TMP_PREFIX):
        raise ValueError("checkpoints are files directly in dirpath: no '/' or '\\', and no leading '.tmp.'")
    if template.endswith(EXTENSION):
        raise ValueError(f"{EXTENSION!r} is appended: leave it out")
    out: list[tuple[str, str | None, str]] = []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as err:
        raise ValueError(f"{err} (write a literal brace as '{{{{' or '}}}}')") from None
    for literal, name, spec, conversion in parsed:
        if name is None:
            out.append((literal, None, ""))
            continue
        if not name:
            raise ValueError("'{}' names no field: use {epoch}, {step} or a logged metric such as {val_loss:.3f}")
        if conversion or "{" in (spec or ""):
            raise ValueError(f"field {{{name}}}: conversions ('!r') and nested fields are not supported")
        if not _METRIC_NAME_RE.match(name):
            raise ValueError(
                f"unknown field {{{name}}}: use {{epoch}}, {{step}} or the name of a logged metric (letters, digits,"
                " '_', '.', '-')"
            )
        out.append((literal, name, spec or ""))
    return out


@dataclass
class Record:
    """What a commit marker says about one committed checkpoint.

    Attributes:
        name: The checkpoint's name in its directory.
        global_step: ``trainer.global_step`` when it was taken.
        epoch: The 0-based epoch the saved step was taken in (what the name says).
        time: Wall-clock time of the commit (seconds since the epoch).
        kind: ``"file"`` or ``"dir"``.
        size: Size in bytes of a file checkpoint.
        files: For a directory checkpoint, each file's relative path and size.
        monitor: The monitored metric's name, if any.
        metric: Its value when the checkpoint was taken, if it was logged.
        reason: What triggered the save (``"step"``, ``"epoch"``, ``"time"``, ``"request"``, ...).
        seq: Commit sequence number in this directory (1, 2, ...): "newest" means the highest, whatever
            the step numbers and clocks say (a fresh run in a used directory is newer than the old run).
        crc32: CRC32 of the whole file checkpoint, when it was computed (checked at every resume).
        zip_crc: Whether the archive's per-record CRC32s were written (checked at resume when there is
            no ``crc32``).
        crcs: For a directory checkpoint, each file's CRC32 (checked at every resume).
        world_size: The number of processes that saved it (0: not recorded).
        strategy: The class name of the strategy that saved it (empty: not recorded).
    """

    name: str
    global_step: int
    epoch: int
    time: float
    kind: str = "file"
    size: int = 0
    files: dict[str, int] = field(default_factory=dict)
    monitor: str | None = None
    metric: float | None = None
    reason: str = ""
    seq: int = 0
    crc32: int | None = None
    zip_crc: bool = True
    crcs: dict[str, int] = field(default_factory=dict)
    world_size: int = 0
    strategy: str = ""
    format: int = FORMAT_VERSION

    def to_json(self) -> bytes:
        """The marker's contents."""
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Record:
        """Parse a marker, checking every field's type (a ``bool`` is not an ``int``).

        Unknown fields are ignored (a newer writer may add some).

        Raises:
            ValueError: not a marker of a known format, or a field of the wrong type (the message names
                the field, its value and what is allowed).

        >>> Record.from_json(Record("a.ckpt", 3, 0, 1.0).to_json()).global_step
        3
        >>> Record.from_json(b'{"format": 1, "name": "a.ckpt", "global_step": 3, "epoch": 0, "time": 1, "seq": "2"}')
        Traceback (most recent call last):
        ...
        ValueError: commit marker field 'seq' is '2' (str): expected an int >= 0
        """
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as err:
            raise ValueError(f"not a commit marker: not JSON ({err})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT_VERSION:
            raise ValueError("not a commit marker of a known format")
        missing = [k for k in _REQUIRED if k not in data]
        if missing:
            raise ValueError(f"commit marker lacks field(s) {', '.join(missing)}")
        for key, (check, allowed) in _FIELD_TYPES.items():
            if key in data and not check(data[key]):
                value = data[key]
                raise ValueError(
                    f"commit marker field {key!r} is {value!r} ({type(value).__name__}): expected {allowed}"
                )
        allowed_keys = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in allowed_keys})


def _is_int(v: object, minimum: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= minimum


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_name(v: object) -> bool:
    return isinstance(v, str) and bool(v) and "/" not in v and "\\" not in v and v not in (".", "..")


def _is_sizes(v: object) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and _is_int(n) for k, n in v.items())


def _is_crc(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 32


_REQUIRED = ("name", "global_step", "epoch", "time")
#: field -> (check, what is allowed): every field of :class:`Record` a marker may carry.
_FIELD_TYPES: dict[str, tuple[Callable[[object], bool], str]] = {
    "name": (_is_name, "a file name (a non-empty string without '/')"),
    "global_step": (_is_int, "an int >= 0"),
    "epoch": (_is_int, "an int >= 0"),
    "time": (_is_number, "a number"),
    "kind": (lambda v: v in ("file", "dir"), "'file' or 'dir'"),
    "size": (_is_int, "an int >= 0"),
    "files": (_is_sizes, "a dict of relative path -> int size"),
    "monitor": (lambda v: v is None or isinstance(v, str), "a string or null"),
    "metric": (lambda v: v is None or _is_number(v), "a number or null"),
    "reason": (lambda v: isinstance(v, str), "a string"),
    "seq": (_is_int, "an int >= 0"),
    "crc32": (lambda v: v is None or _is_crc(v), "an int CRC32 or null"),
    "zip_crc": (lambda v: isinstance(v, bool), "a bool"),
    "crcs": (lambda v: isinstance(v, dict) and all(isinstance(k, str) and _is_crc(c) for k, c in v.items()),
             "a dict of relative path -> int CRC32"),
    "world_size": (_is_int, "an int >= 0"),
    "strategy": (lambda v: isinstance(v, str), "a string"),
}  # fmt: skip


def order(record: Record) -> tuple[int, int, float]:
    """Sort key: commit order."""
    return (record.seq, record.global_step, record.time)


def now() -> float:
    """Wall-clock time for commit records."""
    return time.time()
