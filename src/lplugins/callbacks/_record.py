"""What a commit marker records, and how checkpoints are named and ordered in their directory.

A checkpoint directory holds, for every committed checkpoint ``NAME``:

* ``NAME`` -- the data: a file (``torch.save`` zip) or a directory (sharded strategies such as DeepSpeed);
* ``NAME.commit`` -- the commit marker, a small JSON :class:`Record` written *last*.

Temporary entries start with :data:`TMP_PREFIX`.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field

COMMIT_SUFFIX = ".commit"
TMP_PREFIX = ".tmp."
FORMAT_VERSION = 1
NAME_RE = re.compile(r"^step=(\d+)-epoch=(\d+)(-v\d+)?\.ckpt$")


def checkpoint_name(global_step: int, epoch: int, version: int = 0) -> str:
    """The name of the checkpoint taken after ``global_step`` optimizer steps in ``epoch``.

    ``version`` > 0 adds ``-vN``: a name that a checkpoint of another run holds already is never reused.

    >>> checkpoint_name(12, 1), checkpoint_name(12, 1, version=2)
    ('step=000000012-epoch=0001.ckpt', 'step=000000012-epoch=0001-v2.ckpt')
    """
    suffix = f"-v{version}" if version else ""
    return f"step={global_step:09d}-epoch={epoch:04d}{suffix}.ckpt"


@dataclass
class Record:
    """What a commit marker says about one committed checkpoint.

    Attributes:
        name: The checkpoint's name in its directory.
        global_step: ``trainer.global_step`` when it was taken.
        epoch: ``trainer.current_epoch`` when it was taken.
        time: Wall-clock time of the commit (seconds since the epoch).
        kind: ``"file"`` or ``"dir"``.
        size: Size in bytes of a file checkpoint.
        files: For a directory checkpoint, each file's relative path and size.
        monitor: The monitored metric's name, if any.
        metric: Its value when the checkpoint was taken, if it was logged.
        reason: What triggered the save (``"step"``, ``"epoch"``, ``"time"``, ``"request"``, ...).
        seq: Commit sequence number in this directory (1, 2, ...): "newest" means the highest, whatever
            the step numbers and clocks say (a fresh run in a used directory is newer than the old run).
        crc32: CRC32 of the whole file checkpoint, when it was computed (``verify="deep"`` checks it).
        zip_crc: Whether the archive's per-record CRC32s were written (checked by ``verify="deep"``
            when there is no ``crc32``).
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
    format: int = FORMAT_VERSION

    def to_json(self) -> bytes:
        """The marker's contents."""
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Record:
        """Parse a marker.

        Raises:
            ValueError: not a marker of a known format.
        """
        data = json.loads(raw)
        if not isinstance(data, dict) or data.get("format") != FORMAT_VERSION:
            raise ValueError("not a commit marker of a known format")
        allowed = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in allowed})


def order(record: Record) -> tuple[int, int, float]:
    """Sort key: commit order."""
    return (record.seq, record.global_step, record.time)


def now() -> float:
    """Wall-clock time for commit records."""
    return time.time()
